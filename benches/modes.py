"""Two modes of one build side by side: decode and prefill speed of ``canonical`` against
``invariant`` (or any two modes), each model loaded once per mode (weights packed as that mode
packs them), rounds alternating so that a shared host's moods hit both alike; each side keeps
its best round and the ratio is printed.

    python benches/modes.py [--models qwen2.5-coder-1.5b-instruct-q4_k_m,...] [--modes canonical,invariant]
                            [--streams 1,8] [--new-tokens 32] [--prefill 1024] [--rounds 2] [--json OUT]

decode tok/s: ``candle_gate.bench.throughput``'s figure (tokens after every stream's first, over
the time they took, summed over streams). prefill tok/s: one prompt of ``--prefill`` tokens of
running text, its tokens over the time to its first token. Nothing is asserted: numbers depend
on the machine, which the JSON names.
"""
from __future__ import annotations

import argparse
import json
import time
from typing import Dict, List

import candle_gate
from candle_gate import Engine, Model, layout_for
from candle_gate.bench import throughput

import provenance


def long_ids(model: Model, n: int) -> List[int]:
    text = ""
    i = 0
    while len(model.tokenize(text)) < n:
        text += (f"Note {i}: the ferry to the north island leaves at {i * 7 % 60} past the hour and waits "
                 f"for the bus from the station when it is late. ")
        i += 1
    return model.tokenize(text)[:n]


def prefill_tok_s(model: Model, mode: str, ids: List[int]) -> float:
    eng = Engine(model, mode=mode, max_tokens_per_step=512, prefill_chunk=512, enable_prefix_caching=False)
    t0 = time.perf_counter()
    rid = eng.submit(ids, max_new_tokens=1)
    eng.run([rid])
    return len(ids) / (time.perf_counter() - t0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2-135m-instruct-q4_1,qwen2.5-coder-0.5b-instruct-q4_k_m,"
                    "qwen2.5-coder-1.5b-instruct-q4_k_m,gemma-3-270m-q4_k_m")
    ap.add_argument("--modes", default="canonical,invariant", help="two modes; ratios are first / second")
    ap.add_argument("--streams", default="1,8")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--prefill", type=int, default=1024, help="prompt tokens of the prefill measurement (0: none)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    modes = a.modes.split(",")
    if len(modes) != 2:
        ap.error("--modes takes two modes")
    streams = [int(s) for s in a.streams.split(",")]
    out: Dict = {**provenance.stamp(), "modes": modes, "models": {}}
    print(f"host: {out['host']}, commit {out['commit']}; {modes[0]} / {modes[1]}, best of {a.rounds} alternating rounds")
    for name in a.models.split(","):
        loaded = {m: Model.load(name, layout=layout_for(m)) for m in modes}
        ids = long_ids(loaded[modes[0]], a.prefill) if a.prefill else []
        best: Dict[str, Dict[str, float]] = {m: {} for m in modes}
        for _ in range(a.rounds):
            for m in modes:
                r = throughput(loaded[m], mode=m, concurrency_list=streams, max_new_tokens=a.new_tokens)
                for row in r["results"]:
                    key = f"decode_{row['concurrency']}"
                    best[m][key] = max(best[m].get(key, 0.0), row["tok_per_s"])
                if ids:
                    best[m]["prefill"] = max(best[m].get("prefill", 0.0), prefill_tok_s(loaded[m], m, ids))
        out["models"][name] = best
        for key in best[modes[0]]:
            x, y = best[modes[0]][key], best[modes[1]][key]
            print(f"{name:<38} {key:<10} {modes[0]} {x:8.1f} tok/s   {modes[1]} {y:8.1f} tok/s   {x / y:5.2f}x")
        del loaded
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    print(f"candle_gate {candle_gate.__file__}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
