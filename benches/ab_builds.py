"""Two builds of candle-gate side by side: `candle-gate bench throughput` (aggregate decode
tok/s at each concurrency) run alternately with each build, rounds interleaved, the best and
the median of each kept (every round is in --json), and the ratios printed. What a "no
slowdown" or "faster" claim between two commits rests on.

    # the build to compare against, e.g. the previous commit's, as a package directory:
    git worktree add /tmp/prev HEAD~1
    (cd /tmp/prev && cargo build --release -p candle-gate-py)
    mkdir -p /tmp/prev-pkg && cp -r /tmp/prev/python/candle_gate /tmp/prev-pkg/ \\
        && cp /tmp/prev/target/release/lib_native.so /tmp/prev-pkg/candle_gate/_native.abi3.so
    python benches/ab_builds.py --before /tmp/prev-pkg [--model NAME] [--mode invariant]

`--after` defaults to the package this interpreter imports (the work tree's, when installed
editable). Each run is a fresh process, so the two builds never share one. On these shared
hosts the build that runs second in a round tends to be favoured, so by default the rounds
alternate which build goes first (`--order alternate`, `ab_rounds.py`; give an even `--rounds`);
`--order before-first` runs `--before` first in every round, as this script did until 2026-12-06.

With `--context N` each stream's prompt is instead N tokens of running text and each run is
`benches/vs_llama_cpp.py`'s candle-gate side (the same prompts, prefill in chunks, decode tok/s
counted once every stream has its first token): long-context decode, and prefill, two builds
side by side (`--json` keeps the prefill rows as `prefill_rows`).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

import ab_rounds
import provenance


def env_for(pkg_dir):
    env = dict(os.environ)
    if pkg_dir:
        env["PYTHONPATH"] = pkg_dir + os.pathsep + env.get("PYTHONPATH", "")
    return env


def where(pkg_dir):
    """The package a build's runs import (said once per side)."""
    return subprocess.run([sys.executable, "-c", "import candle_gate; print(candle_gate.__file__)"],
                          env=env_for(pkg_dir), check=True, capture_output=True, text=True).stdout.strip()


def long_context_child(argv):
    """One `--context` run, in a child process that imports the build under test:
    vs_llama_cpp.py's prompts and measure; prints the results as JSON."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import vs_llama_cpp as v
    from candle_gate import Model
    model, context, new, threads, concurrency = argv[0], int(argv[1]), int(argv[2]), int(argv[3]), argv[4]
    m = Model.load(model)  # invariant's layout, the default in every build
    out = []
    for c in [int(x) for x in concurrency.split(",")]:
        r = v.candle_gate_run(m, [v.long_prompt(m, context, i) for i in range(c)], new, threads)
        out.append({"concurrency": c, "tok_per_s": r["decode_tok_s"], "prefill_tok_s": r["prefill_tok_s"]})
    print(json.dumps({"results": out}))


def run(pkg_dir, args):
    """{(metric, concurrency): tok/s} of one run: decode, and with --context prefill too."""
    env = env_for(pkg_dir)
    if args.context:
        cmd = [sys.executable, os.path.abspath(__file__), "--long-context-child", args.model, str(args.context),
               str(args.max_new_tokens), str(os.cpu_count() or 1), args.concurrency]
        out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
        got = {}
        for r in json.loads(out.strip().splitlines()[-1])["results"]:
            got[("decode", r["concurrency"])] = r["tok_per_s"]
            got[("prefill", r["concurrency"])] = r["prefill_tok_s"]
        return got
    cmd = [sys.executable, "-m", "candle_gate", "bench", "throughput", "--json", "--model", args.model,
           "--mode", args.mode, "--concurrency", args.concurrency, "--max-new-tokens", str(args.max_new_tokens)]
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
    return {("decode", r["concurrency"]): r["tok_per_s"] for r in json.loads(out.strip().splitlines()[-1])["results"]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", required=True, help="a directory holding the other build's candle_gate package")
    ap.add_argument("--after", default=None, help="the same for this build (default: what `import candle_gate` finds)")
    ap.add_argument("--model", default="smollm2-135m-instruct-q4_1")
    ap.add_argument("--mode", default="invariant")
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=4)
    ab_rounds.add_order_option(ap)
    ap.add_argument("--context", type=int, default=0,
                    help="prompts of this many tokens of running text (default: the short chat prompts)")
    ap.add_argument("--json", help="also write the table here")
    ap.add_argument("--before-label", default=None, help="what the --before build is (a commit), recorded in --json")
    args = ap.parse_args()
    if args.context and args.mode != "invariant":
        ap.error("--context runs vs_llama_cpp.py's engine, which is `invariant` mode")
    seen = {"before": {}, "after": {}}
    paths = {"before": where(args.before), "after": where(args.after)}
    sides = (("before", args.before), ("after", args.after))
    for r in range(args.rounds):
        for side, pkg in ab_rounds.in_turn(sides, r, args.order):
            got = run(pkg, args)
            for c, v in got.items():
                seen[side].setdefault(c, []).append(v)
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    what = f", {args.context}-token prompts" if args.context else ""
    print(f"{args.model}, {args.mode}{what}, tok/s, best and median of {args.rounds} rounds "
          f"({ab_rounds.described(args.order)})")
    print(f"  before: {paths['before']}\n  after:  {paths['after']}")
    print(f"{'metric':>8} {'concurrency':>12} {'before':>10} {'after':>10} {'after/before':>13}"
          f" {'median before':>14} {'median after':>13} {'after/before':>13}")
    tables = {"decode": [], "prefill": []}
    for metric, c in sorted(seen["before"]):
        rb, ra = seen["before"][(metric, c)], seen["after"][(metric, c)]
        b, a = max(rb), max(ra)
        # The best suits a quiet host; on a shared one a round's rate swings by a third, and the
        # median of many alternating rounds moves least with a single lucky or unlucky round.
        mb, ma = statistics.median(rb), statistics.median(ra)
        tables[metric].append({"concurrency": c, "before": b, "after": a, "ratio": a / b, "before_median": mb,
                               "after_median": ma, "median_ratio": ma / mb, "before_rounds": rb, "after_rounds": ra})
        print(f"{metric:>8} {c:>12} {b:>10.1f} {a:>10.1f} {a / b:>12.2f}x {mb:>14.1f} {ma:>13.1f} {ma / mb:>12.2f}x")
    rows = tables["decode"]
    if args.json:
        with open(args.json, "w") as f:
            # The checkout's commit is the "after" build's when it is the work tree's (the default).
            json.dump({**provenance.stamp(), "before_build": args.before_label, "model": args.model, "mode": args.mode,
                       "context": args.context or None, "rounds": args.rounds, "order": args.order,
                       "rows": rows,
                       **({"prefill_rows": tables["prefill"]} if tables["prefill"] else {})}, f, indent=1)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--long-context-child"]:
        long_context_child(sys.argv[2:])
    else:
        main()
