"""Endpoint probe: does an OpenAI-compatible server give the same completion whatever the load?

``candle-gate probe --endpoint URL`` and :func:`probe_endpoint` send every prompt ``repeats``
times, at every concurrency level, in several arrival orders (``ORDERS``):

- ``alone``: one request at a time, in prompt order (counted as concurrency 1);
- ``burst``: every prompt's request at once through a thread pool of size C (skipped at C=1
  when ``alone`` runs: it would be the same load);
- ``interleaved``: the prompts shuffled (``random.Random(shuffle_seed + 1000 * repeat + C)``)
  through a thread pool of size C.

The requests, their retries and the streams are :mod:`.endpoint_client`'s (:class:`Sender`);
the scoring, the table and the PNG :mod:`.endpoint_report`'s (:func:`score_completions`,
:func:`format_report`, :func:`plot_report`); the prompts and the files :mod:`.common`'s, shared
with the in-process probe. This module plans the passes and runs them; it also exports the
endpoint probe's whole API (the command line, its flags and its files are
:mod:`candle_gate.cli.probe`'s). The JSON format is documented in docs/ENDPOINT_PROBE.md.
"""
from __future__ import annotations

import os
import random
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from .. import _native
from . import common
from .common import check_concurrency, check_prompts, is_chat, progress_bar, prompt_kind
from .endpoint_client import (DEFAULT_API_KEY, IncompleteStream, RetryPolicy, Sender, assemble_stream,
                              base_url, make_client)
from .endpoint_report import FORMAT, format_report, make_extractor, plot_report, score_completions, summarize

__all__ = [
    "probe_endpoint", "parse_orders", "plan_passes", "write_json",
    "ORDERS", "DEFAULT_REPEATS", "DEFAULT_CONCURRENCY", "DEFAULT_MAX_TOKENS", "DEFAULT_TOP_LOGPROBS", "FORMAT",
    "DEFAULT_API_KEY",
    "RetryPolicy", "Sender", "IncompleteStream", "assemble_stream", "base_url", "make_client",
    "make_extractor", "score_completions", "summarize", "format_report", "plot_report",
    "is_chat", "prompt_kind",
]

ORDERS = ("alone", "burst", "interleaved")
DEFAULT_REPEATS = 3
DEFAULT_CONCURRENCY = (1, 4)
DEFAULT_MAX_TOKENS = 32
DEFAULT_TOP_LOGPROBS = 2

Pass = Tuple[int, str, int]  # (repeat, order, concurrency)


def parse_orders(spec: Union[None, str, Sequence[str]]) -> List[str]:
    if spec is None:
        return list(ORDERS)
    names = [x.strip() for x in spec.split(",") if x.strip()] if isinstance(spec, str) else list(spec)
    bad = [x for x in names if x not in ORDERS]
    if bad or not names:
        raise ValueError(f"--orders: unknown order(s) {bad or names!r}; choose from {', '.join(ORDERS)}")
    return list(dict.fromkeys(names))


def plan_passes(repeats: int, levels: Sequence[int], orders: Sequence[str]) -> List[Pass]:
    """The passes in the order they run: per repeat, ``alone``, then per concurrency ``burst``
    (not at C=1 when ``alone`` runs) and ``interleaved``."""
    passes: List[Pass] = []
    for r in range(repeats):
        if "alone" in orders:
            passes.append((r, "alone", 1))
        for c in levels:
            if "burst" in orders and not (c == 1 and "alone" in orders):
                passes.append((r, "burst", c))
            if "interleaved" in orders:
                passes.append((r, "interleaved", c))
    return passes


def _api_key(api_key: Optional[str], api_key_env: Optional[str]) -> Optional[str]:
    if api_key is None and api_key_env:
        api_key = os.environ.get(api_key_env)
        if not api_key:
            raise ValueError(f"--api-key-env: environment variable {api_key_env} is not set")
    return api_key


def _run_pass(sender: Sender, prompts: Sequence[Any], p: Pass, shuffle_seed: int, bar: Any,
              results: List[List[Dict[str, Any]]], errors: List[List[Dict[str, Any]]]) -> None:
    """One pass: every prompt once under its load; each outcome appended to its prompt's
    ``results`` (a completion) or ``errors`` (a request that failed for good)."""
    r, order, c = p
    idx = list(range(len(prompts)))
    if order == "interleaved":
        random.Random(shuffle_seed + 1000 * r + c).shuffle(idx)
    meta = {"order": order, "concurrency": c, "repeat": r}

    def record(i: int, o: Dict[str, Any]) -> None:
        if o["ok"]:
            results[i].append({**meta, **{k: o[k] for k in ("text", "tokens", "top", "fingerprint", "finish_reason")}})
        else:
            errors[i].append({**meta, "error": o["error"], "status": o["status"], "attempts": o["attempts"]})
        bar.update()

    if order == "alone" or c == 1:
        for i in idx:
            record(i, sender.send(prompts[i]))
        return
    with ThreadPoolExecutor(max_workers=c) as ex:
        for i, o in zip(idx, ex.map(lambda i: sender.send(prompts[i]), idx)):
            record(i, o)


