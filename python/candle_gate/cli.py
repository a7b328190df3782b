"""The ``candle-gate`` command (also ``python -m candle_gate``)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any, Dict, List, Optional

from . import _native
from .engine import (DEFAULT_MAX_NEW_TOKENS, ENGINE_DEFAULTS, GATES, MODES, SPECULATIVE_METHODS, SamplingParams,
                     speculative_options)
from .models import DEFAULT_MODEL, resolve
from .server.settings import API_KEY_SCOPES, Settings

#: ``candle-gate serve``'s defaults: the fields of :class:`~candle_gate.server.Settings` (one owner)
SERVE_DEFAULTS: Dict[str, Any] = {f.name: f.default for f in dataclasses.fields(Settings)}
#: the sampling defaults, Rust's (``SamplingParams::default``), for the help texts
_SAMPLING = SamplingParams()


class HelpFormatter(argparse.HelpFormatter):
    """Every flag's help ends with its default, where it has a value (a flag whose default is
    None says in its text what not giving it means)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        unset = any(action.default is x for x in (None, False, True, argparse.SUPPRESS))  # (1.0 == True)
        if unset or "%(default)" in text or "default" in text:
            return text
        if not action.option_strings and action.nargs in (argparse.ONE_OR_MORE, argparse.ZERO_OR_MORE):
            return text
        return f"{text} (default: %(default)s)"


def _all_parsers(p: argparse.ArgumentParser):
    """``p`` and every subcommand's parser under it."""
    yield p
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _all_parsers(sub)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=SERVE_DEFAULTS["model"], help="a known model name or a path to a .gguf file")
    p.add_argument("--mode", default=SERVE_DEFAULTS["mode"], choices=MODES, help="fast-lane kernel policy")
    p.add_argument("--profile", default=None,
                   help="a crossover/gate profile (JSON) to load (default: none; a gated engine without --tau "
                        "reads the user's profile, then the packaged one)")


def _kv_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kv-dtype", default=ENGINE_DEFAULTS["kv_dtype"], choices=["f16", "f32"], help="how K/V values are stored")


def _spec_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--speculative-method", default=None, choices=SPECULATIVE_METHODS,
                   help="speculative decoding (ngram: prompt lookup; draft: a smaller model of the same "
                        "vocabulary, --draft-model); changes no token, only speed (default: off)")
    p.add_argument("--draft-model", default=None,
                   help="the draft model of --speculative-method draft: a known model name or a .gguf path "
                        "(default: none)")
    p.add_argument("--num-speculative-tokens", type=int, default=None,
                   help="drafts per sequence and step (default: ngram 12, draft 3)")
    p.add_argument("--speculative-disable-by-batch-size", type=int, default=None,
                   help="no drafts in a step with more decoding sequences than this (default: ngram 8, draft 1)")


def speculative_from_args(a: argparse.Namespace):
    """``Engine(speculative=...)`` from the ``--speculative-*`` and ``--draft-model`` flags."""
    return speculative_options(a.speculative_method, a.num_speculative_tokens, a.speculative_disable_by_batch_size,
                               a.draft_model)


def _gate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gate", default=SERVE_DEFAULTS["gate"], choices=GATES,
                   help="the margin gate: gated rechecks steps whose top-1/top-2 margin is below --tau in the "
                        "FP32 reference lane; always rechecks every step; shadow measures without acting")
    p.add_argument("--tau", type=float, default=None,
                   help="margin threshold for --gate gated (default: the profile's calibrated tau)")
    p.add_argument("--deep-tau", type=float, default=None,
                   help="a recheck whose own margin is below this rebuilds the cache in the reference "
                        "lane (default: the profile's, else tau/2)")


