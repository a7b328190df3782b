"""``candle-gate serve``: the OpenAI-compatible server (:mod:`candle_gate.server`, docs/SERVER.md),
or replicas of it on Ray Serve (:mod:`candle_gate.ray`, docs/RAY.md)."""
from __future__ import annotations

import argparse
import dataclasses
import sys

from ..models import resolve
from ..server.settings import FLAG_NAMES, Settings
from .common import setting_flag


def add_parser(sub) -> None:
    """Every :class:`~candle_gate.server.Settings` field with a flag, in the fields' order, then
    what is not a setting: the API key's other sources and the Ray Serve replicas."""
    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (docs/SERVER.md)")
    key = s.add_argument_group("API key (default: none, every endpoint open)").add_mutually_exclusive_group()
    for f in dataclasses.fields(Settings):
        if FLAG_NAMES.get(f.name, "") is not None:
            setting_flag(key if f.name == "api_key" else s, f.name)
    key.add_argument("--api-key-env", default=None, metavar="NAME",
                     help="the API key is the value of this environment variable (default: none)")
    key.add_argument("--api-key-file", default=None, metavar="PATH",
                     help="the API key is this file's content (one line; default: none)")
    r = s.add_argument_group("replicas on Ray Serve (docs/RAY.md; the `ray` extra)")
    r.add_argument("--replicas", type=int, default=None,
                   help="serve N replicas of this app, one engine each, on a Ray cluster (local unless --ray-address; "
                        "default: no Ray, one engine in this process)")
    r.add_argument("--autoscaling-config", default=None, metavar="JSON",
                   help="instead of --replicas: Ray Serve's autoscaling_config, passed through "
                        "(e.g. '{\"min_replicas\": 1, \"max_replicas\": 4, \"target_ongoing_requests\": 8}'; default: none)")
    r.add_argument("--ray-address", default=None, help="join this Ray cluster (e.g. 10.0.0.1:6379 or auto; default: start a local one)")
    r.add_argument("--num-cpus-per-replica", type=float, default=1.0, help="Ray CPUs each replica reserves")
    r.add_argument("--proxy-location", default="EveryNode", choices=["EveryNode", "HeadOnly"],
                   help="where Ray Serve runs its HTTP proxies: EveryNode (Ray's default: a client may "
                        "connect to any node), HeadOnly (the head node's alone: a worker node's loss cuts "
                        "no connection, and nodes sharing one host do not share the port)")
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
        return server_app.serve(Settings.from_args(a))
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
                          a.routing, autoscaling, proxy_location=a.proxy_location)
