"""``candle-gate verify``: replays recorded server responses locally (:mod:`candle_gate.audit`)."""
from __future__ import annotations

import argparse
import json
import sys

from ..engine import DEFAULT_MODE, ENGINE_DEFAULTS, MODES
from ..models import DEFAULT_MODEL
from ..server.settings import KV_DTYPES
from .common import gate_args


def main(a: argparse.Namespace) -> int:
    try:
        from ..audit import load_record, verify
        from ..server import app  # noqa: F401
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


def add_parser(sub) -> None:
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
                   help=f"the server's mode (default: the one the record's system_fingerprint names, else {DEFAULT_MODE})")
    v.add_argument("--profile", default=None, help="the server's --profile (default: none)")
    gate_args(v)
    v.add_argument("--kv-dtype", default=None, choices=KV_DTYPES,
                   help=f"the server's --kv-dtype (default: the record's system_fingerprint's, else "
                        f"{ENGINE_DEFAULTS['kv_dtype']})")
    v.add_argument("--max-model-len", type=int, default=None, help="as the server's --max-model-len (default: the model's context)")
    v.add_argument("--json", action="store_true", help="print the checks as JSON")
    v.set_defaults(func=main)
