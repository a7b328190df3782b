"""Endpoint probe: does an OpenAI-compatible server give the same completion whatever the load?

``candle-gate probe --endpoint URL`` and :func:`probe_endpoint` send every prompt ``repeats``
times, at every concurrency level, in several arrival orders (``ORDERS``):

- ``alone``: one request at a time, in prompt order (counted as concurrency 1);
- ``burst``: every prompt's request at once through a thread pool of size C (skipped at C=1
  when ``alone`` runs: it would be the same load);
- ``interleaved``: the prompts shuffled (``random.Random(shuffle_seed + 1000 * repeat + C)``)
  through a thread pool of size C.

It talks to the endpoint with the official ``openai`` client (chat completions for a chat,
completions for a string or a list of token ids), ``max_retries=0``, non-streaming or, with
``stream=True``, streaming (SSE: the completion, its per-token logprobs and
``system_fingerprint`` are assembled from the chunks), and retries itself (:class:`RetryPolicy`): a 429
sleeps its ``Retry-After`` (bounded), transport errors and 5xx back off exponentially, a bounded
number of times; a request that still fails is an error of its prompt, never a completion.
Logprobs (with ``top_logprobs``) are asked for; if the endpoint rejects them (400/422) the
request is retried without and the rest of the run goes without (noted in the report).

:func:`score_completions` scores one prompt's completions (the report's per-prompt entry);
:func:`format_report`, :func:`plot_report` and :func:`write_json` write the table, the PNG and
the JSON. The JSON format is documented in docs/ENDPOINT_PROBE.md.
"""
from __future__ import annotations

import json
import os
import random
import re
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

from .bench import parse_concurrency

FORMAT = "candle-gate endpoint probe 1"
ORDERS = ("alone", "burst", "interleaved")
DEFAULT_TOP_LOGPROBS = 2
DEFAULT_API_KEY = "EMPTY"


@dataclass
class RetryPolicy:
    """``max_retries`` retries after the first attempt (any kind of failure together);
    ``backoff`` * 2**k seconds before retry k (transport errors and 5xx), capped at
    ``max_backoff``; a 429 sleeps its ``Retry-After`` (seconds), capped at ``max_retry_after``
    (``backoff`` * 2**k without the header)."""
    max_retries: int = 3
    backoff: float = 0.5
    max_backoff: float = 8.0
    max_retry_after: float = 30.0

    def delay(self, k: int) -> float:
        return min(self.max_backoff, self.backoff * (2 ** k))


# ------------------------------------------------------------------------------------- extraction

def make_extractor(extract: Optional[str] = None,
                   json_field: Optional[str] = None) -> Optional[Callable[[str], Optional[str]]]:
    """The answer of a completion: ``extract`` a regex (its first group, else the whole match),
    or ``json_field`` a dotted path (``a.b.0``) into the completion parsed as JSON (the text,
    else its outermost ``{...}``/``[...]``), the value as canonical JSON. None: no answer found.
    Raises ValueError for a bad regex or both given."""
    if extract is not None and json_field is not None:
        raise ValueError("give --extract or --json-field, not both")
    if extract is not None:
        try:
            rx = re.compile(extract)
        except re.error as e:
            raise ValueError(f"--extract: bad regular expression {extract!r}: {e}") from None

        def by_regex(text: str) -> Optional[str]:
            m = rx.search(text)
            if m is None:
                return None
            return m.group(1) if rx.groups else m.group(0)
        return by_regex
    if json_field is not None:
        if not json_field.strip():
            raise ValueError("--json-field: empty path")
        path = json_field.split(".")

        def by_json(text: str) -> Optional[str]:
            obj = _parse_json(text)
            if obj is _MISSING:
                return None
            for key in path:
                if isinstance(obj, dict) and key in obj:
                    obj = obj[key]
                elif isinstance(obj, list) and re.fullmatch(r"-?\d+", key) and -len(obj) <= int(key) < len(obj):
                    obj = obj[int(key)]
                else:
                    return None
            return json.dumps(obj, sort_keys=True, ensure_ascii=False)
        return by_json
    return None


_MISSING = object()


