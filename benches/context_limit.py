"""Fill a model's whole context and decode past it: memory and speed at the longest prompt.

    python benches/context_limit.py [--model qwen2.5-coder-0.5b-instruct-q4_k_m] [--context 0]
                                    [--new-tokens 8] [--kv-dtype f16] [--threads 2]

Prefills ``--context`` tokens of running text (0: the model's context length less the new
tokens) in chunks of 512, decodes ``--new-tokens`` greedily, and prints prefill and decode
tok/s, the KV blocks held and their bytes, and the process's peak resident memory. Nothing is
asserted.
"""
from __future__ import annotations

import argparse
import resource
import sys
import time

from candle_gate import Engine, Model

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from vs_llama_cpp import long_prompt  # noqa: E402  (the same running text as the comparison)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct-q4_k_m")
    ap.add_argument("--context", type=int, default=0)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--kv-dtype", default="f16")
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args(argv)
    model = Model.load(a.model)
    limit = int(model.config["context_length"])
    n = a.context or limit - a.new_tokens
    print(f"{a.model}: context length {limit}; prompt {n} tokens, {a.new_tokens} new, K/V {a.kv_dtype}", flush=True)
    toks = long_prompt(model, n, 0)
    eng = Engine(model, mode="invariant", prefill_chunk=512, max_tokens_per_step=512, threads=a.threads,
                 kv_budget_tokens=n + a.new_tokens, kv_dtype=a.kv_dtype)
    t0 = time.perf_counter()
    rid = eng.submit(toks, max_new_tokens=a.new_tokens)
    first, last_report = None, t0
    while eng.has_work:
        eng.step()
        for ev in eng.events():
            if ev["type"] == "token" and first is None:
                first = time.perf_counter()
        now = time.perf_counter()
        if first is None and now - last_report > 30:
            last_report = now
            print(f"  prefilling: {now - t0:.0f} s", file=sys.stderr, flush=True)
    t1 = time.perf_counter()
    r = eng.result(rid)
    blocks = eng.kv_stats()["used"]  # all given back by now
    per_token = model.config[f"kv_bytes_per_token_{a.kv_dtype}"]
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"prefill {n / (first - t0):.1f} tok/s ({first - t0:.1f} s); decode {(len(r.token_ids) - 1) / (t1 - first):.1f} tok/s "
          f"at {n} positions; K/V {(n + a.new_tokens) * per_token / 2**20:.0f} MiB ({per_token} bytes a position); "
          f"peak resident memory {peak_mb:.0f} MiB; blocks held after: {blocks}; finish {r.finish_reason}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
