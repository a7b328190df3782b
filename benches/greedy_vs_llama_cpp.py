"""Greedy agreement with llama.cpp on the same GGUF: where do the two first choose different
tokens, and how close was that call?

    pip install ".[peer]"          # llama-cpp-python
    python benches/greedy_vs_llama_cpp.py [--model gemma-3-270m-q4_k_m] [--prompts 24] [--new-tokens 32]
                                          [--json OUT]

The prompts are the held-out chats (``tests/data/heldout_chats.json``, disjoint from the
calibration prompts), rendered by the model's chat template, or given as plain text to a base
model without one. Each prompt is decoded greedily, alone, by candle-gate (``invariant`` mode)
and by llama.cpp (one sequence, its logits read each step), from the same token ids. For every
prompt that diverges the table gives the step and the top-1/top-2 logit margin each side saw
there: a divergence at a near-tie (a margin within the two engines' usual logit difference) is
rounding deciding a coin toss, not a model difference. Nothing is asserted.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

import candle_gate
from candle_gate import Engine, Model
from candle_gate.bench import chat_ids

HELDOUT = Path(__file__).parent.parent / "tests" / "data" / "heldout_chats.json"


def llama_greedy(llm, ids, n):
    """llama.cpp's greedy tokens and each step's top-1/top-2 margin."""
    llm.reset()
    llm.eval(ids)
    toks, margins = [], []
    for _ in range(n):
        logits = np.asarray(llm.scores[llm.n_tokens - 1], dtype=np.float64)
        top2 = np.partition(logits, -2)[-2:]
        margins.append(float(abs(top2[1] - top2[0])))
        t = int(logits.argmax())
        toks.append(t)
        if t == llm.token_eos():
            break
        llm.eval([t])
    return toks, margins


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gemma-3-270m-q4_k_m")
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    try:
        import llama_cpp
    except ImportError:
        print("llama-cpp-python is not installed: pip install '.[peer]'", file=sys.stderr)
        return 2
    model = Model.load(a.model)
    chats = json.loads(HELDOUT.read_text())[: a.prompts]
    llm = llama_cpp.Llama(str(model.path), n_ctx=1024, n_threads=a.threads, logits_all=True, verbose=False)
    rows = []
    for i, chat in enumerate(chats):
        ids = chat_ids(model, chat)
        ours = Engine(model, mode="invariant", threads=a.threads).generate([ids], max_new_tokens=a.new_tokens)[0]
        mine = [int(t) for t in ours.token_ids]
        theirs, their_margins = llama_greedy(llm, ids, a.new_tokens)
        n = min(len(mine), len(theirs))
        at = next((j for j in range(n) if mine[j] != theirs[j]), None)
        row = {"prompt": chat[-1]["content"], "tokens": n, "first_divergence": at}
        if at is not None:
            row["margin_candle_gate"] = float(ours.margins[at])
            row["margin_llama_cpp"] = their_margins[at]
        rows.append(row)
        where = "same" if at is None else f"step {at}: margins {row['margin_candle_gate']:.3f} / {row['margin_llama_cpp']:.3f}"
        print(f"{i:>3} {where:<40} {chat[-1]['content'][:60]!r}", flush=True)
    same = sum(r["first_divergence"] is None for r in rows)
    div = [r for r in rows if r["first_divergence"] is not None]
    print(f"\n{a.model}: {same}/{len(rows)} prompts identical over {a.new_tokens} greedy tokens")
    if div:
        m = sorted(min(r["margin_candle_gate"], r["margin_llama_cpp"]) for r in div)
        print(f"diverging at steps {sorted(r['first_divergence'] for r in div)}; the smaller margin there: "
              f"median {np.median(m):.3f}, largest {m[-1]:.3f} (logits)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"model": a.model, "new_tokens": a.new_tokens, "llama_cpp_python": llama_cpp.__version__,
                       "candle_gate": candle_gate.__version__, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