def _parse_json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        pass
    for open_, close in (("{", "}"), ("[", "]")):
        i, j = text.find(open_), text.rfind(close)
        if 0 <= i < j:
            try:
                return json.loads(text[i:j + 1])
            except ValueError:
                pass
    return _MISSING


# ---------------------------------------------------------------------------------------- scoring

def _first_difference(a: Sequence[Any], b: Sequence[Any]) -> Optional[int]:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _gap(top: Optional[Sequence[Sequence[float]]], pos: int) -> Optional[float]:
    if top is None or pos >= len(top) or len(top[pos]) < 2:
        return None
    lp = sorted(top[pos], reverse=True)
    return float(lp[0] - lp[1])


def _majority(values: Sequence[Any]) -> Tuple[Any, int]:
    """The most frequent value (ties: the first seen) and its count."""
    c = Counter(values)
    best = max(c.values())
    for v in values:
        if c[v] == best:
            return v, best
    raise ValueError("no values")


def _load_key(c: Dict[str, Any]) -> str:
    return str(c.get("concurrency", 1))


def score_completions(completions: Sequence[Dict[str, Any]],
                      extractor: Optional[Callable[[str], Optional[str]]] = None,
                      errors: Sequence[Dict[str, Any]] = ()) -> Dict[str, Any]:
    """Scores one prompt's completions (in the order they were sent; ties for the majority go
    to the first seen, i.e. the first ``alone`` run). Each completion is a dict with ``text``
    and optionally ``tokens`` (token strings), ``top`` (per position, the top logprobs),
    ``fingerprint`` (``system_fingerprint``), ``order``, ``concurrency``, ``repeat``.
    ``errors``: the prompt's failed requests (counted, listed; never scored).
    Returns the report's per-prompt entry (docs/ENDPOINT_PROBE.md)."""
    n = len(completions)
    out: Dict[str, Any] = {"n": n, "errors": len(errors), "error_list": list(errors)}
    if n == 0:
        out.update({"distinct": 0, "k_of_n": [0, 0], "flips": 0, "identical": False, "majority": None,
                    "first_divergence": None, "divergence_unit": None, "gap_at_divergence": None,
                    "divergences": [], "fingerprints": [], "fingerprint_change": False,
                    "flip_under_one_fingerprint": False, "by_fingerprint": {}, "by_concurrency": {},
                    "by_order": {}, "completions": [], "answer": None})
        return out
    texts = [c["text"] for c in completions]
    maj_text, k = _majority(texts)
    mi = texts.index(maj_text)
    maj = completions[mi]
    divs: List[Dict[str, Any]] = []
    for c in completions:
        if c["text"] == maj_text:
            continue
        if maj.get("tokens") is not None and c.get("tokens") is not None \
                and _first_difference(maj["tokens"], c["tokens"]) is not None:
            pos, unit = _first_difference(maj["tokens"], c["tokens"]), "tokens"
            gap = _gap(maj.get("top"), pos)
        else:
            pos, unit, gap = _first_difference(maj_text, c["text"]), "chars", None
        divs.append({"position": pos, "unit": unit, "gap": gap, "order": c.get("order"),
                     "concurrency": c.get("concurrency"), "repeat": c.get("repeat"),
                     "fingerprint": c.get("fingerprint")})
    first = min(divs, key=lambda d: (d["unit"] != "tokens", d["position"])) if divs else None
    fps = [c.get("fingerprint") for c in completions]
    by_fp: Dict[str, Any] = {}
    for fp in dict.fromkeys(fps):
        group = [t for t, f in zip(texts, fps) if f == fp]
        _, kg = _majority(group)
        by_fp[str(fp)] = {"n": len(group), "distinct": len(set(group)), "k_of_n": [kg, len(group)]}
    group_majorities = {str(fp): _majority([t for t, f in zip(texts, fps) if f == fp])[0]
                        for fp in dict.fromkeys(fps)}

    def breakdown(key: Callable[[Dict[str, Any]], str]) -> Dict[str, Any]:
        res: Dict[str, Any] = {}
        for c in completions:
            e = res.setdefault(key(c), {"n": 0, "texts": set(), "flips": 0})
            e["n"] += 1
            e["texts"].add(c["text"])
            e["flips"] += c["text"] != maj_text
        return {kk: {"n": v["n"], "distinct": len(v["texts"]), "flips": v["flips"]} for kk, v in res.items()}

    distinct_list = []
    for t, cnt in Counter(texts).most_common():
        distinct_list.append({"text": t, "count": cnt,
                              "fingerprints": sorted({str(c.get("fingerprint")) for c in completions
                                                      if c["text"] == t}),
                              "loads": sorted({f"{c.get('order')}@{c.get('concurrency')}"
                                               for c in completions if c["text"] == t})})
    out.update({
        "distinct": len(set(texts)),
        "k_of_n": [k, n],
        "flips": n - k,
        "identical": len(set(texts)) == 1,
        "majority": maj_text,
        "first_divergence": first["position"] if first else None,
        "divergence_unit": first["unit"] if first else None,
        "gap_at_divergence": first["gap"] if first else None,
        "divergences": divs,
        "fingerprints": sorted({str(f) for f in fps}),
        "fingerprint_change": len(set(fps)) > 1,
        "flip_under_one_fingerprint": any(v["distinct"] > 1 for v in by_fp.values()),
        "outputs_differ_across_fingerprints": len(set(group_majorities.values())) > 1,
        "by_fingerprint": by_fp,
        "by_concurrency": breakdown(_load_key),
        "by_order": breakdown(lambda c: str(c.get("order"))),
        "completions": distinct_list,
        "answer": None,
    })
    if extractor is not None:
        answers = [extractor(t) for t in texts]
        amaj, ak = _majority(answers)
        out["answer"] = {"distinct": len(set(answers)), "k_of_n": [ak, n], "flips": n - ak,
                         "majority": amaj, "unparsed": sum(a is None for a in answers),
                         "values": dict(Counter("null" if a is None else a for a in answers))}
    return out


