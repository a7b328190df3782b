"""What storing K/V in f16 does to greedy decoding, against the FP32 oracle.

    python benches/kv_dtype_agreement.py [--models smollm2-135m-instruct-q4_1,qwen2.5-coder-0.5b-instruct-q4_k_m]
                                         [--new-tokens 64] [--chats N] [--json OUT]

For each held-out chat (``tests/data/heldout_chats.json``) three greedy runs of the same
model: the ``invariant`` fast lane with f16 K/V (the default), the same with f32 K/V, and the
oracle: every step decided in the reference lane (exact FP32 matmuls) over a cache the reference
lane rebuilt itself, in f32 (``gate="always"`` with a ``deep_tau`` above any margin). Printed per model:
how many chats agree with the oracle over every token, and the mean share of tokens before the
first divergence, for each storage. Nothing is asserted; f16 rounding is one more near-tie source,
like the fast lane's own quantized activations.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import List

from candle_gate import Engine, Model

HERE = os.path.dirname(os.path.abspath(__file__))


def greedy(model: Model, chats, new_tokens: int, **kw) -> List[List[int]]:
    eng = Engine(model, mode="invariant", max_num_seqs=len(chats), **kw)
    return [r.token_ids.tolist() for r in eng.generate(chats, max_new_tokens=new_tokens, chat=True)]


def agreement(runs: List[List[int]], oracle: List[List[int]]):
    same, prefix = 0, []
    for r, o in zip(runs, oracle):
        n = min(len(r), len(o))
        first = next((i for i in range(n) if r[i] != o[i]), n)
        same += first == n and len(r) == len(o)
        prefix.append(first / max(1, len(o)))
    return same, sum(prefix) / len(prefix)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="smollm2-135m-instruct-q4_1,qwen2.5-coder-0.5b-instruct-q4_k_m")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--chats", type=int, default=0, help="the first N held-out chats (0: all)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    with open(os.path.join(HERE, "..", "tests", "data", "heldout_chats.json")) as f:
        chats = json.load(f)
    if a.chats:
        chats = chats[:a.chats]
    rows = []
    for name in a.models.split(","):
        model = Model.load(name)
        print(f"{name}: {len(chats)} chats x {a.new_tokens} greedy tokens", file=sys.stderr, flush=True)
        oracle = greedy(model, chats, a.new_tokens, kv_dtype="f32", gate="always", tau=0.0, deep_tau=1e30)
        for dtype in ("f16", "f32"):
            same, prefix = agreement(greedy(model, chats, a.new_tokens, kv_dtype=dtype), oracle)
            rows.append({"model": name, "kv_dtype": dtype, "chats": len(chats), "identical": same, "mean_prefix": prefix})
            print(f"{name:<38} K/V {dtype}: {same} of {len(chats)} chats identical to the oracle over all "
                  f"{a.new_tokens} tokens; {100 * prefix:.1f}% of tokens before the first divergence", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
