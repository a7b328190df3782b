"""Two builds' `attention` benches side by side: each round runs both bench binaries, in turn and
in fresh processes, with the same arguments; the median decode-step and 512-row prefill times of
each (model shape, context, tier) are kept per build and the ratio printed. What an
attention-kernel "faster than the previous commit" claim rests on.

Medians, not the best of the rounds as `ab_kernels.py` keeps: a decode step's attention reads
every layer's K/V from memory, and on these shared hosts the bandwidth a round gets swings
(the same binary's Qwen 1.5B step at 4,096 positions took 6.4–11.2 ms on the 2-core Zen 4), so
the best of a few rounds is whichever build met the host's best moment.

    # the other build's bench, e.g. the previous commit's:
    git worktree add /tmp/prev HEAD~1
    (cd /tmp/prev && cargo bench --bench attention --no-run)   # prints its `Executable`; copy it
                                                                # away if the trees share a target
    python benches/ab_attention.py --before /tmp/attention-prev [--after BIN] [--rounds 12] \\
        [--json OUT --before-label COMMIT] -- --contexts 1024,4096 --tier avx512

`--after` defaults to this tree's bench (built with `cargo bench --bench attention --no-run`).
Only the shapes both builds printed are compared. Nothing is asserted: the ratios are the
host's, at the time of the run.
"""
import argparse
import json
import statistics
import subprocess
import sys
from typing import Dict, List, Tuple

import ab_kernels
import ab_rounds
import provenance

Key = Tuple[str, int, str]


def run(binary: str, args) -> Dict[Key, Tuple[float, float]]:
    """(decode ms, prefill ms) per (model, context, tier), from one run of the bench, whose rows
    are: model, context, tier, decode ms, GB/s, % of bandwidth, prefill-512 ms."""
    done = subprocess.run([binary, *args], capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{binary} {' '.join(args)} failed (exit {done.returncode}): {done.stderr.strip()}")
    rows = {}
    for line in done.stdout.splitlines():
        f = line.split()
        if len(f) == 7 and f[1].isdigit():
            try:
                rows[(f[0], int(f[1]), f[2])] = (float(f[3]), float(f[6]))
            except ValueError:
                continue
    if not rows:
        sys.exit(f"{binary} printed no attention rows:\n{done.stdout}")
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", required=True, help="the other build's `attention` bench executable")
    ap.add_argument("--after", default=None, help="this build's (default: this tree's, built if needed)")
    ap.add_argument("--rounds", type=int, default=12)
    ab_rounds.add_order_option(ap)
    ap.add_argument("--json", help="also write the table here, with where and when it ran")
    ap.add_argument("--before-label", default=None, help="what the --before build is (a commit), recorded in --json")
    ap.add_argument("bench_args", nargs=argparse.REMAINDER, help="after `--`: the bench's own arguments")
    a = ap.parse_args(argv)
    bench_args = a.bench_args[1:] if a.bench_args[:1] == ["--"] else a.bench_args
    after = a.after or ab_kernels.this_tree_bench("attention")
    seen: Dict[str, Dict[Key, List[Tuple[float, float]]]] = {"before": {}, "after": {}}
    for rnd in range(a.rounds):
        for side, binary in ab_rounds.in_turn((("before", a.before), ("after", after)), rnd, a.order):
            for key, times in run(binary, bench_args).items():
                seen[side].setdefault(key, []).append(times)
        print(f"round {rnd + 1}/{a.rounds} done", file=sys.stderr, flush=True)
    print(f"before: {a.before}\nafter:  {after}\nmedian of {a.rounds} rounds ({ab_rounds.described(a.order)}), ms")
    print(f"{'model':<14} {'context':>7} {'tier':<8} {'decode before':>13} {'after':>8} {'ratio':>6} "
          f"{'prefill before':>14} {'after':>8} {'ratio':>6}")
    table = []
    for key in sorted(seen["after"]):
        if key not in seen["before"]:
            continue
        (db, pb), (da, pa) = ([statistics.median(t[i] for t in seen[side][key]) for i in (0, 1)]
                              for side in ("before", "after"))
        model, context, tier = key
        print(f"{model:<14} {context:>7} {tier:<8} {db:>13.3f} {da:>8.3f} {db / da:>5.2f}x "
              f"{pb:>14.1f} {pa:>8.1f} {pb / pa:>5.2f}x")
        table.append({"model": model, "context": context, "tier": tier, "decode_ms_before": db,
                      "decode_ms_after": da, "prefill_ms_before": pb, "prefill_ms_after": pa})
    if a.json:
        with open(a.json, "w") as f:
            json.dump({**provenance.stamp(), "before": a.before_label or a.before, "rounds": a.rounds,
                       "order": a.order, "statistic": "median", "bench_args": bench_args, "results": table},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