def summarize(prompts: Sequence[Any], per_prompt: Sequence[Dict[str, Any]],
              settings: Dict[str, Any]) -> Dict[str, Any]:
    """The top-level report around the per-prompt entries."""
    entries = []
    for i, (p, e) in enumerate(zip(prompts, per_prompt)):
        entries.append({"index": i, "kind": prompt_kind(p), "prompt": p, **e})
    scored = [e for e in entries if e["n"] > 0]
    has_answer = any(e["answer"] is not None for e in entries)
    fps = sorted({f for e in entries for f in e["fingerprints"]})
    return {
        "format": FORMAT,
        **settings,
        "requests": sum(e["n"] + e["errors"] for e in entries),
        "completions": sum(e["n"] for e in entries),
        "errors": sum(e["errors"] for e in entries),
        "all_identical": bool(scored) and len(scored) == len(entries) and all(e["identical"] for e in entries),
        "prompts_with_flips": sum(e["distinct"] > 1 for e in entries),
        "prose_flips": sum(e["flips"] for e in entries),
        "answer_flips": sum(e["answer"]["flips"] for e in entries if e["answer"]) if has_answer else None,
        "prompts_with_answer_flips": (sum(e["answer"]["distinct"] > 1 for e in entries if e["answer"])
                                      if has_answer else None),
        "fingerprints": fps,
        "fingerprint_change": len(fps) > 1,
        "flip_under_one_fingerprint": any(e["flip_under_one_fingerprint"] for e in entries),
        "prompts": entries,
    }


# ------------------------------------------------------------------------------------- requests

def _retry_after(err: Any) -> Optional[float]:
    resp = getattr(err, "response", None)
    if resp is None:
        return None
    v = resp.headers.get("retry-after")
    if v is None:
        return None
    try:
        return max(0.0, float(v))
    except ValueError:
        pass
    try:  # an HTTP date
        from email.utils import parsedate_to_datetime
        return max(0.0, parsedate_to_datetime(v).timestamp() - time.time())
    except (TypeError, ValueError):
        return None


def is_chat(prompt: Any) -> bool:
    """A chat (a non-empty list of message dicts) goes to /v1/chat/completions; a string or a
    list of token ids to /v1/completions."""
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict)


def prompt_kind(prompt: Any) -> str:
    if is_chat(prompt):
        return "chat"
    return "completion" if isinstance(prompt, str) else "token_ids"


class IncompleteStream(Exception):
    """A streamed response that ended before its choice's ``finish_reason``."""