def _sampling_args(p: argparse.ArgumentParser) -> None:
    d = _SAMPLING
    p.add_argument("--temperature", type=float, default=None,
                   help=f"softmax temperature; 0 is greedy (default: {d.temperature:g}, greedy)")
    p.add_argument("--top-k", type=int, default=None,
                   help=f"sample among the K most likely tokens; 0 is off (default: {d.top_k}, off)")
    p.add_argument("--top-p", type=float, default=None,
                   help=f"sample among the most likely tokens holding this much probability, in (0, 1] "
                        f"(default: {d.top_p:g}, off)")
    p.add_argument("--min-p", type=float, default=None,
                   help=f"drop tokens less likely than this fraction of the most likely one's probability, "
                        f"in [0, 1] (default: {d.min_p:g}, off)")
    p.add_argument("--repetition-penalty", type=float, default=None,
                   help=f"CTRL's penalty on tokens already in the prompt or output, in (0, 10] "
                        f"(default: {d.repetition_penalty:g}, off)")
    p.add_argument("--presence-penalty", type=float, default=None,
                   help=f"OpenAI's: subtracted from the logit of every token already generated, in [-2, 2] "
                        f"(default: {d.presence_penalty:g}, off)")
    p.add_argument("--frequency-penalty", type=float, default=None,
                   help=f"OpenAI's: subtracted once per occurrence in the output so far, in [-2, 2] "
                        f"(default: {d.frequency_penalty:g}, off)")
    p.add_argument("--seed", type=int, default=None,
                   help="key of every draw (default: one drawn per request and reported)")


def cmd_generate(a: argparse.Namespace) -> int:
    from .engine import Engine, Model, SamplingParams
    from .probe import sampling_args
    # Checked before the model loads: a bad parameter should not wait for a download.
    params = SamplingParams(max_new_tokens=a.max_new_tokens, stop=a.stop, n=a.n, **sampling_args(a))
    model = Model.load(a.model, mode=a.mode, profile=a.profile)
    eng = Engine(model, gate=a.gate, tau=a.tau, deep_tau=a.deep_tau, profile=a.profile, kv_dtype=a.kv_dtype,
                 speculative=speculative_from_args(a))
    if eng.gate_source:
        print(f"gate: tau {eng.tau:.4g}, deep_tau {eng.deep_tau:.4g} from {eng.gate_source}", file=sys.stderr)
    rid = eng.submit(a.prompt, chat=a.chat, params=params)
    if a.json:
        [r] = eng.run([rid])
        choices = []
        drew = params.temperature > 0 or params.seed is not None
        for c in r.choices:
            out = c.to_json()
            if not drew:  # greedy: nothing was drawn, and a fresh seed would make equal runs differ
                del out["seed"]
            out.update({"model": model.path, "mode": a.mode, "gate": a.gate, "index": c.index})
            choices.append(out)
        print(json.dumps(choices[0] if params.n == 1 else choices))
        return 0
    for ev in eng.stream():
        if ev["type"] == "token" and ev["index"] == 0:
            sys.stdout.write(ev["text"])
            sys.stdout.flush()
    r = eng.result(rid)
    sys.stdout.write("\n")
    for c in r.choices[1:]:
        sys.stdout.write(f"--- choice {c.index}\n{c.text}\n")
    spec = f", drafts {r.accepted_tokens}/{r.draft_tokens} kept" if r.draft_tokens else ""
    seed = f", seed={r.seed}" if params.temperature > 0 or params.seed is not None else ""
    print(f"[{len(r.token_ids)} tokens, finish={r.finish_reason}{seed}, fingerprint={r.fingerprint}{spec}]",
          file=sys.stderr)
    return 0


def cmd_fetch(a: argparse.Namespace) -> int:
    from .models import KNOWN_MODELS, fetch
    names = a.model or [DEFAULT_MODEL]
    for name in (list(KNOWN_MODELS) if "all" in names else names):
        print(fetch(name))
    return 0


def cmd_calibrate(a: argparse.Namespace) -> int:
    from . import calibrate
    if not (a.kernels or a.gate):
        print("calibrate: pass --kernels and/or --gate", file=sys.stderr)
        return 2
    return calibrate.main(a)


def cmd_probe(a: argparse.Namespace) -> int:
    if getattr(a, "endpoint", None):
        from .probe import endpoint
        return endpoint.main(a)
    given = [f for f in ("repeats", "concurrency", "max_tokens", "api_key_env", "extract", "json_field",
                         "top_logprobs", "orders", "stream") if getattr(a, f, None) is not None]
    if given:
        print(f"candle-gate probe: --{given[0].replace('_', '-')} needs --endpoint URL", file=sys.stderr)
        return 2
    from . import probe
    return probe.main(a)


def cmd_bench(a: argparse.Namespace) -> int:
    from . import bench
    return bench.main(a)


