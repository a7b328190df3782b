"""Two builds' `kernels` benches side by side: each round runs both bench binaries, in turn and
in fresh processes, with the same arguments; the best invariant time (hot and cold) of each
(dtype, n, k, rows) is kept per build and the ratio printed. What a kernel-level "faster than the
previous commit" claim rests on: on a shared VM one process can run the same binary 1.3x slower
than the next, so a single run of each build compares the host's moods, not the code. By
default the rounds alternate which build runs first (`--order`, `ab_rounds.py`), since the second
of a round tends to be favoured.

    # the other build's bench, e.g. the previous commit's:
    git worktree add /tmp/prev HEAD~1
    (cd /tmp/prev && cargo bench --bench kernels --no-run)   # prints its `Executable`; copy it
                                                              # away if the two trees share a target
                                                              # directory (cargo names both alike)
    python benches/ab_kernels.py --before /tmp/prev/target/release/deps/kernels-HASH \\
        [--after BIN] [--rounds 4] [--order alternate] [--kernel canonical] [--json OUT --before-label COMMIT] -- --model qwen2.5-coder-0.5b-instruct-q4_k_m --rows 1,8 --only Q5_0

`--after` defaults to this tree's bench (built with `cargo bench --bench kernels --no-run`).
Benches older than `--only` ignore it and time every shape; only the shapes both printed are
compared. The rows are read by column position, so this follows `benches/kernels.rs`'s row
layout (unchanged since the `vs avx2` column). Nothing is asserted: the ratios are the host's,
at the time of the run.
"""
import argparse
import json
import os
import re
import subprocess
import sys
from typing import Dict, Tuple

import ab_rounds
import provenance

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
Key = Tuple[str, int, int, int]


def this_tree_bench(name: str = "kernels") -> str:
    """Builds this tree's `name` bench (if needed) and returns its executable."""
    r = subprocess.run(["cargo", "bench", "-p", "candle-gate", "--bench", name, "--no-run"],
                       cwd=ROOT, capture_output=True, text=True, check=True)
    m = re.search(rf"Executable .*\((.*{name}-[0-9a-f]+)\)", r.stderr)
    if not m:
        sys.exit(f"no `{name}` executable in cargo's output:\n{r.stderr}")
    return os.path.join(ROOT, m.group(1))


def run(binary: str, args, kernel: str = "invariant") -> Dict[Key, Tuple[float, float]]:
    """(hot ms, cold ms) of `kernel` (the invariant or the canonical mode's) per (dtype, n, k,
    rows), from one run. The bench prints the canonical kernel's cold rate, not its time: both
    kernels read the same bytes (a pack only permutes them), so its cold time is the invariant
    kernel's times the ratio of their rates."""
    done = subprocess.run([binary, *args], capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{binary} {' '.join(args)} failed (exit {done.returncode}): {done.stderr.strip()}")
    out = done.stdout
    rows = {}
    for line in out.splitlines():
        f = line.split()
        # dtype n k count rows invariant QMatMul ratio vec_dot ratio GB/s-inv inv-cold GB/s-cold vs-avx2
        # canonical vs-inv GB/s-can
        if len(f) >= 13 and f[5].endswith("ms") and f[1].isdigit():
            hot, cold = float(f[5][:-2]), float(f[11][:-2])
            if kernel == "canonical":
                if len(f) < 17:
                    sys.exit(f"{binary} printed no canonical columns")
                hot, cold = float(f[14][:-2]), cold * float(f[12]) / float(f[16])
            rows[(f[0], int(f[1]), int(f[2]), int(f[4]))] = (hot, cold)
    if not rows:
        sys.exit(f"{binary} printed no kernel rows:\n{out}")
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", required=True, help="the other build's `kernels` bench executable")
    ap.add_argument("--after", default=None, help="this build's (default: this tree's, built if needed)")
    ap.add_argument("--rounds", type=int, default=4)
    ab_rounds.add_order_option(ap)
    ap.add_argument("--kernel", choices=["invariant", "canonical"], default="invariant",
                    help="which mode's kernel to compare (default: invariant)")
    ap.add_argument("--json", help="also write the table here, with where and when it ran")
    ap.add_argument("--before-label", default=None, help="what the --before build is (a commit), recorded in --json")
    ap.add_argument("bench_args", nargs=argparse.REMAINDER, help="after `--`: the bench's own arguments")
    a = ap.parse_args(argv)
    bench_args = a.bench_args[1:] if a.bench_args[:1] == ["--"] else a.bench_args
    after = a.after or this_tree_bench()
    best = {"before": {}, "after": {}}
    for rnd in range(a.rounds):
        for side, binary in ab_rounds.in_turn((("before", a.before), ("after", after)), rnd, a.order):
            for key, (hot, cold) in run(binary, bench_args, a.kernel).items():
                h, c = best[side].get(key, (float("inf"), float("inf")))
                best[side][key] = (min(h, hot), min(c, cold))
        print(f"round {rnd + 1}/{a.rounds} done", file=sys.stderr, flush=True)
    print(f"before: {a.before}\nafter:  {after}\nbest of {a.rounds} rounds ({ab_rounds.described(a.order)}), "
          f"{a.kernel} kernel, ms")
    print(f"{'dtype':<6} {'n':>7} {'k':>6} {'rows':>4} {'hot before':>11} {'after':>8} {'ratio':>6} "
          f"{'cold before':>12} {'after':>8} {'ratio':>6}")
    table = []
    for key in sorted(best["after"]):
        if key not in best["before"]:
            continue
        (hb, cb), (ha, ca) = best["before"][key], best["after"][key]
        d, n, k, m = key
        print(f"{d:<6} {n:>7} {k:>6} {m:>4} {hb:>11.3f} {ha:>8.3f} {hb / ha:>5.2f}x {cb:>12.3f} {ca:>8.3f} {cb / ca:>5.2f}x")
        table.append({"dtype": d, "n": n, "k": k, "rows": m, "hot_ms_before": hb, "hot_ms_after": ha,
                      "cold_ms_before": cb, "cold_ms_after": ca})
    if a.json:
        with open(a.json, "w") as f:
            json.dump({**provenance.stamp(), "before": a.before_label or a.before, "kernel": a.kernel, "rounds": a.rounds, "order": a.order,
                       "bench_args": bench_args, "results": table}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