def _read_errors() -> Tuple[type, ...]:
    """Transport errors that reading a stream can raise unwrapped (older ``openai`` clients let
    httpx's through; newer ones raise ``APIConnectionError``)."""
    try:
        import httpx
    except ImportError:
        return (IncompleteStream,)
    return (httpx.TransportError, IncompleteStream)


def _is_timeout(e: Exception) -> bool:
    try:
        import httpx
    except ImportError:
        return False
    return isinstance(e, httpx.TimeoutException)


class _Sender:
    def __init__(self, client: Any, model: str, max_tokens: int, temperature: float, seed: Optional[int],
                 top_logprobs: int, policy: RetryPolicy, secret: str, stream: bool = False):
        self.client, self.model, self.max_tokens = client, model, max_tokens
        self.temperature, self.seed, self.top = temperature, seed, top_logprobs
        self.policy, self.secret, self.stream = policy, secret, stream
        self.logprobs = top_logprobs is not None and top_logprobs >= 0
        self.logprobs_note: Optional[str] = None
        self.retries = Counter()
        self.lock = threading.Lock()

    def scrub(self, s: str) -> str:
        return s.replace(self.secret, "***") if self.secret else s

    def _kwargs(self, prompt: Any, logprobs: bool) -> Tuple[Any, Dict[str, Any]]:
        kw: Dict[str, Any] = {"model": self.model, "max_tokens": self.max_tokens, "temperature": self.temperature}
        if self.seed is not None:
            kw["seed"] = self.seed
        if self.stream:
            kw["stream"] = True
        if is_chat(prompt):
            kw["messages"] = prompt
            if logprobs:
                kw["logprobs"] = True
                kw["top_logprobs"] = self.top
            return self.client.chat.completions.create, kw
        kw["prompt"] = prompt  # a string, or token ids (OpenAI's `prompt: [int, ...]`)
        if logprobs:
            kw["logprobs"] = self.top
        return self.client.completions.create, kw

    def _request(self, prompt: Any, logprobs: bool) -> Dict[str, Any]:
        """One HTTP request: {text, tokens, top, fingerprint, finish_reason}. Raises the openai
        client's errors, and while a stream is read httpx's transport errors, an ``APIError``
        for an error event, or :class:`IncompleteStream`."""
        fn, kw = self._kwargs(prompt, logprobs)
        chat = is_chat(prompt)
        if not self.stream:
            r = fn(**kw)
            tokens, top = _logprobs_of(r, chat)
            c = r.choices[0]
            text = (c.message.content or "") if chat else (c.text or "")
            return {"text": text, "tokens": tokens, "top": top,
                    "fingerprint": getattr(r, "system_fingerprint", None), "finish_reason": c.finish_reason}
        with fn(**kw) as chunks:
            return assemble_stream(chunks, chat)

    def send(self, prompt: Any) -> Dict[str, Any]:
        """One request with the retry loop: {"ok": True, text, tokens, top, fingerprint, ...}
        or {"ok": False, "error", "status", "attempts"}."""
        import openai
        read_errors = _read_errors()
        attempts = 0
        retries = Counter()
        while True:
            attempts += 1
            logprobs = self.logprobs
            try:
                r = self._request(prompt, logprobs)
            except openai.APIStatusError as e:
                last: Exception = e
                status = e.status_code
                if status in (400, 422) and logprobs:
                    # Perhaps the logprobs: try once without; if that works, go without from now.
                    try:
                        r = self._request(prompt, False)
                    except (openai.APIError,) + read_errors:
                        return self._fail(e, status, attempts, retries)
                    with self.lock:
                        if self.logprobs:
                            self.logprobs = False
                            self.logprobs_note = ("the endpoint rejected logprobs "
                                                  f"(HTTP {status}: {self.scrub(_msg(e))}); requests "
                                                  "go without, divergences are in characters")
                    return self._ok(r, attempts, retries)
                if status == 429:
                    wait = _retry_after(e)
                    wait = self.policy.delay(attempts - 1) if wait is None else min(wait, self.policy.max_retry_after)
                    kind = "429"
                elif status >= 500:
                    wait, kind = self.policy.delay(attempts - 1), "5xx"
                else:
                    return self._fail(e, status, attempts, retries)
            except openai.APIConnectionError as e:  # includes APITimeoutError
                last = e
                wait, kind, status = self.policy.delay(attempts - 1), (
                    "timeout" if isinstance(e, openai.APITimeoutError) else "transport"), None
            except read_errors as e:  # while a stream was read
                last = e
                wait, kind, status = self.policy.delay(attempts - 1), (
                    "timeout" if _is_timeout(e) else "transport"), None
            except openai.APIError as e:  # an error event in a stream
                last = e
                wait, kind, status = self.policy.delay(attempts - 1), "stream_error", None
            else:
                return self._ok(r, attempts, retries)
            if attempts > self.policy.max_retries:
                return self._fail(last, status, attempts, retries)
            retries[kind] += 1
            time.sleep(wait)

    def _fail(self, e: Exception, status: Optional[int], attempts: int, retries: Counter) -> Dict[str, Any]:
        with self.lock:
            self.retries.update(retries)
        return {"ok": False, "error": self.scrub(f"{type(e).__name__}: {_msg(e)}"), "status": status,
                "attempts": attempts, "retries": dict(retries)}

    def _ok(self, r: Dict[str, Any], attempts: int, retries: Counter) -> Dict[str, Any]:
        with self.lock:
            self.retries.update(retries)
        return {"ok": True, **r, "attempts": attempts, "retries": dict(retries)}