def cmd_serve(a: argparse.Namespace) -> int:
    try:
        from .server import app as server_app
    except ImportError as e:  # fastapi/uvicorn are the `serve` extra
        print(f"candle-gate serve: {e}; install with: pip install 'candle-gate[serve]'", file=sys.stderr)
        return 2
    if a.stream_interval_ms is not None and a.stream_interval_ms < 0:
        print("candle-gate serve: --stream-interval-ms must be 0 or more", file=sys.stderr)
        return 2
    remote = a.ray_address and (a.replicas is not None or a.autoscaling_config is not None)
    for flag, name in (("--model", a.model), ("--draft-model", a.draft_model)):
        # A name that is neither known nor a file here would only fail once the server (or each
        # replica, behind Ray's "Failed to update the deployments") tries to load it. A path on a
        # cluster joined by --ray-address is the replicas' to find, on their own nodes.
        if name is None or remote:
            continue
        try:
            resolve(name, download=False)
        except FileNotFoundError as e:
            print(f"candle-gate serve: {flag}: {e}", file=sys.stderr)
            return 2
    if a.replicas is None and a.autoscaling_config is None:
        if a.ray_address:
            print("candle-gate serve: --ray-address needs --replicas N or --autoscaling-config", file=sys.stderr)
            return 2
        return server_app.serve(a)
    if a.replicas is not None and a.autoscaling_config is not None:
        print("candle-gate serve: give --replicas N or --autoscaling-config, not both", file=sys.stderr)
        return 2
    if a.replicas is not None and a.replicas < 1:
        print("candle-gate serve: --replicas must be at least 1", file=sys.stderr)
        return 2
    try:
        from .ray import parse_autoscaling_config, serve_replicas
    except ImportError as e:  # ray[serve] is the `ray` extra
        print(f"candle-gate serve: {e}; install with: pip install 'candle-gate[ray]'", file=sys.stderr)
        return 2
    autoscaling = None
    if a.autoscaling_config is not None:
        try:
            autoscaling = parse_autoscaling_config(a.autoscaling_config)
        except ValueError as e:
            print(f"candle-gate serve: --autoscaling-config: {e}", file=sys.stderr)
            return 2
    return serve_replicas(Settings.from_args(a), a.replicas, a.ray_address, a.num_cpus_per_replica,
                          a.routing, autoscaling)


def _add_generate(sub) -> None:
    g = sub.add_parser("generate", help="generation for one prompt (greedy unless --temperature)")
    g.add_argument("prompt", help="the prompt (with --chat, the user's message)")
    _common(g)
    _gate_args(g)
    _kv_args(g)
    _sampling_args(g)
    _spec_args(g)
    g.add_argument("--n", type=int, default=1, help="choices from the one prompt")
    g.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS, help="tokens to generate at most")
    g.add_argument("--stop", action="append", help="stop string (repeatable; default: none)")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    g.set_defaults(func=cmd_generate)


def _add_fetch(sub) -> None:
    f = sub.add_parser("fetch", help="download known models into the cache")
    f.add_argument("--model", action="append", default=None,
                   help=f"a known model name, or `all` (repeatable; default {DEFAULT_MODEL})")
    f.set_defaults(func=cmd_fetch)


def _add_calibrate(sub) -> None:
    c = sub.add_parser("calibrate", help="measure kernel crossovers (--kernels) and the gate's tau (--gate)")
    _common(c)
    c.add_argument("--kernels", action="store_true", help="time the kernels and write their crossover thresholds")
    c.add_argument("--gate", action="store_true", help="measure the gate's tau and deep_tau for --mode")
    c.add_argument("--quick", action="store_true", help="only the default model's dtypes and shapes")
    c.add_argument("--out", default=None,
                   help="the profile to write or update (default: the user's, which gated engines read first: "
                        "profile-cpu.json in the model cache)")
    c.add_argument("--prompts", default=None,
                   help="calibration prompts for --gate (JSON list or text file; default: the built-in set)")
    c.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS, help="tokens per calibration prompt")
    c.add_argument("--safety", type=float, default=2.0, help="tau = safety x the largest measured margin movement")
    c.set_defaults(func=cmd_calibrate)


