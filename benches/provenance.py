"""Where a result was measured, recorded by the command that measured it: the commit of this
checkout (``-dirty`` with uncommitted changes), the host's CPU, and the date (UTC).
docs/BENCHMARKS.md's renderer prints these under each table."""
from __future__ import annotations

import datetime
import platform
import subprocess
from pathlib import Path
from typing import Dict

ROOT = Path(__file__).resolve().parent.parent


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()


def commit() -> str:
    try:
        dirty = bool(_git("status", "--porcelain", "--untracked-files=no"))
        return _git("rev-parse", "--short=7", "HEAD") + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def cpu() -> str:
    """`AMD EPYC (family 25 model 17, 2 cores, avx512)`: what the kernels' speed depends on."""
    info: Dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            info.setdefault(key.strip(), value.strip())
    except OSError:
        return platform.processor() or platform.machine()
    flags = set(info.get("flags", "").split())
    isa = "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else "no avx2"
    cores = sum(1 for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("processor"))
    return (f"{info.get('model name', platform.machine())} (family {info.get('cpu family', '?')} model "
            f"{info.get('model', '?')}, {cores} cores, {isa})")


def stamp() -> Dict[str, str]:
    return {"commit": commit(), "host": cpu(),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")}


if __name__ == "__main__":  # for the cargo benches that write results: the stamp as JSON
    import json
    print(json.dumps(stamp()))