def _msg(e: Exception) -> str:
    m = getattr(e, "message", None) or str(e)
    return str(m)[:300]


def _chat_rows(content: Any) -> Tuple[List[str], List[List[float]]]:
    """Chat logprob entries: the token strings and, per position, the top logprobs (the
    sampled token's own when the endpoint gives no top list)."""
    tokens = [e.token for e in content]
    top = [[t.logprob for t in (e.top_logprobs or [])] or [e.logprob] for e in content]
    return tokens, top


def _completion_rows(lp: Any) -> Tuple[List[str], List[List[float]]]:
    """Completions logprobs (``tokens``, ``token_logprobs``, ``top_logprobs`` as dicts)."""
    tops = lp.top_logprobs or []
    lps = lp.token_logprobs or []
    top = []
    for i, _ in enumerate(lp.tokens):
        row = tops[i] if i < len(tops) and tops[i] else {}
        vals = list(row.values()) if isinstance(row, dict) else []
        top.append(vals or ([lps[i]] if i < len(lps) and lps[i] is not None else []))
    return list(lp.tokens), top


def _logprobs_of(r: Any, chat: bool) -> Tuple[Optional[List[str]], Optional[List[List[float]]]]:
    try:
        lp = r.choices[0].logprobs
        if lp is None:
            return None, None
        if chat:
            if not lp.content:
                return None, None
            return _chat_rows(lp.content)
        if not lp.tokens:
            return None, None
        return _completion_rows(lp)
    except (AttributeError, IndexError, TypeError):
        return None, None


def assemble_stream(chunks: Any, chat: bool) -> Dict[str, Any]:
    """A streamed response's choice 0 from its chunks: the text (the deltas, or the completion
    chunks' ``text``, joined), the token strings and top logprobs (each chunk's logprob entries,
    in order; None when no chunk carried any), ``system_fingerprint`` (the first chunk's that has
    one) and ``finish_reason``. Raises :class:`IncompleteStream` when no chunk gave a
    ``finish_reason`` (the stream was cut)."""
    parts: List[str] = []
    tokens: List[str] = []
    top: List[List[float]] = []
    seen_lp = False
    fingerprint = None
    finish = None
    for ch in chunks:
        if fingerprint is None:
            fingerprint = getattr(ch, "system_fingerprint", None)
        for c in getattr(ch, "choices", None) or []:
            if getattr(c, "index", 0) != 0:
                continue
            lp = getattr(c, "logprobs", None)
            if chat:
                d = getattr(c, "delta", None)
                if d is not None and d.content:
                    parts.append(d.content)
                if lp is not None and getattr(lp, "content", None):
                    t, tp = _chat_rows(lp.content)
                    tokens += t
                    top += tp
                    seen_lp = True
            else:
                parts.append(getattr(c, "text", None) or "")
                if lp is not None and getattr(lp, "tokens", None):
                    t, tp = _completion_rows(lp)
                    tokens += t
                    top += tp
                    seen_lp = True
            if c.finish_reason:
                finish = c.finish_reason
    if finish is None:
        raise IncompleteStream("the stream ended before a finish_reason")
    return {"text": "".join(parts), "tokens": tokens if seen_lp else None, "top": top if seen_lp else None,
            "fingerprint": fingerprint, "finish_reason": finish}


