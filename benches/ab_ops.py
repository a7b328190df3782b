"""Two builds' `ops` benches side by side (`cargo bench --bench ops`: our `exp`, SiLU and GELU
in ns per element): each round runs both binaries, in turn and in fresh processes; the best
time of each step is kept per build and the ratio printed. Steps only one build prints are
listed without a ratio. Nothing is asserted: the ratios are the host's, at the time of the run.

    # the other build's bench (copy it away if both trees share a target directory):
    git worktree add /tmp/prev HEAD~1 && cp benches/ops.rs /tmp/prev/benches/   # if it has none
    (cd /tmp/prev && cargo bench --bench ops --no-run)
    python benches/ab_ops.py --before /tmp/ops-prev [--after BIN] [--rounds 3] [--json OUT --before-label COMMIT]

`CANDLE_GATE_ISA=avx2` caps both builds' tier, as it does the kernels'.
"""
import argparse
import json
import os
import subprocess
import sys
from typing import Dict

import provenance
from ab_kernels import this_tree_bench

def run(binary: str) -> Dict[str, float]:
    """ns per element of each step, from one run (the bench prints `step  ns` lines)."""
    out = subprocess.run([binary], capture_output=True, text=True, check=True).stdout
    steps = {}
    for line in out.splitlines()[1:]:
        name, _, ns = line.rpartition(" ")
        try:
            steps[name.strip()] = float(ns)
        except ValueError:
            continue
    if not steps:
        sys.exit(f"{binary} printed no steps:\n{out}")
    return steps


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", required=True, help="the other build's `ops` bench executable")
    ap.add_argument("--after", default=None, help="this build's (default: this tree's, built if needed)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", help="also write the table here, with where and when it ran")
    ap.add_argument("--before-label", default=None, help="what the --before build is (a commit), recorded in --json")
    a = ap.parse_args(argv)
    after = a.after or this_tree_bench("ops")
    best: Dict[str, Dict[str, float]] = {"before": {}, "after": {}}
    for rnd in range(a.rounds):
        for side, binary in (("before", a.before), ("after", after)):
            for step, ns in run(binary).items():
                best[side][step] = min(best[side].get(step, float("inf")), ns)
        print(f"round {rnd + 1}/{a.rounds} done", file=sys.stderr, flush=True)
    tier = os.environ.get("CANDLE_GATE_ISA", "")
    print(f"before: {a.before}\nafter:  {after}\nbest of {a.rounds} alternating rounds, ns per element"
          + (f", CANDLE_GATE_ISA={tier}" if tier else ""))
    print(f"{'step':<30} {'before':>8} {'after':>8} {'ratio':>6}")
    table = []
    for step, ns in best["after"].items():
        was = best["before"].get(step)
        before = f"{was:>8.3f} " if was is not None else " " * 9
        print(f"{step:<30} {before}{ns:>8.3f} " + (f"{was / ns:>5.2f}x" if was is not None else ""))
        table.append({"step": step, "ns_before": was, "ns_after": ns})
    if a.json:
        with open(a.json, "w") as f:
            json.dump({**provenance.stamp(), "before": a.before_label or a.before, "rounds": a.rounds,
                       "isa": tier or "widest", "results": table}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
