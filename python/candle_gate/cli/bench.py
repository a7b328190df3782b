"""``candle-gate bench throughput|gate|sampling`` (:mod:`candle_gate.bench`)."""
from __future__ import annotations

import argparse
import json
import sys

from .. import bench
from ..calibrate import CALIBRATION_MODE
from ..engine import DEFAULT_MAX_NEW_TOKENS
from .common import gate_args, model_args, parse_concurrency, sampling_args, sampling_flags, speculative_args, \
    speculative_from_args


def add_parser(sub) -> None:
    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench", required=True)
    t = bsub.add_parser("throughput", help="aggregate decode tok/s at several concurrencies")
    model_args(t)
    gate_args(t)
    speculative_args(t)
    t.add_argument("--concurrency", default="1,2,4,8,16", help="comma-separated numbers of streams")
    t.add_argument("--max-new-tokens", type=int, default=32, help="tokens per stream")
    t.add_argument("--json", action="store_true", help="print the results as JSON")
    t.set_defaults(func=throughput)
    gb = bsub.add_parser("gate", help="the gate's cost: decode tok/s with the gate off, gated and always, side by side")
    model_args(gb, default=CALIBRATION_MODE,
               extra_help=" (default: %(default)s, the lane calibrate --gate calibrates on: its bits follow the "
                         "batch, so the gate has flips to catch)")
    gate_args(gb, choose_gate=False)
    gb.add_argument("--concurrency", type=int, default=4, help="streams at once")
    gb.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS, help="tokens per stream")
    gb.add_argument("--json", action="store_true", help="print the results as JSON")
    sampling_flags(gb)
    gb.set_defaults(func=gate_cost)
    sb = bsub.add_parser("sampling", help="seeded sampling's cost against greedy decoding, side by side")
    model_args(sb)
    sb.add_argument("--concurrency", default="1,8", help="comma-separated numbers of streams")
    sb.add_argument("--max-new-tokens", type=int, default=32, help="tokens per stream")
    sb.add_argument("--json", action="store_true", help="print the results as JSON")
    sampling_flags(sb)
    sb.set_defaults(func=sampling_cost)


def _print(text: str) -> int:
    print(text)
    sys.stdout.flush()
    return 0


def throughput(a: argparse.Namespace) -> int:
    r = bench.throughput(model=a.model, mode=a.mode, concurrency_list=parse_concurrency(a.concurrency),
                         max_new_tokens=a.max_new_tokens, gate=a.gate, tau=a.tau, profile=a.profile,
                         deep_tau=a.deep_tau, speculative=speculative_from_args(a))
    return _print(json.dumps(r) if a.json else bench.format_table(r))


def gate_cost(a: argparse.Namespace) -> int:
    r = bench.gate_cost(model=a.model, mode=a.mode, concurrency=a.concurrency, max_new_tokens=a.max_new_tokens,
                        tau=a.tau, deep_tau=a.deep_tau, profile=a.profile, sampling=sampling_args(a) or None)
    return _print(json.dumps(r) if a.json else bench.format_gate_cost(r))


def sampling_cost(a: argparse.Namespace) -> int:
    r = bench.sampling_cost(model=a.model, mode=a.mode, concurrency_list=parse_concurrency(a.concurrency),
                            max_new_tokens=a.max_new_tokens, sampling=sampling_args(a) or None)
    return _print(json.dumps(r) if a.json else bench.format_sampling_cost(r))
