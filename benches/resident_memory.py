"""Resident memory after loading each model (gate off, `invariant`, two tokens generated so the
first step's buffers exist), against the GGUF file's size. Each model in a fresh process;
the interpreter's own RSS (Python, numpy, the extension, before any model) is printed beside.

    python benches/resident_memory.py [--models a,b]
"""
import argparse
import subprocess
import sys

CHILD = r"""
import os, sys
def rss(): return int(open("/proc/self/statm").read().split()[1]) * 4096
import candle_gate as cg
base = rss()
m = cg.Model.load(sys.argv[1], quiet=True)
cg.Engine(m, mode="invariant").generate(["Hello"], max_new_tokens=2)
print(os.path.getsize(m.path), base, rss())
"""


def main():
    import candle_gate
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(candle_gate.models.KNOWN_MODELS))
    args = ap.parse_args()
    print(f"{'model':<38} {'file MB':>8} {'RSS MB':>8} {'RSS/file':>9} {'(RSS - interpreter)/file':>25}")
    for name in args.models.split(","):
        out = subprocess.run([sys.executable, "-c", CHILD, name], check=True, capture_output=True, text=True).stdout
        size, base, rss = map(int, out.split()[-3:])
        print(f"{name:<38} {size / 1e6:>8.0f} {rss / 1e6:>8.0f} {rss / size:>8.2f}x {(rss - base) / size:>24.2f}x")


if __name__ == "__main__":
    main()
