"""``candle-gate serve``: the OpenAI-compatible server (:mod:`candle_gate.server`, docs/SERVER.md),
or replicas of it on Ray Serve (:mod:`candle_gate.ray`, docs/RAY.md)."""
from __future__ import annotations

import argparse
import sys

from ..engine import ENGINE_DEFAULTS
from ..models import resolve
from ..server.settings import API_KEY_SCOPES, Settings
from .common import SERVE_DEFAULTS, gate_args, kv_args, model_args, speculative_args


def add_parser(sub) -> None:
    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (docs/SERVER.md)")
    model_args(s)
    gate_args(s)
    kv_args(s)
    speculative_args(s)
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
    s.set_defaults(func=main)



def main(a: argparse.Namespace) -> int:
    try:
        from ..server import app as server_app
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
        from ..ray import parse_autoscaling_config, serve_replicas
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