def _endpoint_args(p: argparse.ArgumentParser) -> None:
    """``probe --endpoint URL`` and the flags that only it takes (docs/ENDPOINT_PROBE.md)."""
    ep = p.add_argument_group("endpoint probe (docs/ENDPOINT_PROBE.md): probe an OpenAI-compatible server")
    ep.add_argument("--endpoint", default=None, metavar="URL",
                    help="probe this OpenAI-compatible server (http://host:port/v1) instead of the in-process engine "
                         "(default: the in-process engine)")
    ep.add_argument("--repeats", type=int, default=None, help="requests per prompt per load (default 3)")
    ep.add_argument("--concurrency", default=None, help="comma-separated thread-pool sizes (default 1,4)")
    ep.add_argument("--max-tokens", type=int, default=None, help="max_tokens per request (default 32)")
    ep.add_argument("--api-key-env", default=None, metavar="VAR",
                    help="read the API key from this environment variable (never printed; default: no key)")
    ep.add_argument("--top-logprobs", type=int, default=None,
                    help="top_logprobs to ask for (default 2; -1: no logprobs)")
    ep.add_argument("--orders", default=None, help="comma-separated subset of alone,burst,interleaved (default: all three)")
    ep.add_argument("--stream", action="store_true", default=None,
                    help="send streaming requests (SSE) and assemble each completion from its chunks")
    ans = ep.add_mutually_exclusive_group()
    ans.add_argument("--extract", default=None, metavar="REGEX",
                     help="the answer: the regex's first group (else the whole match; default: the whole completion)")
    ans.add_argument("--json-field", default=None, metavar="PATH",
                     help="the answer: this dotted path (a.b.0) in the completion parsed as JSON (default: the whole completion)")


def _add_probe(sub) -> None:
    p = sub.add_parser("probe", help="measure flip rates across batch compositions")
    _common(p)
    _gate_args(p)
    p.add_argument("--prompts", default=None,
                   help="JSON list of prompts (strings or chats) or a text file, one per line (default: the "
                        "built-in prompts)")
    p.add_argument("--num-prompts", type=int, default=None, help="use only the first N prompts (default: all)")
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens per prompt")
    p.add_argument("--json", dest="json_out", default=None, help="write the report here (default: not written)")
    p.add_argument("--plot", default=None, help="write a PNG plot here (needs matplotlib; default: none)")
    p.add_argument("--compositions", default=None,
                   help="comma-separated subset of composition names (default: all)")
    _sampling_args(p)
    _endpoint_args(p)
    p.set_defaults(func=cmd_probe)


def _add_bench(sub) -> None:
    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench", required=True)
    t = bsub.add_parser("throughput", help="aggregate decode tok/s at several concurrencies")
    _common(t)
    _gate_args(t)
    _spec_args(t)
    t.add_argument("--concurrency", default="1,2,4,8,16", help="comma-separated numbers of streams")
    t.add_argument("--max-new-tokens", type=int, default=32, help="tokens per stream")
    t.add_argument("--json", action="store_true", help="print the results as JSON")
    t.set_defaults(func=cmd_bench)
    gb = bsub.add_parser("gate", help="the gate's cost: decode tok/s with the gate off, gated and always, side by side")
    _common(gb)
    gb.add_argument("--tau", type=float, default=None, help="the gate's margin threshold (default: the profile's "
                                                            "calibrated tau)")
    gb.add_argument("--deep-tau", type=float, default=None,
                    help="rechecks below this margin rebuild the cache (default: the profile's, else tau/2)")
    gb.add_argument("--concurrency", type=int, default=4, help="streams at once")
    gb.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS, help="tokens per stream")
    gb.add_argument("--json", action="store_true", help="print the results as JSON")
    _sampling_args(gb)
    gb.set_defaults(func=cmd_bench)
    sb = bsub.add_parser("sampling", help="seeded sampling's cost against greedy decoding, side by side")
    _common(sb)
    sb.add_argument("--concurrency", default="1,8", help="comma-separated numbers of streams")
    sb.add_argument("--max-new-tokens", type=int, default=32, help="tokens per stream")
    sb.add_argument("--json", action="store_true", help="print the results as JSON")
    _sampling_args(sb)
    sb.set_defaults(func=cmd_bench)