def probe_endpoint(url: str, model: str, prompts: Sequence[Any], repeats: int = DEFAULT_REPEATS,
                   concurrency: Union[int, Sequence[int]] = DEFAULT_CONCURRENCY, max_tokens: int = DEFAULT_MAX_TOKENS,
                   temperature: float = 0.0, seed: Optional[int] = None,
                   api_key: Optional[str] = None, api_key_env: Optional[str] = None,
                   extract: Optional[str] = None, json_field: Optional[str] = None,
                   top_logprobs: int = DEFAULT_TOP_LOGPROBS, orders: Union[None, str, Sequence[str]] = None,
                   shuffle_seed: int = 0, timeout: float = 120.0, retry: Optional[RetryPolicy] = None,
                   progress: bool = False, stream: bool = False) -> Dict[str, Any]:
    """Probes the OpenAI-compatible endpoint at ``url`` (``http://host:port/v1``; a bare
    ``http://host:port`` gets ``/v1``) with ``prompts`` (strings, chats or lists of token ids)
    and returns the report (docs/ENDPOINT_PROBE.md). ``api_key`` or the environment variable
    named ``api_key_env`` (never printed); ``top_logprobs`` < 0 asks for no logprobs;
    ``stream``: streaming requests (SSE), each completion assembled from its chunks;
    ``progress``: a progress bar on stderr (on a terminal)."""
    import openai  # noqa: F401  (the `endpoint` extra: fail before anything else)
    prompts = check_prompts(list(prompts))  # strings, chats, token ids (normalized to lists of int)
    if repeats < 1:
        raise ValueError(f"--repeats must be at least 1, got {repeats}")
    if max_tokens < 1:
        raise ValueError(f"--max-tokens must be at least 1, got {max_tokens}")
    if top_logprobs > _native.MAX_TOP_LOGPROBS:
        raise ValueError(f"--top-logprobs must be at most {_native.MAX_TOP_LOGPROBS}, got {top_logprobs}")
    levels = check_concurrency(concurrency)
    order_names = parse_orders(orders)
    extractor = make_extractor(extract, json_field)
    api_key = _api_key(api_key, api_key_env)
    client = make_client(url, api_key, timeout)
    sender = Sender(client, model, max_tokens, float(temperature), seed, top_logprobs, retry or RetryPolicy(),
                    api_key or "", stream=bool(stream))

    passes = plan_passes(repeats, levels, order_names)
    results: List[List[Dict[str, Any]]] = [[] for _ in prompts]
    errors: List[List[Dict[str, Any]]] = [[] for _ in prompts]
    t0 = time.time()
    with progress_bar(len(passes) * len(prompts), enabled=progress, unit="req") as bar:
        for k, p in enumerate(passes):
            bar.set_postfix_str(f"pass {k + 1}/{len(passes)}: {p[1]} at concurrency {p[2]} (repeat {p[0] + 1})")
            _run_pass(sender, prompts, p, shuffle_seed, bar, results, errors)
    elapsed = time.time() - t0
    # Score each prompt's completions in the order the passes ran (alone first).
    per_prompt = [score_completions(results[i], extractor, errors[i]) for i in range(len(prompts))]
    settings = {
        "endpoint": base_url(url), "model": model, "repeats": repeats, "concurrency": levels,
        "orders": order_names, "max_tokens": max_tokens, "temperature": float(temperature), "seed": seed,
        "top_logprobs": top_logprobs, "extract": extract, "json_field": json_field,
        "shuffle_seed": shuffle_seed, "stream": bool(stream),
        "logprobs": {"requested": top_logprobs >= 0, "used": sender.logprobs, "note": sender.logprobs_note},
        "retries": dict(sender.retries), "elapsed_s": round(elapsed, 3),
    }
    return summarize(prompts, per_prompt, settings)


def write_json(obj: Any, path: str) -> None:
    """The endpoint probe's JSON (prompts and completions as UTF-8, not ``\\u`` escapes)."""
    common.write_json(obj, path, ensure_ascii=False)