# ----------------------------------------------------------------------------------------- probe

def parse_orders(spec: Union[None, str, Sequence[str]]) -> List[str]:
    if spec is None:
        return list(ORDERS)
    names = [x.strip() for x in spec.split(",") if x.strip()] if isinstance(spec, str) else list(spec)
    bad = [x for x in names if x not in ORDERS]
    if bad or not names:
        raise ValueError(f"--orders: unknown order(s) {bad or names!r}; choose from {', '.join(ORDERS)}")
    return list(dict.fromkeys(names))


def _base_url(url: str) -> str:
    if not re.match(r"^https?://", url or ""):
        raise ValueError(f"--endpoint: expected an http(s) URL, got {url!r}")
    u = url.rstrip("/")
    # A bare host[:port] gets OpenAI's /v1.
    if re.fullmatch(r"https?://[^/]+", u):
        u += "/v1"
    return u


def probe_endpoint(url: str, model: str, prompts: Sequence[Any], repeats: int = 3,
                   concurrency: Union[str, int, Sequence[int]] = (1, 4), max_tokens: int = 32,
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
    ``stream``: streaming requests (SSE), each completion assembled from its chunks."""
    import openai
    from .probe import check_prompts
    prompts = check_prompts(list(prompts))  # strings, chats, token ids (normalized to lists of int)
    if repeats < 1:
        raise ValueError(f"--repeats must be at least 1, got {repeats}")
    if max_tokens < 1:
        raise ValueError(f"--max-tokens must be at least 1, got {max_tokens}")
    if top_logprobs > 20:
        raise ValueError(f"--top-logprobs must be at most 20, got {top_logprobs}")
    levels = parse_concurrency(concurrency)
    order_names = parse_orders(orders)
    extractor = make_extractor(extract, json_field)
    if api_key is None and api_key_env:
        api_key = os.environ.get(api_key_env)
        if not api_key:
            raise ValueError(f"--api-key-env: environment variable {api_key_env} is not set")
    secret = api_key or ""
    policy = retry or RetryPolicy()
    client = openai.OpenAI(base_url=_base_url(url), api_key=api_key or DEFAULT_API_KEY, max_retries=0,
                           timeout=timeout)
    sender = _Sender(client, model, max_tokens, float(temperature), seed, top_logprobs, policy, secret,
                     stream=bool(stream))

    passes: List[Tuple[int, str, int]] = []  # (repeat, order, concurrency)
    for r in range(repeats):
        if "alone" in order_names:
            passes.append((r, "alone", 1))
        for c in levels:
            if "burst" in order_names and not (c == 1 and "alone" in order_names):
                passes.append((r, "burst", c))
            if "interleaved" in order_names:
                passes.append((r, "interleaved", c))

    results: List[List[Dict[str, Any]]] = [[] for _ in prompts]
    errors: List[List[Dict[str, Any]]] = [[] for _ in prompts]
    t0 = time.time()
    for k, (r, order, c) in enumerate(passes):
        idx = list(range(len(prompts)))
        if order == "interleaved":
            random.Random(shuffle_seed + 1000 * r + c).shuffle(idx)
        if progress:
            print(f"probe: pass {k + 1}/{len(passes)}: {order} at concurrency {c} (repeat {r + 1})",
                  file=sys.stderr, flush=True)
        if order == "alone" or c == 1:
            outs = [sender.send(prompts[i]) for i in idx]
        else:
            with ThreadPoolExecutor(max_workers=c) as ex:
                outs = list(ex.map(lambda i: sender.send(prompts[i]), idx))
        for i, o in zip(idx, outs):
            meta = {"order": order, "concurrency": c, "repeat": r}
            if o["ok"]:
                results[i].append({**meta, **{kk: o[kk] for kk in ("text", "tokens", "top", "fingerprint",
                                                                  "finish_reason")}})
            else:
                errors[i].append({**meta, "error": o["error"], "status": o["status"], "attempts": o["attempts"]})
    elapsed = time.time() - t0
    # Score each prompt's completions in the order the passes ran (alone first).
    per_prompt = [score_completions(results[i], extractor, errors[i]) for i in range(len(prompts))]
    settings = {
        "endpoint": _base_url(url), "model": model, "repeats": repeats, "concurrency": levels,
        "orders": order_names, "max_tokens": max_tokens, "temperature": float(temperature), "seed": seed,
        "top_logprobs": top_logprobs, "extract": extract, "json_field": json_field,
        "shuffle_seed": shuffle_seed, "stream": bool(stream),
        "logprobs": {"requested": top_logprobs >= 0, "used": sender.logprobs, "note": sender.logprobs_note},
        "retries": dict(sender.retries), "elapsed_s": round(elapsed, 3),
    }
    return summarize(prompts, per_prompt, settings)


# ---------------------------------------------------------------------------------------- output

def _short(p: Any, width: int = 34) -> str:
    if is_chat(p):
        s = p[-1].get("content")
    elif isinstance(p, str):
        s = p
    else:
        s = f"<{len(p)} token ids: {' '.join(map(str, p[:6]))}{' ...' if len(p) > 6 else ''}>"
    s = str(s).replace("\n", " ")
    return s if len(s) <= width else s[:width - 1] + "…"


def format_report(r: Dict[str, Any]) -> str:
    lines = [f"endpoint probe: {r['endpoint']} model {r['model']}: {len(r['prompts'])} prompts x {r['repeats']} "
             f"repeats, concurrency {','.join(map(str, r['concurrency']))}, orders {','.join(r['orders'])}, "
             f"max_tokens {r['max_tokens']}, temperature {r['temperature']}"
             + (", streaming" if r.get("stream") else "")]
    ans = r["answer_flips"] is not None
    head = ["#", "prompt", "ok", "err", "distinct", "k/n", "per C (distinct)", "1st div", "gap", "fp"]
    if ans:
        head += ["answer k/n"]
    rows = [head]
    for e in r["prompts"]:
        div = "-" if e["first_divergence"] is None else f"{e['first_divergence']}{'t' if e['divergence_unit'] == 'tokens' else 'c'}"
        gap = "-" if e["gap_at_divergence"] is None else f"{e['gap_at_divergence']:.3f}"
        perc = " ".join(f"{c}:{v['distinct']}" for c, v in e["by_concurrency"].items())
        fp = str(len(e["fingerprints"])) + ("!" if e["fingerprint_change"] else "")
        row = [str(e["index"]), _short(e["prompt"]), str(e["n"]), str(e["errors"]), str(e["distinct"]),
               f"{e['k_of_n'][0]}/{e['k_of_n'][1]}", perc, div, gap, fp]
        if ans:
            row.append("-" if e["answer"] is None else f"{e['answer']['k_of_n'][0]}/{e['answer']['k_of_n'][1]}")
        rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    for row in rows:
        lines.append("  ".join(x.ljust(w) for x, w in zip(row, widths)).rstrip())
    lines.append(f"all identical: {'yes' if r['all_identical'] else 'no'}; prompts with flips "
                 f"{r['prompts_with_flips']}/{len(r['prompts'])}; prose flips {r['prose_flips']}"
                 + (f"; answer flips {r['answer_flips']}" if ans else "")
                 + f"; errors {r['errors']} of {r['requests']} requests; fingerprints {len(r['fingerprints'])}"
                 + (" (changed during the run)" if r["fingerprint_change"] else ""))
    if r["flip_under_one_fingerprint"]:
        lines.append("flips under one system_fingerprint: yes")
    if r["logprobs"]["note"]:
        lines.append("note: " + r["logprobs"]["note"])
    for e in r["prompts"]:
        for err in e["error_list"][:3]:
            lines.append(f"error: prompt {e['index']} ({err['order']}@{err['concurrency']}, repeat {err['repeat']}, "
                         f"{err['attempts']} attempts): {err['error']}")
    return "\n".join(lines)


def plot_report(r: Dict[str, Any], path: str) -> None:
    """A PNG: distinct completions per prompt and concurrency (bars); the divergence positions
    per prompt; the logprob gaps at the divergences. Raises ImportError without matplotlib."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    prompts = r["prompts"]
    fig, axes = plt.subplots(3, 1, figsize=(10, 10))
    ax = axes[0]
    levels = [str(c) for c in r["concurrency"]]
    if "alone" in r["orders"] and "1" not in levels:
        levels = ["1"] + levels
    w = 0.8 / max(1, len(levels))
    for j, c in enumerate(levels):
        ys = [e["by_concurrency"].get(c, {}).get("distinct", 0) for e in prompts]
        ax.bar([i - 0.4 + (j + 0.5) * w for i in range(len(prompts))], ys, width=w, label=f"C={c}")
    ax.set_title("distinct completions per prompt and concurrency")
    ax.set_xlabel("prompt")
    ax.set_ylabel("distinct")
    ax.legend(fontsize="small")
    ax = axes[1]
    xs, ys = [], []
    for e in prompts:
        for d in e["divergences"]:
            xs.append(e["index"])
            ys.append(d["position"])
    if xs:
        ax.scatter(xs, ys, marker="x")
    else:
        ax.text(0.5, 0.5, "no divergences", ha="center", va="center", transform=ax.transAxes)
    ax.set_title("first divergence against the majority completion (tokens, else characters)")
    ax.set_xlabel("prompt")
    ax.set_ylabel("position")
    ax = axes[2]
    gaps = [(e["index"], d["gap"]) for e in prompts for d in e["divergences"] if d["gap"] is not None]
    if gaps:
        ax.scatter([g[0] for g in gaps], [g[1] for g in gaps], marker="o")
    else:
        ax.text(0.5, 0.5, "no logprob gaps (no divergences, or no logprobs)", ha="center", va="center",
                transform=ax.transAxes)
    ax.set_title("top-1 minus top-2 logprob in the majority run at the divergence")
    ax.set_xlabel("prompt")
    ax.set_ylabel("gap (nats)")
    from matplotlib.ticker import MaxNLocator
    for a in axes:
        a.set_xlim(-0.5, max(len(prompts), 1) - 0.5)
        a.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[0].yaxis.set_major_locator(MaxNLocator(integer=True))
    axes[1].yaxis.set_major_locator(MaxNLocator(integer=True))
    axes[1].set_ylim(bottom=0)
    axes[2].set_ylim(bottom=0)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_json(obj: Any, path: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")
    os.replace(tmp, path)


ENDPOINT_ONLY = ("repeats", "concurrency", "max_tokens", "api_key_env", "extract", "json_field",
                 "top_logprobs", "orders", "stream")


def main(args: Any) -> int:
    """``candle-gate probe --endpoint URL ...``."""
    from .probe import load_prompts
    if not getattr(args, "prompts", None):
        raise ValueError("--endpoint needs --prompts FILE")
    prompts = load_prompts(args.prompts)
    if getattr(args, "num_prompts", None) is not None:
        if args.num_prompts <= 0:
            raise ValueError(f"--num-prompts must be positive, got {args.num_prompts}")
        prompts = prompts[:args.num_prompts]
    report = probe_endpoint(
        args.endpoint, args.model, prompts,
        repeats=3 if args.repeats is None else args.repeats,
        concurrency="1,4" if args.concurrency is None else args.concurrency,
        max_tokens=getattr(args, "max_new_tokens", 32) if args.max_tokens is None else args.max_tokens,
        temperature=0.0 if args.temperature is None else args.temperature,
        seed=args.seed, api_key_env=args.api_key_env, extract=args.extract, json_field=args.json_field,
        top_logprobs=DEFAULT_TOP_LOGPROBS if args.top_logprobs is None else args.top_logprobs,
        orders=args.orders, progress=True, stream=bool(getattr(args, "stream", None)))
    print(format_report(report))
    if getattr(args, "json_out", None):
        write_json(report, args.json_out)
        print(f"probe: report written to {args.json_out}", file=sys.stderr)
    if getattr(args, "plot", None):
        try:
            plot_report(report, args.plot)
        except ImportError:
            print(f"probe: --plot needs matplotlib (pip install 'candle-gate[plot]'); "
                  f"no plot written to {args.plot}", file=sys.stderr)
        else:
            print(f"probe: plot written to {args.plot}", file=sys.stderr)
    return 0 if report["completions"] > 0 else 1