def _add_serve(sub) -> None:
    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (docs/SERVER.md)")
    _common(s)
    _gate_args(s)
    _kv_args(s)
    _spec_args(s)
    d = SERVE_DEFAULTS
    s.add_argument("--host", default=d["host"], help="the address to listen on")
    s.add_argument("--port", type=int, default=d["port"], help="the port to listen on")
    s.add_argument("--max-num-seqs", type=int, default=ENGINE_DEFAULTS["max_num_seqs"], help="sequences in the running batch")
    s.add_argument("--max-num-batched-tokens", type=int, default=ENGINE_DEFAULTS["max_tokens_per_step"],
                   help="rows in one step (decode rows first, then prefill chunks): bounds the inter-token latency a long prefill adds")
    s.add_argument("--prefill-chunk", type=int, default=ENGINE_DEFAULTS["prefill_chunk"],
                   help="prompt positions per prefill chunk")
    s.add_argument("--kv-budget-tokens", type=int, default=ENGINE_DEFAULTS["kv_budget_tokens"],
                   help="the KV pool's size in positions (allocated at start; cached prefixes live in it too); a "
                        "chat without max_tokens generates at most what it can hold")
    s.add_argument("--no-prefix-cache", action="store_true",
                   help="never reuse the K/V of a prefix another request computed (default: reuse)")
    s.add_argument("--max-model-len", type=int, default=None,
                   help="context length served (default: the model's): longer prompts get 400, max_tokens is trimmed to fit")
    s.add_argument("--max-queue", type=int, default=d["max_queue"],
                   help="waiting requests beyond which new ones get 429 with Retry-After")
    key = s.add_argument_group("API key (default: none, every endpoint open)").add_mutually_exclusive_group()
    key.add_argument("--api-key", default=None, metavar="KEY",
                     help="require `Authorization: Bearer KEY` (visible to `ps`: prefer the next two; default: no key)")
    key.add_argument("--api-key-env", default=None, metavar="NAME",
                     help="the API key is the value of this environment variable (default: none)")
    key.add_argument("--api-key-file", default=None, metavar="PATH",
                     help="the API key is this file's content (one line; default: none)")
    s.add_argument("--api-key-scope", default=d["api_key_scope"], choices=API_KEY_SCOPES,
                   help="what the key guards: api = /v1/*, /tokenize, /detokenize, /reset_prefix_cache; all = "
                        "also /metrics, /docs, /redoc, /openapi.json (/health is always open)")
    s.add_argument("--served-model-name", default=None,
                   help="the model's name in the API (default: the known-model name, else the file stem)")
    s.add_argument("--stream-interval-ms", type=int, default=None, metavar="MS",
                   help="write a stream's events that arrive within MS of its last write together, the first "
                        "token at once (default: 0; 50 with --replicas, where each write is a message "
                        "through Ray's proxy)")
    s.add_argument("--threads", type=int, default=None,
                   help="the engine's threads (default: rayon's, one per core)")
    s.add_argument("--read-timeout", type=float, default=d["read_timeout"], metavar="SECONDS",
                   help="seconds a request's head (request line and headers) may take to arrive, and then its "
                        "body; a slower one gets 408 and its connection closed")
    s.add_argument("--drain-timeout", type=int, default=d["drain_timeout"],
                   help="seconds SIGTERM waits for in-flight requests before cancelling them")
    s.add_argument("--log-level", default=d["log_level"], help="uvicorn's log level")
    s.add_argument("--access-log", action="store_true", help="log every request (uvicorn's access log; default: off)")
    r = s.add_argument_group("replicas on Ray Serve (docs/RAY.md; the `ray` extra)")
    r.add_argument("--replicas", type=int, default=None,
                   help="serve N replicas of this app, one engine each, on a Ray cluster (local unless --ray-address; "
                        "default: no Ray, one engine in this process)")
    r.add_argument("--autoscaling-config", default=None, metavar="JSON",
                   help="instead of --replicas: Ray Serve's autoscaling_config, passed through "
                        "(e.g. '{\"min_replicas\": 1, \"max_replicas\": 4, \"target_ongoing_requests\": 8}'; default: none)")
    r.add_argument("--ray-address", default=None, help="join this Ray cluster (e.g. 10.0.0.1:6379 or auto; default: start a local one)")
    r.add_argument("--num-cpus-per-replica", type=float, default=1.0, help="Ray CPUs each replica reserves")
    r.add_argument("--routing", default="session", choices=["session", "pow2"],
                   help="session: a request's x-session-id header picks its replica (prefix-cache affinity), "
                        "others as pow2; pow2: Ray's default power-of-two choices")
    s.set_defaults(func=cmd_serve)


