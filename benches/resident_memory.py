"""Resident memory after loading each model (gate off, `invariant`, two tokens generated so the
first step's buffers exist), against the GGUF file's size, and how much of it lies in huge
pages (`AnonHugePages`, Linux; the weights ask for them, docs/DESIGN.md). Each model in a fresh
process; the interpreter's own RSS (Python, numpy, the extension, before any model) is printed
beside.

    python benches/resident_memory.py [--models a,b] [--json OUT [--build-label COMMIT]]

`--build-label` names the build measured where it is not this tree's (a package put first on
PYTHONPATH, as `benches/ab_builds.py` takes them).
"""
import argparse
import json
import subprocess
import sys

import provenance

CHILD = r"""
import os, sys
def rss(): return int(open("/proc/self/statm").read().split()[1]) * 4096
def huge():
    try:
        rollup = open("/proc/self/smaps_rollup").read().splitlines()
    except OSError:
        return -1
    return next((int(l.split()[1]) * 1024 for l in rollup if l.startswith("AnonHugePages:")), -1)
import candle_gate as cg
base = rss()
m = cg.Model.load(sys.argv[1], quiet=True)
cg.Engine(m, mode="invariant").generate(["Hello"], max_new_tokens=2)
print(os.path.getsize(m.path), base, rss(), huge())
"""


def main():
    import candle_gate
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(candle_gate.models.KNOWN_MODELS))
    ap.add_argument("--json", default=None, help="also write the figures here, with where they were measured")
    ap.add_argument("--build-label", default=None, help="the build measured (a commit), recorded in --json")
    args = ap.parse_args()
    print(f"{'model':<38} {'file MB':>8} {'RSS MB':>8} {'RSS/file':>9} {'(RSS - interpreter)/file':>25} {'huge MB':>8}")
    results = []
    for name in args.models.split(","):
        out = subprocess.run([sys.executable, "-c", CHILD, name], check=True, capture_output=True, text=True).stdout
        size, base, rss, huge = map(int, out.split()[-4:])
        shown = f"{huge / 1e6:>8.0f}" if huge >= 0 else f"{'n/a':>8}"
        print(f"{name:<38} {size / 1e6:>8.0f} {rss / 1e6:>8.0f} {rss / size:>8.2f}x {(rss - base) / size:>24.2f}x {shown}")
        results.append({"model": name, "file_bytes": size, "interpreter_rss_bytes": base, "rss_bytes": rss,
                        "huge_page_bytes": huge if huge >= 0 else None})
    if args.json:
        with open(args.json, "w") as f:
            stamp = provenance.stamp()
            json.dump({**stamp, "build": args.build_label or stamp["commit"], "package": candle_gate.__file__,
                       "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