def cmd_verify(a: argparse.Namespace) -> int:
    try:
        from .audit import load_record, verify
        from .server import app  # noqa: F401
    except ImportError as e:  # the in-process replay runs the server's app: the `serve` extra
        print(f"candle-gate verify: {e}; install with: pip install 'candle-gate[serve]'", file=sys.stderr)
        return 2
    # What is given is used; the model (and, found by the fingerprint, the mode and K/V dtype)
    # comes from each record otherwise (audit.replay_settings).
    given = {k: getattr(a, k) for k in ("model", "mode", "profile", "gate", "tau", "deep_tau", "kv_dtype",
                                        "max_model_len") if getattr(a, k) is not None}
    results = []
    for path in a.records:
        def say(origin, path=path):  # before the replay, which takes a while
            if origin.note and not a.json:
                print(f"{path}: {origin.note}", file=sys.stderr, flush=True)
        v = verify(load_record(path), on_origin=say, **given)
        results.append((path, v))
        if not a.json:
            print(f"{path}: {v.summary()}")
    if a.json:
        print(json.dumps([{"record": str(p), "match": v.match, "endpoint": v.endpoint,
                           "model": vars(v.origin) if v.origin else None,
                           "system_fingerprint": {"recorded": v.system_fingerprint[0], "local": v.system_fingerprint[1]},
                           "prompt_token_ids": v.prompt_token_ids,
                           "choices": [dict(vars(c), match=c.match) for c in v.choices]} for p, v in results], indent=2))
    return 0 if all(v.match for _, v in results) else 1


def _add_verify(sub) -> None:
    v = sub.add_parser("verify", help="replay recorded server responses locally and compare them bit for bit",
                       description="Each RECORD is {\"request\": <body sent>, \"response\": <body returned>} of "
                                   "/v1/completions or /v1/chat/completions (send return_token_ids: true to pin "
                                   "differences to a position). The model comes from the record (its model name, "
                                   "else its system_fingerprint, which also gives the mode and K/V dtype); give "
                                   "the server's other settings: a different model file, mode, gate or K/V dtype "
                                   "is another stack. Exit 0 when every record matches.")
    v.add_argument("records", nargs="+", metavar="RECORD", help="a JSON file {\"request\": ..., \"response\": ...}")
    v.add_argument("--model", default=None,
                   help=f"replay on this model (a known name or a .gguf path) (default: the record's, else {DEFAULT_MODEL})")
    v.add_argument("--mode", default=None, choices=MODES,
                   help="the server's mode (default: the one the record's system_fingerprint names, else invariant)")
    v.add_argument("--profile", default=None, help="the server's --profile (default: none)")
    _gate_args(v)
    v.add_argument("--kv-dtype", default=None, choices=["f16", "f32"],
                   help=f"the server's --kv-dtype (default: the record's system_fingerprint's, else "
                        f"{ENGINE_DEFAULTS['kv_dtype']})")
    v.add_argument("--max-model-len", type=int, default=None, help="as the server's --max-model-len (default: the model's context)")
    v.add_argument("--json", action="store_true", help="print the checks as JSON")
    v.set_defaults(func=cmd_verify)


def build_parser() -> argparse.ArgumentParser:
    """The ``candle-gate`` parser: one ``_add_<command>`` per subcommand, in the order of ``--help``."""
    ap = argparse.ArgumentParser(prog="candle-gate", description=__doc__)
    ap.add_argument("--version", action="version", version=f"candle-gate {_native.__version__} (CPU kernels: {_native.kernel_tier()})")
    sub = ap.add_subparsers(dest="cmd", required=True)
    for add in (_add_generate, _add_fetch, _add_calibrate, _add_probe, _add_bench, _add_serve, _add_verify):
        add(sub)
    for p in _all_parsers(ap):
        p.formatter_class = HelpFormatter
    return ap


def main(argv: Optional[List[str]] = None) -> int:
    a = build_parser().parse_args(argv)
    try:
        return a.func(a)
    except (ValueError, TypeError, FileNotFoundError, _native.CandleGateError) as e:
        print(f"candle-gate: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
