"""Render the measured tables of docs/BENCHMARKS.md and README.md from benches/results/.

Every table a document keeps between a pair of markers::

    <!-- table:NAME -->
    ...generated...
    <!-- /table:NAME -->

is written by this script from the result files named in its `Source` line, with the commit,
host and date of each file. The prose around the markers stays hand-written: say what a table
shows there, and let the numbers come from here. To change a number, rerun its bench and commit
the result file; to change how a table looks, change its function below. Run

    python benches/render_benchmarks.py            # rewrite the tables in place
    python benches/render_benchmarks.py --check    # exit 1 if a document differs from its render

`--check` also fails on a marker that names no table, a table rendered into no document, and a
link to a section of docs/BENCHMARKS.md that does not exist (tests/benches/test_render_benchmarks.py runs
it, so CI catches a hand-edited number).

Most result files do not record where and when they were measured. For those, PROVENANCE below
holds what the commit that added the file (and the prose written with it) states, and the
rendered source line marks it with a dagger (†). A file that records its own `commit`, `host` or
`date` is believed over PROVENANCE.

Standard library only; reads JSON, writes Markdown.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import unicodedata
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = "benches/results"

# The documents this script renders into, relative to the repository root.
DOCUMENTS = ("docs/BENCHMARKS.md", "README.md")
# Documents whose links to docs/BENCHMARKS.md sections --check verifies.
LINKING_DOCUMENTS = ("README.md", "CHANGELOG.md", "CONTRIBUTING.md", "docs/*.md")

HOSTS = {
    "epyc": "the 2-core AMD EPYC (AVX2, no AVX-512)",
    "epyc-zen1": "the 2-core AMD EPYC (Zen 1, AVX2, no AVX-512)",
    "epyc-zen3": "the 2-core AMD EPYC Zen 3 (AVX2, no AVX-512)",
    "epyc-zen4": "the 2-core AMD EPYC Zen 4 (KVM, AVX-512 VNNI)",
    "xeon": "the 2-core Intel Xeon (KVM, AVX-512 VNNI, AMX)",
    "h200": "an NVIDIA H200 (driver 580.159.04, CUDA 13.0)",
}

# What the commit that added each result file states about it, for files that do not record it
# themselves: the commit measured ("at"), or, where no commit was stated, the commit that added
# the file ("added"), the host (a key of HOSTS) and the date. `before`: the other build of an A/B.
PROVENANCE = {
    "headline-chat-xeon-spr-4870004.json": dict(at="4870004", host="xeon", date="2026-12-05"),
    "headline-4096-xeon-spr-4870004.json": dict(at="4870004", host="xeon", date="2026-12-05"),
    "vs-llama-cpp.json": dict(at="d2926a6", host="epyc-zen1", date="2026-12-02"),
    "vs-llama-cpp-xeon.json": dict(at="45440ca", host="xeon", date="2026-12-02"),
    "vs-llama-cpp-epyc-zen3.json": dict(at="5e0c13e", host="epyc-zen3", date="2026-12-03"),
    "vs-llama-cpp-context-smollm2-zen4.json": dict(at="6c94361", host="epyc-zen4", date="2026-12-03"),
    "vs-llama-cpp-context-qwen05-zen4.json": dict(at="6c94361", host="epyc-zen4", date="2026-12-03"),
    "vs-llama-cpp-context-qwen15-zen4.json": dict(at="6c94361", host="epyc-zen4", date="2026-12-03"),
    "vs-llama-cpp-context1024-8streams-zen4.json": dict(at="6c94361", host="epyc-zen4", date="2026-12-03"),
    "vs-llama-cpp-context4096-grouped-attention-zen4.json": dict(at="445f6ba", host="epyc-zen4", date="2026-12-04"),
    "vs-llama-cpp-context4096-qwen05-2rounds-zen4.json": dict(added="cd6253e", host="epyc-zen4", date="2026-12-03"),
    "vs-llama-cpp-context4096-qwen15-2rounds-zen4.json": dict(added="cd6253e", host="epyc-zen4", date="2026-12-03"),
    "vs-llama-cpp-context-qwen15-kquant-zen4.json": dict(at="3421453", host="epyc-zen4", date="2026-12-04"),
    "vs-llama-cpp-context4096-qwen15-packed-zen4.json": dict(added="256301a", host="epyc-zen4", date="2026-12-04"),
    "vs-llama-cpp-chat-qwen15-packed-zen4.json": dict(added="150fc8e", host="epyc-zen4", date="2026-12-04"),
    "vs-llama-cpp-context4096-no-prefetch-zen4.json": dict(at="92bae34", host="epyc-zen4", date="2026-12-05"),
    "vs-llama-cpp-context4096-qwen05-grouped-attention-zen4.json": dict(at="a9a65a8", host="epyc-zen4", date="2026-12-05"),
    "vs-llama-cpp-context16384-qwen15-zen4.json": dict(at="445f6ba", host="epyc-zen4", date="2026-12-05"),
    "vs-llama-cpp-context4096-q8_0-avx512-attention-zen4.json": dict(at="2fa8a46", host="epyc-zen4", date="2026-12-05"),
    "vs-llama-cpp-context4096-qwen15-avx512-attention-zen4.json": dict(at="a858489", host="epyc-zen4", date="2026-12-05"),
    "vs-llama-cpp-context16384-qwen05-avx512-attention-zen4.json": dict(at="01f78f1", host="epyc-zen4", date="2026-12-05"),
    "vs-llama-cpp-context4096-smollm2-packed-q4_1-zen4.json": dict(at="3d20feb", host="epyc-zen4", date="2026-12-05"),
    "vs-llama-cpp-context8064-smollm2-zen4.json": dict(at="93c4142", host="epyc-zen4", date="2026-12-05"),
    "vs-llama-cpp-chat-qwen15-hugepages-zen4.json": dict(at="a9a65a8", host="epyc-zen4", date="2026-12-05"),
    "vs-llama-cpp-context4096-8streams-smollm2-no-prefetch-zen4.json": dict(at="92bae34", host="epyc-zen4", date="2026-12-05"),
    "vs-llama-cpp-context4096-8streams-qwen05-avx512-attention-zen4.json": dict(at="a858489", host="epyc-zen4", date="2026-12-05"),
    "vs-llama-cpp-context4096-8streams-zen4.json": dict(at="a1d704d", host="epyc-zen4", date="2026-12-05"),
    "vs-llama-cpp-context4096-8streams-qwen05-zen4.json": dict(at="a9a65a8", host="epyc-zen4", date="2026-12-05"),
    "vs-llama-cpp-context16384-8streams-qwen05-zen4.json": dict(at="91d0339", host="epyc-zen4", date="2026-12-05"),
    "vs-llama-cpp-context16384-8streams-qwen15-zen4.json": dict(at="b80898d", host="epyc-zen4", date="2026-12-05"),
    "vs-llama-cpp-gemma3-270m-zen4.json": dict(at="2e359ee", host="epyc-zen4", date="2026-12-04"),
    "vs-llama-cpp-gemma3-270m-4k-zen4.json": dict(at="2e359ee", host="epyc-zen4", date="2026-12-04"),
    "vs-peers-qwen15-chat-xeon-spr.json": dict(at="a61c55d", host="xeon", date="2026-12-05"),
    "vs-peers-synth-llama8b-xeon-spr.json": dict(at="a61c55d", host="xeon", date="2026-12-05"),
    "vs-peers-qwen15-chat-canonical-xeon-spr.json": dict(at="d3ba830", host="xeon", date="2026-12-05"),
    "modes-canonical-vs-invariant-xeon-spr-quantize.json": dict(at="a3212ac", host="xeon", date="2026-12-05"),
    "modes-canonical-vs-invariant-xeon-spr.json": dict(at="a970809", host="xeon", date="2026-12-05"),
    "modes-canonical-vs-invariant-synth-llama8b-xeon-spr.json": dict(at="a61c55d", host="xeon", date="2026-12-05"),
    "ab-session-start-vs-4870004-smollm2-135m-instruct-q4_1-xeon-spr.json": dict(at="4870004", before="177bcc5", host="xeon", date="2026-12-05"),
    "ab-session-start-vs-4870004-qwen2.5-coder-0.5b-instruct-q4_k_m-xeon-spr.json": dict(at="4870004", before="177bcc5", host="xeon", date="2026-12-05"),
    "ab-session-start-vs-4870004-qwen2.5-coder-0.5b-instruct-q4_k_m-c1-xeon-spr.json": dict(at="4870004", before="177bcc5", host="xeon", date="2026-12-05"),
    "ab-session-start-vs-4870004-qwen2.5-coder-1.5b-instruct-q4_k_m-xeon-spr.json": dict(at="4870004", before="177bcc5", host="xeon", date="2026-12-05"),
    "ab-session-start-vs-4870004-gemma-3-270m-q4_k_m-xeon-spr.json": dict(at="4870004", before="177bcc5", host="xeon", date="2026-12-05"),
    "ab-context4096-no-prefetch-smollm2-zen4.json": dict(at="92bae34", before="a1d704d", host="epyc-zen4", date="2026-12-05"),
    "ab-context4096-no-prefetch-qwen2.5-coder-0.5b-zen4.json": dict(at="92bae34", before="a1d704d", host="epyc-zen4", date="2026-12-05"),
    "ab-context4096-no-prefetch-qwen2.5-coder-1.5b-zen4.json": dict(at="92bae34", before="a1d704d", host="epyc-zen4", date="2026-12-05"),
    "ab-q8_0-one-column-smollm2-zen4.json": dict(at="fe98c82", before="8dedbe6", host="epyc-zen4", date="2026-12-05"),
    "ab-q8_0-one-column-qwen05-context4096-zen4.json": dict(at="fe98c82", before="8dedbe6", host="epyc-zen4", date="2026-12-05"),
    "ab-q8_0-avx512-attention-smollm2-zen4.json": dict(at="7c440f3", before="8dedbe6", host="epyc-zen4", date="2026-12-05"),
    "ab-q8_0-avx512-attention-smollm2-context4096-zen4.json": dict(at="7c440f3", before="8dedbe6", host="epyc-zen4", date="2026-12-05"),
    "ab-q8_0-avx512-attention-qwen05-context4096-zen4.json": dict(at="7c440f3", before="8dedbe6", host="epyc-zen4", date="2026-12-05"),
    "ab-q8_0-avx512-attention-qwen15-zen4.json": dict(at="7c440f3", before="8dedbe6", host="epyc-zen4", date="2026-12-05"),
    "ab-q8_0-scales-gemma-3-270m-q4_k_m-zen4.json": dict(added="5296f70", before="d10aedb", host="epyc-zen4", date="2026-12-04"),
    "ab-q8_0-scales-smollm2-135m-instruct-q4_1-zen4.json": dict(added="5296f70", before="d10aedb", host="epyc-zen4", date="2026-12-04"),
    "ab-q8_0-scales-qwen2.5-coder-0.5b-instruct-q4_k_m-zen4.json": dict(added="5296f70", before="d10aedb", host="epyc-zen4", date="2026-12-04"),
    "ab-issue31-qwen05-zen4.json": dict(added="5ec31a1", before="218487e", host="epyc-zen4", date="2026-12-04"),
    "ab-issue31-smollm2-zen4.json": dict(added="5ec31a1", before="218487e", host="epyc-zen4", date="2026-12-04"),
    **{f"ab-issue51-{m}-zen4.json": dict(at="78dd3b7", before="73deae7", host="epyc-zen4", date="2026-12-06")
       for m in ("smollm2", "qwen05", "qwen15", "gemma")},
    **{f"ab-issue51-{m}-reversed-zen4.json": dict(at="73deae7", before="78dd3b7", host="epyc-zen4", date="2026-12-06")
       for m in ("smollm2", "qwen15")},
    "ab-packed-smol-4k-zen4.json": dict(at="3d20feb", before="b80898d", host="epyc-zen4", date="2026-12-05"),
    "ab-packed-smol-chat-zen4.json": dict(at="3d20feb", before="b80898d", host="epyc-zen4", date="2026-12-05"),
    "ab-packed-q05-4k-zen4.json": dict(at="3d20feb", before="b80898d", host="epyc-zen4", date="2026-12-05"),
    "ab-packed-q05-chat-zen4.json": dict(at="3d20feb", before="b80898d", host="epyc-zen4", date="2026-12-05"),
    "ab-packed-q15-chat-zen4.json": dict(at="3d20feb", before="b80898d", host="epyc-zen4", date="2026-12-05"),
    "speculative-qwen15-zen4.json": dict(at="0cbe7e4", host="epyc-zen4", date="2026-12-04"),
    "speculative-draft-qwen15-zen4.json": dict(at="52e1ae0", host="epyc-zen4", date="2026-12-04"),
    "speculative-ngram-longest-qwen15-zen4.json": dict(at="802d79e", host="epyc-zen4", date="2026-12-04"),
    "speculative-ngram-longest-k5-12-qwen15-zen4.json": dict(added="1f4ad12", host="epyc-zen4", date="2026-12-04"),
    "speculative-draft-completion-packed-qwen15-zen4.json": dict(added="e969bfb", host="epyc-zen4", date="2026-12-04"),
    "ab-draft-kquant-qwen15-zen4.json": dict(added="3421453", before="996ca2a", host="epyc-zen4", date="2026-12-04"),
    "ab-draft-kquant-qwen05-zen4.json": dict(added="3421453", before="996ca2a", host="epyc-zen4", date="2026-12-04"),
    "ray-serve-overhead-smollm2-zen4.json": dict(at="a984ac9", host="epyc-zen4", date="2026-12-04"),
    "ray-serve-overhead-settings-smollm2-zen4.json": dict(added="84be7dc", host="epyc-zen4", date="2026-12-04"),
    "ray-serve-overhead-interval-smollm2-zen4.json": dict(added="2353f39", host="epyc-zen4", date="2026-12-04"),
    "ray-serve-overhead-qwen05-zen4.json": dict(added="79fc1a8", host="epyc-zen4", date="2026-12-05"),
    "ray-serve-overhead-qwen15-zen4.json": dict(added="79fc1a8", host="epyc-zen4", date="2026-12-05"),
    "ray-serve-overhead-1thread-qwen05-zen4.json": dict(added="728ab52", host="epyc-zen4", date="2026-12-05"),
    "ray-serve-overhead-1thread-smollm2-zen4.json": dict(added="728ab52", host="epyc-zen4", date="2026-12-05"),
    "ray-serve-overhead-server-itl-qwen05-zen4.json": dict(added="79fc1a8", host="epyc-zen4", date="2026-12-05"),
    "ray-serve-overhead-control-loop-qwen05-zen4.json": dict(added="79fc1a8", host="epyc-zen4", date="2026-12-05"),
    "ray-serve-idle-smollm2-zen4.json": dict(added="79fc1a8", host="epyc-zen4", date="2026-12-05"),
    "ray-serve-routing-smollm2-zen4.json": dict(added="ac01b6c", host="epyc-zen4", date="2026-12-04"),
    "cuda-check-h200-v1.json": dict(at="2fd138f", host="h200", date="2026-12-04"),
    "prefix-cache-qwen05-zen4.json": dict(at="cf678bd", host="epyc-zen4", date="2026-12-04"),
    "prefix-cache-system-qwen05-zen4.json": dict(at="6c3faff", host="epyc-zen4", date="2026-12-04"),
    "kv-dtype-agreement-smollm2-zen4.json": dict(at="6c94361", host="epyc-zen4", date="2026-12-03"),
    "kv-dtype-agreement-qwen05-zen4.json": dict(at="6c94361", host="epyc-zen4", date="2026-12-03"),
    "serve-load-smollm2.json": dict(at="7f95bf3", host="epyc", date="2026-12-01"),
    "probe-split_k_f16-off-heldout24x128.json": dict(added="0cfaea6", host="epyc", date="2026-12-01"),
    "probe-split_k_f16-gated-heldout24x128.json": dict(added="c034de4", host="epyc", date="2026-12-01"),
    "probe-split_k_f16-gated-sampled-heldout24x128.json": dict(added="df8abfa", host="epyc", date="2026-12-01"),
    "endpoint-probe-qwen05.json": dict(added="92c943a", host="epyc"),
    "endpoint-probe-qwen05-gated.json": dict(added="92c943a", host="epyc"),
    "endpoint-probe-qwen05-llamacpp.json": dict(added="92c943a", host="epyc"),
    # Not under benches/results: the measured profile the package ships (it records its host and date).
    "python/candle_gate/profiles/cpu.json": dict(),
}

MODELS = {
    "smollm2-135m-instruct-q4_1": "SmolLM2-135M Q4_1",
    "qwen2.5-coder-0.5b-instruct-q4_k_m": "Qwen2.5-Coder-0.5B Q4_K_M",
    "qwen2.5-coder-1.5b-instruct-q4_k_m": "Qwen2.5-Coder-1.5B Q4_K_M",
    "gemma-3-270m-q4_k_m": "Gemma 3 270M Q4_K_M (base)",
    "/tmp/llama8b-shapes.gguf": "Llama-3.1-8B shapes, Q4_K_M mix (random weights)",
    "/tmp/synth-llama8b.gguf": "Llama-3.1-8B shapes, Q4_K_M mix (random weights)",
}


class RenderError(Exception):
    pass


# ---------------------------------------------------------------- formatting


def f1(x: float) -> str:
    return f"{x:.1f}"


def f2(x: float) -> str:
    return f"{x:.2f}"


def f3(x: float) -> str:
    return f"{x:.3f}"


def g3(x: float) -> str:
    """Three significant figures, whole numbers from 100 up: 1265, 320, 66.7, 4.72."""
    if abs(x) >= 100:
        return f"{x:.0f}"
    if abs(x) >= 10:
        return f"{x:.1f}"
    return f"{x:.2f}"


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x"


def pct(x: float, digits: int = 0) -> str:
    return f"{100 * x:.{digits}f}%"


def ms(seconds: float, digits: int = 1) -> str:
    return f"{1000 * seconds:.{digits}f} ms"


def secs(seconds: float, digits: int = 2) -> str:
    return f"{seconds:.{digits}f} s"


def vs(a: float, b: float, fmt=f1) -> str:
    """`a vs b (a/b)`."""
    return f"{fmt(a)} vs {fmt(b)} ({ratio(a, b)})"


def arrow(before: float, after: float, fmt=f1) -> str:
    return f"{fmt(before)} → {fmt(after)} ({ratio(after, before)})"


def thousands(n: int) -> str:
    return f"{n:,}"


def context_label(ctx) -> str:
    return "chat" if not ctx else f"{ctx:,}"


def model_name(key: str) -> str:
    return MODELS.get(key, key)


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        if len(r) != len(header):
            raise RenderError(f"row {r!r} has {len(r)} cells, header {len(header)}")
        out.append("| " + " | ".join(r) + " |")
    return out


def grouped(rows: list[list[str]]) -> list[list[str]]:
    """Blank a row's first cell where it repeats the row above (the tables' model grouping)."""
    out, last = [], None
    for r in rows:
        out.append(([""] if r[0] == last else [r[0]]) + r[1:])
        last = r[0]
    return out


def median(xs):
    return statistics.median(xs)


# ---------------------------------------------------------------- result files


class Results:
    """The result files, read once each, and where each was measured."""

    def __init__(self, root: Path, files: dict | None = None, provenance: dict | None = None):
        self.root = Path(root)
        self._files = files  # name -> parsed JSON (tests), or None to read from disk
        self._cache: dict = {}
        self.provenance = PROVENANCE if provenance is None else provenance

    def path(self, name: str) -> str:
        return name if "/" in name else f"{RESULTS}/{name}"

    def __call__(self, name: str):
        if name not in self._cache:
            if self._files is not None:
                if name not in self._files:
                    raise RenderError(f"no result file {name}")
                self._cache[name] = self._files[name]
            else:
                p = self.root / self.path(name)
                if not p.is_file():
                    raise RenderError(f"no result file {self.path(name)}")
                self._cache[name] = json.loads(p.read_text())
        return self._cache[name]

    def where(self, name: str) -> tuple[str, bool]:
        """`commit, host, date` of one file, and whether any of it is not recorded in the file."""
        data = self(name)
        rec = data if isinstance(data, dict) else {}
        prov = self.provenance.get(name)
        if prov is None and all(isinstance(rec.get(k), str) for k in ("commit", "host", "date")):
            # Written by a bench that records where it ran (benches/provenance.py).
            against = f" against {rec['before_build']}" if rec.get("before_build") else ""
            return f"at {rec['commit']}{against}, on {rec['host']}, {rec['date'][:10]}", False
        if prov is None:
            raise RenderError(f"{name}: no PROVENANCE entry and the file does not record where it ran")
        told = False
        parts = []
        if rec.get("commit"):
            parts.append(f"at {rec['commit']}")
        elif prov.get("at"):
            parts.append(f"at {prov['at']}" + (f" against {prov['before']}" if prov.get("before") else ""))
            told = True
        elif prov.get("added"):
            parts.append(f"added in {prov['added']}" + (f", against {prov['before']}" if prov.get("before") else ""))
            told = True
        host = None
        if isinstance(rec.get("host"), str):
            host = rec["host"]
        if prov.get("host"):
            # The files that name their host name only its CPU model; the host's key says which
            # of the development machines it was.
            host = HOSTS[prov["host"]] if host is None else f"{HOSTS[prov['host']]}, “{host}”"
            told = told or not isinstance(rec.get("host"), str)
        if host:
            parts.append(f"on {host}")
        date = rec.get("date") or rec.get("created") or rec.get("started")
        if date:
            parts.append(str(date)[:10])
        elif prov.get("date"):
            parts.append(prov["date"])
            told = True
        return ", ".join(parts), told

    def source(self, names: list[str], doc: str) -> str:
        """The `Source:` line under a table: each file linked from `doc`, with where it ran."""
        groups: dict[str, list[str]] = {}  # files measured at the same commit, host and date share one note
        for name in dict.fromkeys(names):
            where, told = self.where(name)
            rel = os.path.relpath(self.path(name), os.path.dirname(doc) or ".")
            base = name.rsplit("/", 1)[-1]
            groups.setdefault(f"{where}{'†' if told else ''}", []).append(f"[`{base}`]({rel})")
        items = [f"{', '.join(files)} ({where})" for where, files in groups.items()]
        return ("Sources: " if len(names) > 1 else "Source: ") + "; ".join(items) + "."


# ---------------------------------------------------------------- vs_llama_cpp.py tables


def vs_row(data: dict, model: str, streams: int, context=None) -> dict:
    for r in data["rows"]:
        if r["model"] == model and r["streams"] == streams and (r.get("context") or None) == (context or None):
            return r
    raise RenderError(f"no row model={model} streams={streams} context={context}")


def peer_cell(r: dict, metric: str, fmt=f1, peers=("llama_cpp",), suspect=()) -> str:
    """`candle-gate vs peer (ratio)[ vs peer (ratio)]` for one metric of one row."""
    cg = r["candle_gate"][metric]
    out = fmt(cg)
    for p in peers:
        v = r[p][metric]
        if (r["model"], p, metric) in suspect:
            out += f" vs {fmt(v)}‡"
        else:
            out += f" vs {fmt(v)} ({ratio(cg, v)})"
    return out


def short_prompt_table(res: Results, doc: str, name: str) -> list[str]:
    d = res(name)
    rows = []
    for model in dict.fromkeys(r["model"] for r in d["rows"]):
        one, eight = vs_row(d, model, 1), vs_row(d, model, 8)
        rows.append([
            model_name(model),
            peer_cell(one, "prefill_tok_s"),
            peer_cell(one, "decode_tok_s"),
            peer_cell(eight, "decode_tok_s"),
            pct(one["bandwidth_share"]),
        ])
    header = ["model", "prefill, 1 stream", "decode, 1 stream", "decode, 8 streams",
              "decode at % of the bandwidth limit"]
    return table(header, rows) + ["", f"Read bandwidth {d['read_bandwidth_gbs']:.1f} GB/s (two threads, the best read in the run). "
                                  + res.source([name], doc)]


def t_vs_llama_cpp_zen1(res, doc):
    return short_prompt_table(res, doc, "vs-llama-cpp.json")


def t_vs_llama_cpp_xeon(res, doc):
    return short_prompt_table(res, doc, "vs-llama-cpp-xeon.json")


def t_vs_llama_cpp_zen3(res, doc):
    return short_prompt_table(res, doc, "vs-llama-cpp-epyc-zen3.json")


def t_long_context_zen4(res, doc):
    files = ["vs-llama-cpp-context-smollm2-zen4.json", "vs-llama-cpp-context-qwen05-zen4.json",
             "vs-llama-cpp-context-qwen15-zen4.json"]
    eight = res("vs-llama-cpp-context1024-8streams-zen4.json")
    rows = []
    for f in files:
        for r in res(f)["rows"]:
            try:
                e = peer_cell(vs_row(eight, r["model"], 8, r["context"]), "decode_tok_s")
            except RenderError:
                e = ""
            rows.append([model_name(r["model"]), context_label(r["context"]), peer_cell(r, "prefill_tok_s"),
                         peer_cell(r, "decode_tok_s"), e, pct(r["bandwidth_share"])])
    header = ["model", "context", "prefill", "decode, 1 stream", "decode, 8 streams",
              "decode at % of the limit (weights + K/V)"]
    bw = [res(f)["read_bandwidth_gbs"] for f in files]
    return table(header, grouped(rows)) + ["", f"Best read bandwidth per run {min(bw):.1f}–{max(bw):.1f} GB/s. "
                                           + res.source(files + ["vs-llama-cpp-context1024-8streams-zen4.json"], doc)]


def share_cell(row) -> str:
    """Decode's share of the read bandwidth: over the run's best reading, then (where the file
    has them) over the reading just before each round, the lowest and highest."""
    paired = row.get("bandwidth_share_paired") or []
    if not paired:
        return pct(row["bandwidth_share"])
    low, high = pct(min(paired)), pct(max(paired))
    return f"{pct(row['bandwidth_share'])} ({low if low == high else f'{low}–{high}'} paired)"


def share_rounds_cell(row) -> str:
    """`share_cell` with every round's paired share, in the order the rounds ran."""
    rounds = row.get("bandwidth_share_paired") or []
    return pct(row["bandwidth_share"]) + (f" ({', '.join(pct(x) for x in rounds)} paired)" if rounds else "")


def headline_rows(res: Results, chat: str, long: str, peers, suspect):
    c, l = res(chat), res(long)
    rows = []
    for model in dict.fromkeys(r["model"] for r in c["rows"]):
        one, eight = vs_row(c, model, 1), vs_row(c, model, 8)
        rows.append([model_name(model), "chat", peer_cell(one, "prefill_tok_s", g3, peers, suspect),
                     peer_cell(one, "decode_tok_s", g3, peers, suspect), share_cell(one),
                     peer_cell(eight, "decode_tok_s", g3, peers, suspect)])
        lr = vs_row(l, model, 1, 4096)
        rows.append([model_name(model), "4,096", peer_cell(lr, "prefill_tok_s", g3, peers, suspect),
                     peer_cell(lr, "decode_tok_s", g3, peers, suspect), share_cell(lr), ""])
    return grouped(rows)


# ik_llama.cpp 0.1.5's SmolLM2 prefill computes wrong logits (docs/BENCHMARKS.md, "Headline"):
# its rate is shown, its ratio is not.
HEADLINE_SUSPECT = {("smollm2-135m-instruct-q4_1", "ik_llama_cpp", "prefill_tok_s")}


# The README's one headline table: one commit, one host, one date.
HEADLINE = ("headline-chat-zen4-8bd30fc.json", "headline-4096-zen4-8bd30fc.json")


def headline_table(res, doc, chat: str, long: str) -> list[str]:
    rows = headline_rows(res, chat, long, ("llama_cpp", "ik_llama_cpp"), HEADLINE_SUSPECT)
    header = ["model", "prompt", "prefill", "decode, 1 stream", "its share of the read bandwidth", "decode, 8 streams"]
    c, l = res(chat), res(long)
    # One commit, one host: the headline's rule (a session may cross midnight UTC, so the
    # dates may be two). Say which, above the table.
    where = {res.where(chat)[0].rsplit(", ", 1)[0], res.where(long)[0].rsplit(", ", 1)[0]}
    if len(where) != 1:
        raise RenderError(f"the headline's files were measured at different commits or hosts: {sorted(where)}")
    dates = " and ".join(sorted({res.where(n)[0].rsplit(", ", 1)[1] for n in (chat, long)}))
    return [f"**Measured {where.pop()}, {dates}.**", ""] + table(header, rows) + [
        "",
        "tok/s: candle-gate vs llama.cpp (ratio) vs ik_llama.cpp (ratio); ‡ ik_llama.cpp's SmolLM2 "
        f"prefill computes wrong logits, so it gets no ratio. The share: candle-gate's best single-stream decode "
        f"(weights and K/V read per token) over the best read bandwidth of its run, {c['read_bandwidth_gbs']:.1f} GB/s (chat) "
        f"and {l['read_bandwidth_gbs']:.1f} GB/s (4,096), which moves by a third within an hour on these hosts; "
        f"paired: each round's decode over the bandwidth read just before it; "
        f"{c['threads']} threads each; ik-llama-cpp-python "
        f"{c['ik_llama_cpp_version']}. " + res.source([chat, long], doc),
    ]


def t_headline(res, doc):
    return headline_table(res, doc, *HEADLINE)


def t_headline_xeon(res, doc):
    return headline_table(res, doc, "headline-chat-xeon-e8f6187.json", "headline-4096-xeon-e8f6187.json")


def t_headline_xeon_d7eae0c(res, doc):
    return headline_table(res, doc, "headline-chat-xeon-d7eae0c.json", "headline-4096-xeon-d7eae0c.json")


def t_headline_xeon_4870004(res, doc):
    return headline_table(res, doc, "headline-chat-xeon-spr-4870004.json", "headline-4096-xeon-spr-4870004.json")


def t_headline_zen3(res, doc):
    return headline_table(res, doc, "headline-chat-zen3-85d0042.json", "headline-4096-zen3-85d0042.json")


def t_headline_zen2(res, doc):
    return headline_table(res, doc, "headline-chat-zen2-ff93b01.json", "headline-4096-zen2-ff93b01.json")


def t_headline_zen2_7fdca56(res, doc):
    return headline_table(res, doc, "headline-chat-zen2-7fdca56.json", "headline-4096-zen2-7fdca56.json")


def t_step_costs_zen2(res, doc, name="step-costs-zen2-dbc91bc.json"):
    """benches/step_costs.rs: a decode step against the same step without its matmuls."""
    d = res(name)
    rows = [[model_name(r["model"]), f"{r['bytes_per_token'] / 1e6:.0f}", f"{r['step_ms']:.2f}",
             f"{r['without_matmuls_ms']:.2f} ({pct(r['without_matmuls_ms'] / r['step_ms'])})", f"{r['matmul_ms']:.2f}",
             f"{r['matmul_read_gbs']:.1f} ({pct(r['matmul_read_gbs'] / r['read_bandwidth_gbs'])})",
             f"{r['read_bandwidth_gbs']:.1f}"] for r in d["rows"]]
    header = ["model", "MB read per token", "step, ms", "without its matmuls, ms (share)", "matmuls, ms",
              "matmuls' read, GB/s (of the bandwidth)", "read bandwidth, GB/s"]
    return table(header, rows) + [
        "", f"One stream, `invariant` mode, the {d['tier']} tier, {d['tokens']} tokens after a short prompt, "
        f"the best of {d['rounds']} alternating rounds of each kind; the bandwidth is a parallel sum over 1 GiB "
        "on the same pool, read after each model's rounds. " + res.source([name], doc)]


def t_zen4_latest(res, doc):
    cells = [
        ("smollm2-135m-instruct-q4_1", 1024, "vs-llama-cpp-context-smollm2-zen4.json"),
        ("smollm2-135m-instruct-q4_1", 4096, "vs-llama-cpp-context4096-smollm2-packed-q4_1-zen4.json"),
        ("smollm2-135m-instruct-q4_1", 8064, "vs-llama-cpp-context8064-smollm2-zen4.json"),
        ("qwen2.5-coder-0.5b-instruct-q4_k_m", 1024, "vs-llama-cpp-context-qwen05-zen4.json"),
        ("qwen2.5-coder-0.5b-instruct-q4_k_m", 4096, "vs-llama-cpp-context4096-q8_0-avx512-attention-zen4.json"),
        ("qwen2.5-coder-0.5b-instruct-q4_k_m", 16384, "vs-llama-cpp-context16384-qwen05-avx512-attention-zen4.json"),
        ("qwen2.5-coder-1.5b-instruct-q4_k_m", None, "vs-llama-cpp-chat-qwen15-hugepages-zen4.json"),
        ("qwen2.5-coder-1.5b-instruct-q4_k_m", 4096, "vs-llama-cpp-context4096-qwen15-avx512-attention-zen4.json"),
        ("qwen2.5-coder-1.5b-instruct-q4_k_m", 16384, "vs-llama-cpp-context16384-qwen15-zen4.json"),
        ("gemma-3-270m-q4_k_m", None, "vs-llama-cpp-gemma3-270m-zen4.json"),
        ("gemma-3-270m-q4_k_m", 4096, "vs-llama-cpp-gemma3-270m-4k-zen4.json"),
    ]
    rows = []
    for model, ctx, f in cells:
        r = vs_row(res(f), model, 1, ctx)
        rows.append([model_name(model), context_label(ctx), peer_cell(r, "prefill_tok_s", g3),
                     peer_cell(r, "decode_tok_s", g3), res.provenance[f]["at"]])
    header = ["model", "context", "prefill", "decode, 1 stream", "at"]
    return table(header, grouped(rows)) + ["", res.source(list(dict.fromkeys(f for _, _, f in cells)), doc)]


def t_eight_streams_zen4(res, doc):
    cells = [
        ("smollm2-135m-instruct-q4_1", 4096, "vs-llama-cpp-context4096-8streams-zen4.json"),
        ("smollm2-135m-instruct-q4_1", 4096, "vs-llama-cpp-context4096-8streams-smollm2-no-prefetch-zen4.json"),
        ("smollm2-135m-instruct-q4_1", 8064, "vs-llama-cpp-context8064-smollm2-zen4.json"),
        ("qwen2.5-coder-0.5b-instruct-q4_k_m", 4096, "vs-llama-cpp-context4096-8streams-qwen05-zen4.json"),
        ("qwen2.5-coder-0.5b-instruct-q4_k_m", 4096, "vs-llama-cpp-context4096-8streams-qwen05-avx512-attention-zen4.json"),
        ("qwen2.5-coder-0.5b-instruct-q4_k_m", 16384, "vs-llama-cpp-context16384-8streams-qwen05-zen4.json"),
        ("qwen2.5-coder-1.5b-instruct-q4_k_m", 4096, "vs-llama-cpp-context4096-8streams-zen4.json"),
        ("qwen2.5-coder-1.5b-instruct-q4_k_m", 16384, "vs-llama-cpp-context16384-8streams-qwen15-zen4.json"),
    ]
    rows = []
    for model, ctx, f in cells:
        r = vs_row(res(f), model, 8, ctx)
        rows.append([model_name(model), context_label(ctx), peer_cell(r, "decode_tok_s"),
                     res.provenance[f]["at"]])
    header = ["model", "context", "decode, 8 streams", "at"]
    return table(header, grouped(rows)) + ["", res.source(list(dict.fromkeys(f for _, _, f in cells)), doc)]


def vs_table(res, doc, files):
    """One row per single-stream row of each file (model, context), its 8-stream decode beside it
    where the file has one, and the share of the bandwidth limit (and each round's, paired with
    the reading just before it)."""
    rows, eight_any, bws = [], False, []
    for name in files:
        d = res(name)
        bws.append(d["read_bandwidth_gbs"])
        for r in d["rows"]:
            if r["streams"] != 1:
                continue
            try:
                eight = peer_cell(vs_row(d, r["model"], 8, r.get("context")), "decode_tok_s")
                eight_any = True
            except RenderError:
                eight = ""
            rounds = r.get("bandwidth_share_paired") or []
            paired = " and ".join(pct(x) for x in rounds) if len(rounds) > 1 else ""
            rows.append([model_name(r["model"]), context_label(r.get("context")), peer_cell(r, "prefill_tok_s"),
                         peer_cell(r, "decode_tok_s"), eight,
                         pct(r["bandwidth_share"]) + (f" ({paired} paired)" if paired else "")])
    header = ["model", "context", "prefill", "decode, 1 stream", "decode, 8 streams",
              "decode at % of the limit (weights + K/V)"]
    if not eight_any:
        header.pop(4)
        rows = [r[:4] + r[5:] for r in rows]
    rows = grouped(rows)
    bw = f"{bws[0]:.1f} GB/s" if len(set(bws)) == 1 else " and ".join(f"{b:.1f}" for b in bws) + " GB/s"
    return table(header, rows) + ["", f"tok/s, candle-gate vs llama.cpp (its better of flash attention off and on "
                                  f"at long contexts). Best read bandwidth in the run{'s' if len(bws) > 1 else ''} "
                                  f"{bw}; paired: against the reading just before each round. "
                                  + res.source(files, doc)]


def t_grouped_attention_vs_llama_cpp(res, doc):
    return vs_table(res, doc, ["vs-llama-cpp-context4096-grouped-attention-zen4.json"])


def t_q8_0_avx512_vs_llama_cpp(res, doc):
    return vs_table(res, doc, ["vs-llama-cpp-context4096-q8_0-avx512-attention-zen4.json"])


def t_long_context_2rounds(res, doc):
    return vs_table(res, doc, ["vs-llama-cpp-context4096-qwen05-2rounds-zen4.json",
                               "vs-llama-cpp-context4096-qwen15-2rounds-zen4.json"])


def t_kquant_vs_llama_cpp(res, doc):
    return vs_table(res, doc, ["vs-llama-cpp-context-qwen15-kquant-zen4.json"])


def t_packed_q4_k_vs_llama_cpp(res, doc):
    return vs_table(res, doc, ["vs-llama-cpp-chat-qwen15-packed-zen4.json",
                               "vs-llama-cpp-context4096-qwen15-packed-zen4.json"])


def t_no_prefetch_vs_llama_cpp(res, doc):
    return vs_table(res, doc, ["vs-llama-cpp-context4096-no-prefetch-zen4.json"])


def t_avx512_attention_vs_llama_cpp(res, doc):
    return vs_table(res, doc, ["vs-llama-cpp-context4096-qwen15-avx512-attention-zen4.json",
                               "vs-llama-cpp-context16384-qwen05-avx512-attention-zen4.json"])


def t_packed_q4_1_vs_llama_cpp(res, doc):
    return vs_table(res, doc, ["vs-llama-cpp-context4096-smollm2-packed-q4_1-zen4.json"])


def t_huge_pages_vs_llama_cpp(res, doc):
    return vs_table(res, doc, ["vs-llama-cpp-chat-qwen15-hugepages-zen4.json",
                               "vs-llama-cpp-context4096-qwen05-grouped-attention-zen4.json"])


def t_gemma_vs_llama_cpp(res, doc):
    files = ["vs-llama-cpp-gemma3-270m-zen4.json", "vs-llama-cpp-gemma3-270m-4k-zen4.json"]
    rows = []
    for f in files:
        d = res(f)
        for r in d["rows"]:
            if r["streams"] != 1:
                continue
            e = vs_row(d, r["model"], 8, r.get("context"))
            rows.append([context_label(r.get("context")), peer_cell(r, "prefill_tok_s", g3),
                         peer_cell(r, "decode_tok_s"), peer_cell(e, "decode_tok_s", g3)])
    header = ["context", "prefill, 1 stream", "decode, 1 stream", "decode, 8 streams"]
    return table(header, rows) + ["", res.source(files, doc)]


# ---------------------------------------------------------------- modes.py and the peers on the Xeon


def modes_rows(res, name, prefill_note=""):
    d = res(name)
    rows = []
    for model, m in d["models"].items():
        c, i = m["canonical"], m["invariant"]
        rows.append([model_name(model), vs(c["decode_1"], i["decode_1"], g3), vs(c["decode_8"], i["decode_8"], g3),
                     vs(c["prefill"], i["prefill"], g3)[:-1] + prefill_note + ")"])
    return rows


MODES_HEADER = ["model", "decode, 1 stream", "decode, 8 streams", "prefill, 1,024 tokens"]


def modes_table(res, doc, name: str) -> list[str]:
    """One `modes.py --json` file: `canonical` against `invariant`, model by model."""
    return table(MODES_HEADER, modes_rows(res, name)) + ["", "tok/s, `canonical` vs `invariant` (ratio). " + res.source([name], doc)]


def t_canonical_quantize(res, doc):
    return modes_table(res, doc, "modes-canonical-vs-invariant-xeon-spr-quantize.json")


def t_canonical_scalar(res, doc):
    a, b = "modes-canonical-vs-invariant-xeon-spr.json", "modes-canonical-vs-invariant-synth-llama8b-xeon-spr.json"
    rows = modes_rows(res, a) + modes_rows(res, b, ", 256 tokens")
    return table(MODES_HEADER, rows) + ["", "tok/s, `canonical` vs `invariant` (ratio). " + res.source([a, b], doc)]


def t_peers(res, doc):
    files = ["vs-peers-qwen15-chat-xeon-spr.json", "vs-peers-synth-llama8b-xeon-spr.json"]
    rows = []
    for f in files:
        d = res(f)
        for streams, metric in ((1, "prefill_tok_s"), (1, "decode_tok_s"), (8, "decode_tok_s")):
            r = vs_row(d, d["rows"][0]["model"], streams, None)
            cg = r["candle_gate"][metric]
            cells = [g3(cg)] + [f"{g3(r[p][metric])} ({ratio(cg, r[p][metric])})" for p in ("llama_cpp", "ik_llama_cpp")]
            rows.append([model_name(r["model"]), "chat", str(streams), metric.split("_")[0]] + cells)
    header = ["model", "prompt", "streams", "metric", "candle-gate", "llama.cpp", "ik_llama.cpp"]
    out = []
    last = None
    for r in rows:  # blank the repeated model and prompt cells
        out.append((["", ""] if r[0] == last else r[:2]) + r[2:])
        last = r[0]
    return table(header, out) + ["", "tok/s, `invariant` mode. " + res.source(files, doc)]


def peers_qwen15_table(res, doc, chat: str, ctx: str, long: str = "", long_context: int = 4095) -> list[str]:
    """Qwen 1.5B, one stream, at chat length, 1k and 4k, against both peers (issue 50's goals):
    1k from `ctx`, 4k from `long` (default `ctx`) at `long_context` tokens."""
    model, peers = "qwen2.5-coder-1.5b-instruct-q4_k_m", ("llama_cpp", "ik_llama_cpp")
    long = long or ctx
    rows = []
    for name, context in ((chat, None), (ctx, 1023), (long, long_context)):
        r = vs_row(res(name), model, 1, context)
        rows.append([context_label(context), peer_cell(r, "prefill_tok_s", g3, peers),
                     peer_cell(r, "decode_tok_s", g3, peers), pct(r["bandwidth_share"])])
    eight = vs_row(res(chat), model, 8, None)
    rows.append(["chat, 8 streams", "", peer_cell(eight, "decode_tok_s", g3, peers), ""])
    header = ["prompt", "prefill", "decode", "decode's share of the read bandwidth"]
    files = list(dict.fromkeys((chat, ctx, long)))
    bw = ", ".join(f"{res(f)['read_bandwidth_gbs']:.1f} GB/s" for f in files)
    return table(header, rows) + ["", "Qwen2.5-Coder-1.5B Q4_K_M, tok/s: candle-gate (`invariant`) vs llama.cpp "
                                  f"(ratio) vs ik_llama.cpp (ratio), one stream unless said. Best read bandwidth {bw}. "
                                  + res.source(files, doc)]


def t_peers_qwen15_zen4(res, doc):
    return peers_qwen15_table(res, doc, "vs-peers-qwen15-chat-zen4.json", "vs-peers-qwen15-context-zen4.json")


def t_peers_qwen15_zen4_sixteen_packed(res, doc):
    return peers_qwen15_table(res, doc, "vs-peers-qwen15-chat-zen4-sixteen-packed.json",
                              "vs-peers-qwen15-context-zen4-sixteen-packed.json")


def peers_long_table(res, doc, name: str) -> list[str]:
    """One stream at a long prompt against both peers: each single-stream row of one file, with
    decode's share of the bandwidth limit, overall and round by round."""
    d, peers = res(name), ("llama_cpp", "ik_llama_cpp")
    rows = []
    for r in d["rows"]:
        if r["streams"] != 1:
            continue
        rows.append([model_name(r["model"]), context_label(r.get("context")), peer_cell(r, "prefill_tok_s", g3, peers),
                     peer_cell(r, "decode_tok_s", g3, peers), share_rounds_cell(r)])
    header = ["model", "prompt", "prefill", "decode, 1 stream", "decode at % of the limit (weights + K/V)"]
    return table(header, rows) + ["", f"tok/s: candle-gate (`invariant`) vs llama.cpp (ratio) vs ik_llama.cpp "
                                  f"(ratio), best of the rounds. Best read bandwidth "
                                  f"{d['read_bandwidth_gbs']:.1f} GB/s; paired: against the reading just before each "
                                  f"round. " + res.source([name], doc)]


def peers_rows_table(res, doc, names: list[str]) -> list[str]:
    """Every row of some `vs_llama_cpp.py` files against both peers, one stream or many: prefill
    where a row has it, decode, and one stream's share of the bandwidth, overall and paired."""
    peers, rows, bw = ("llama_cpp", "ik_llama_cpp"), [], []
    for name in names:
        d = res(name)
        bw.append(f"{d['read_bandwidth_gbs']:.1f} GB/s")
        for r in d["rows"]:
            prefill = peer_cell(r, "prefill_tok_s", g3, peers) if "prefill_tok_s" in r["candle_gate"] else ""
            share = share_rounds_cell(r) if "bandwidth_share" in r else ""
            rows.append([model_name(r["model"]), context_label(r.get("context")), str(r["streams"]), prefill,
                         peer_cell(r, "decode_tok_s", g3, peers), share])
    header = ["model", "prompt", "streams", "prefill", "decode", "decode at % of the limit (weights + K/V)"]
    return table(header, rows) + ["", "tok/s: candle-gate (`invariant`) vs llama.cpp (ratio) vs ik_llama.cpp (ratio), "
                                  f"best of the rounds. Best read bandwidth {', '.join(bw)}; paired: against the "
                                  "reading just before each round. " + res.source(names, doc)]


def peers_synth8b_table(res, doc, name: str) -> list[str]:
    """The 8B-shaped file against both peers: issue 50's parity and 8-stream goals."""
    d, peers = res(name), ("llama_cpp", "ik_llama_cpp")
    one, eight = vs_row(d, d["rows"][0]["model"], 1), vs_row(d, d["rows"][0]["model"], 8)
    rows = [["prefill, 1 stream", peer_cell(one, "prefill_tok_s", g3, peers)],
            ["decode, 1 stream", peer_cell(one, "decode_tok_s", g3, peers)],
            ["decode, 8 streams", peer_cell(eight, "decode_tok_s", g3, peers)]]
    paired = ", ".join(pct(x) for x in one["bandwidth_share_paired"])
    return table(["chat prompts", "candle-gate vs llama.cpp (ratio) vs ik_llama.cpp (ratio)"], rows) + [
        "", f"`benches/synth_gguf.py`'s file (Llama-3.1-8B's shapes, Q4_K_M's mix, 4.47 GB), tok/s, `invariant` mode. "
            f"Single-stream decode at {pct(one['bandwidth_share'])} of the best read bandwidth "
            f"({d['read_bandwidth_gbs']:.1f} GB/s); each round against the bandwidth read just before it: {paired}. "
            + res.source([name], doc)]


def peers_canonical_table(res, doc, name: str) -> list[str]:
    """Qwen 1.5B in `canonical` mode against both peers: one stream's prefill and decode, and
    eight streams' decode where the file has them."""
    d = res(name)
    model = "qwen2.5-coder-1.5b-instruct-q4_k_m"
    r = vs_row(d, model, 1, None)
    peers = ("llama_cpp", "ik_llama_cpp")
    rows = [[model_name(model), "chat", "1", m.split("_")[0], peer_cell(r, m, g3, peers)]
            for m in ("prefill_tok_s", "decode_tok_s")]
    if any(x["model"] == model and x["streams"] == 8 for x in d["rows"]):
        rows.append([model_name(model), "chat", "8", "decode", peer_cell(vs_row(d, model, 8, None), "decode_tok_s", g3, peers)])
    header = ["model", "prompt", "streams", "metric", "candle-gate `canonical` vs llama.cpp vs ik_llama.cpp"]
    return table(header, grouped(rows)) + ["", f"One stream decodes at {pct(r['bandwidth_share'])} of the best bandwidth "
                                           f"read ({d['read_bandwidth_gbs']:.1f} GB/s). " + res.source([name], doc)]


# ---------------------------------------------------------------- ab_builds.py tables


def ab_cell(d: dict, concurrency: int) -> str:
    for r in d["rows"]:
        if r["concurrency"] == concurrency:
            return arrow(r["before"], r["after"])
    return ""


def ab_files(pattern: str, *models: str) -> list:
    """`ab_table` entries: one file a model, `pattern` with `{}` for the model."""
    return [(None, None, pattern.format(m)) for m in models]


def order_note(ds: list) -> str:
    """What the A/B files `ds` say of who ran first in a round (`ab_rounds.py`'s `--order`,
    recorded from 2026-12-06): said only where every file alternated."""
    return ", each build first in every other round" if all(d.get("order") == "alternate" for d in ds) else ""


def ab_table(res, doc, entries):
    """entries: (label, prompts label, file). One row a file: model, prompts, rounds, and each
    concurrency any of the files measured."""
    conc = sorted({r["concurrency"] for _, _, f in entries for r in res(f)["rows"]})
    rows = []
    for label, prompts, f in entries:
        d = res(f)
        rows.append([label or model_name(d["model"]), prompts or context_label(d.get("context")),
                     str(d["rounds"])] + [ab_cell(d, c) for c in conc])
    header = ["model", "prompts", "rounds"] + [f"{c} stream{'s' if c > 1 else ''}" for c in conc]
    note = "Decode tok/s, before → after (ratio), best of alternating rounds" + order_note([res(f) for _, _, f in entries])
    return table(header, grouped(rows)) + ["", note + ". " + res.source([f for _, _, f in entries], doc)]


def t_ab_session_start_xeon(res, doc):
    models = ["smollm2-135m-instruct-q4_1", "qwen2.5-coder-0.5b-instruct-q4_k_m",
              "qwen2.5-coder-0.5b-instruct-q4_k_m-c1", "qwen2.5-coder-1.5b-instruct-q4_k_m", "gemma-3-270m-q4_k_m"]
    return ab_table(res, doc, [(None, None, f"ab-session-start-vs-4870004-{m}-xeon-spr.json") for m in models])


def t_ab_q8_0_scales(res, doc):
    return ab_table(res, doc, [(None, None, f"ab-q8_0-scales-{m}-zen4.json") for m in
                               ("gemma-3-270m-q4_k_m", "smollm2-135m-instruct-q4_1", "qwen2.5-coder-0.5b-instruct-q4_k_m")])


def t_ab_issue31(res, doc):
    return ab_table(res, doc, [(None, None, f"ab-issue31-{m}-zen4.json") for m in ("qwen05", "smollm2")])


def ab_orders_table(res, doc, files, swapped, old: str, new: str, prompts: str) -> list[str]:
    """`old` → `new` in every row; in the `swapped` files the newer build ran first in each
    round (ab_builds' `--before`), so a bias of the order would show with the other sign."""
    conc = sorted({r["concurrency"] for f in files + swapped for r in res(f)["rows"]})
    rows = []
    for f in files + swapped:
        d = res(f)
        turn = (lambda r: (r["before"], r["after"])) if f in files else (lambda r: (r["after"], r["before"]))
        cells = {r["concurrency"]: arrow(*turn(r)) for r in d["rows"]}
        order = f"{old} first" if f in files else f"{new} first"
        rows.append([model_name(d["model"]), order, str(d["rounds"])] + [cells.get(c, "") for c in conc])
    header = ["model", "each round", "rounds"] + [f"{c} stream{'s' if c > 1 else ''}" for c in conc]
    note = f"Decode tok/s, {old} → {new} (ratio), best of alternating rounds, {prompts}. "
    return table(header, grouped(rows)) + ["", note + res.source(files + swapped, doc)]


def t_ab_issue51(res, doc):
    files = [f"ab-issue51-{m}-zen4.json" for m in ("smollm2", "qwen05", "qwen15", "gemma")]
    swapped = [f"ab-issue51-{m}-reversed-zen4.json" for m in ("smollm2", "qwen15")]
    return ab_orders_table(res, doc, files, swapped, "73deae7", "78dd3b7", "chat prompts")


def t_ab_sixteen_packed(res, doc):
    """Sums in registers and packed Q6_K (c8cc3ef) against 7ab3551, chat prompts."""
    files = [f"ab-sixteen-packed-{m}-zen4.json" for m in ("smollm2", "qwen05", "gemma", "qwen15", "synth8b")]
    swapped = ["ab-sixteen-packed-qwen15-reversed-zen4.json"]
    return ab_orders_table(res, doc, files, swapped, "7ab3551", "c8cc3ef", "chat prompts")


def ab_context_table(res, doc, names, old: str = "", new: str = "") -> list[str]:
    """`ab_builds.py --context N --json` files: prefill and decode at one stream (a file's rows at
    more streams are left out), `old` → `new` (by default the builds the first file records)."""
    old, new = old or res(names[0])["before_build"], new or res(names[0])["commit"]
    rows = []
    for name in names:
        d = res(name)
        rows += [[model_name(d["model"]), context_label(d["context"]), str(d["rounds"]), arrow(p["before"], p["after"]),
                  arrow(r["before"], r["after"])] for p, r in zip(d["prefill_rows"], d["rows"])
                 if r.get("concurrency", 1) == 1]
    return table(["model", "prompt", "rounds", "prefill, 1 stream", "decode, 1 stream"], rows) + [
        "", f"tok/s, {old} → {new} (ratio), best of alternating rounds. " + res.source(names, doc)]


def t_ab_sixteen_packed_context(res, doc):
    return ab_context_table(res, doc, ["ab-sixteen-packed-qwen15-context4096-zen4.json"], "7ab3551", "c8cc3ef")


def ab_ops_table(res, doc, name: str, tier: str = "") -> list[str]:
    """An `ab_ops.py --json` file: each elementwise step's ns per element, before → after."""
    d = res(name)
    rows = [[r["step"], f"{r['ns_before']:.2f} → {r['ns_after']:.2f} ({ratio(r['ns_before'], r['ns_after'])})"
             if r["ns_before"] is not None else f"{r['ns_after']:.2f} (no before)"] for r in d["results"]]
    return table(["step", "ns per element"], rows) + [
        "", f"`cargo bench --bench ops` through `benches/ab_ops.py`{tier}, {d['before']} → {d['commit']} (speedup), "
            f"best of {d['rounds']} alternating rounds. " + res.source([name], doc)]


def resident_memory_table(res, doc, old: str, new: str) -> list[str]:
    """Two `resident_memory.py --json` files: each model's resident memory and the part of it in
    huge pages, build `old` → build `new`."""
    a, b = res(old), res(new)
    mb = lambda x: f"{x / 1e6:,.0f}"
    rows = [[model_name(x["model"]), mb(x["file_bytes"]), f"{mb(x['rss_bytes'])} → {mb(y['rss_bytes'])}",
             f"{mb(x['huge_page_bytes'])} → {mb(y['huge_page_bytes'])}"]
            for x, y in zip(a["results"], b["results"])]
    return table(["model", "file, MB", "resident, MB", "of it in huge pages, MB"], rows) + [
        "", f"`benches/resident_memory.py`, build {a['build']} → {b['build']}. " + res.source([old, new], doc)]


def kernels_ab_rows(d) -> list[list[str]]:
    """An `ab_kernels.py --json` file's rows: matrix, rows, hot and cold, before → after."""
    return [[f"{r['dtype']} {r['n']} × {r['k']}", str(r["rows"]),
             f"{r['hot_ms_before']:.3f} → {r['hot_ms_after']:.3f} ({ratio(r['hot_ms_before'], r['hot_ms_after'])})",
             f"{r['cold_ms_before']:.3f} → {r['cold_ms_after']:.3f} ({ratio(r['cold_ms_before'], r['cold_ms_after'])})"]
            for r in d["results"]]


KERNELS_AB_HEADER = ["matrix (n × k)", "rows", "from the cache, ms", "every layer's matrix in turn, ms"]


def kernels_ab_table(res, doc, name: str, tier: str = "") -> list[str]:
    """An `ab_kernels.py --json` file: each (matrix, rows), hot and cold, before → after; `tier`
    names the kernel tier where the run capped it (`CANDLE_GATE_ISA`)."""
    d = res(name)
    return table(KERNELS_AB_HEADER, grouped(kernels_ab_rows(d))) + [
        "", f"`cargo bench --bench kernels` through `benches/ab_kernels.py`, {d.get('kernel', 'invariant')} kernel"
            f"{tier}, {d['before']} → "
            f"{d['commit']} (speedup), best of {d['rounds']} alternating rounds"
            f"{order_note([d])}. "
            + res.source([name], doc)]


def kernels_ab_models_table(res, doc, names: list[str]) -> list[str]:
    """Several `ab_kernels.py --json` files of one pair of builds, one model each: each model's
    (matrix, rows), hot and cold, before → after."""
    ds = [res(n) for n in names]
    rows = []
    for d in ds:
        args = d.get("bench_args", [])
        model = model_name(args[args.index("--model") + 1]) if "--model" in args else ""
        rows += [[model] + r for r in kernels_ab_rows(d)]
    d = ds[0]
    return table(["model"] + KERNELS_AB_HEADER, grouped(rows)) + [
        "", f"`cargo bench --bench kernels` through `benches/ab_kernels.py`, {d.get('kernel', 'invariant')} kernel, "
            f"{d['before']} → {d['commit']} (speedup), best of {d['rounds']} alternating rounds{order_note(ds)}. "
            + res.source(names, doc)]


def attention_ab_table(res, doc, name: str) -> list[str]:
    """An `ab_attention.py --json` file: each (model shape, context), a decode step's attention and
    a 512-row prefill chunk's, before → after, medians of the rounds."""
    d = res(name)
    rows = [[r["model"], f"{r['context']:,}", r["tier"],
             f"{r['decode_ms_before']:.3f} → {r['decode_ms_after']:.3f} ({ratio(r['decode_ms_before'], r['decode_ms_after'])})",
             f"{r['prefill_ms_before']:.1f} → {r['prefill_ms_after']:.1f} ({ratio(r['prefill_ms_before'], r['prefill_ms_after'])})"]
            for r in d["results"]]
    header = ["heads of", "context", "tier", "decode step, ms", "prefill 512 rows, ms"]
    return table(header, grouped(rows)) + [
        "", f"`cargo bench --bench attention` through `benches/ab_attention.py`, {d['before']} → {d['commit']} "
            f"(speedup), median of {d['rounds']} alternating rounds{order_note([d])}. " + res.source([name], doc)]


def t_ab_kernels_sixteen_packed(res, doc):
    return kernels_ab_table(res, doc, "ab-sixteen-packed-kernels-qwen15-zen4.json")


def t_ab_kernels_q6k_four_rows(res, doc):
    return kernels_ab_table(res, doc, "ab-q6k-four-rows-kernels-qwen15-zen4.json")


def t_ab_draft_kquant(res, doc):
    return ab_table(res, doc, [(None, None, f"ab-draft-kquant-{m}-zen4.json") for m in ("qwen15", "qwen05")])


def t_ab_no_prefetch(res, doc):
    return ab_table(res, doc, [(None, None, f"ab-context4096-no-prefetch-{m}-zen4.json")
                               for m in ("smollm2", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b")])


def t_ab_q8_0_avx512(res, doc):
    return ab_table(res, doc, [
        (None, "chat, Q8_0 only", "ab-q8_0-one-column-smollm2-zen4.json"),
        (None, "chat, both", "ab-q8_0-avx512-attention-smollm2-zen4.json"),
        (None, "4,096, both", "ab-q8_0-avx512-attention-smollm2-context4096-zen4.json"),
        (None, "4,096, Q8_0 only", "ab-q8_0-one-column-qwen05-context4096-zen4.json"),
        (None, "4,096, both", "ab-q8_0-avx512-attention-qwen05-context4096-zen4.json"),
        (None, "chat, both (only attention touches it)", "ab-q8_0-avx512-attention-qwen15-zen4.json"),
    ])


def t_ab_packed_q4_1(res, doc):
    return ab_table(res, doc, [
        (None, None, "ab-packed-smol-4k-zen4.json"),
        (None, None, "ab-packed-smol-chat-zen4.json"),
        (None, None, "ab-packed-q05-4k-zen4.json"),
        (None, None, "ab-packed-q05-chat-zen4.json"),
        ("Qwen2.5-Coder-1.5B Q4_K_M (nothing packed: no Q4_1/Q5_0 matrix)", None, "ab-packed-q15-chat-zen4.json"),
    ])


# ---------------------------------------------------------------- speculative.py


def spec_rows(d: dict, with_task: bool) -> list[list[str]]:
    rows = []
    for r in d["rows"]:
        row = [r["who"], str(r["streams"]), r["drafts"], f1(r["tok_per_s"]), f"{r['vs_plain']:.2f}x",
               "" if r.get("acceptance") is None else pct(r["acceptance"]),
               "" if r.get("tokens_per_pass") is None else f2(r["tokens_per_pass"]),
               {True: "yes", False: "**no**", None: ""}[r.get("equal_to_plain")]]
        if r["who"] != "candle-gate":  # a peer's tokens are compared with its own plain run's
            row[-1] = "" if r["drafts"] == "off" else row[-1] + " (its own plain)"
        rows.append(([r["task"]] if with_task else []) + row)
    return rows


SPEC_HEADER = ["who", "streams", "drafts", "tok/s", "vs plain", "drafts kept", "tokens per pass", "tokens = plain's"]


def t_speculative(res, doc):
    name = "speculative-qwen15-zen4.json"
    return table(SPEC_HEADER, spec_rows(res(name), False)) + ["", res.source([name], doc)]


def t_speculative_draft(res, doc):
    name = "speculative-draft-qwen15-zen4.json"
    return table(["task"] + SPEC_HEADER, spec_rows(res(name), True)) + ["", res.source([name], doc)]


def t_speculative_draft_completion_packed(res, doc):
    name = "speculative-draft-completion-packed-qwen15-zen4.json"
    return table(SPEC_HEADER, spec_rows(res(name), False)) + ["", res.source([name], doc)]


def t_speculative_ngram_longest_k5_12(res, doc):
    name = "speculative-ngram-longest-k5-12-qwen15-zen4.json"
    return table(SPEC_HEADER, spec_rows(res(name), False)) + ["", res.source([name], doc)]


def t_speculative_ngram_longest(res, doc):
    name = "speculative-ngram-longest-qwen15-zen4.json"
    d = res(name)
    with_task = len({r.get("task") for r in d["rows"]}) > 1
    return table((["task"] if with_task else []) + SPEC_HEADER, spec_rows(d, with_task)) + ["", res.source([name], doc)]


# ---------------------------------------------------------------- serving: serve_load, prefix_cache, ray_serve


def t_serve_load(res, doc):
    name = "serve-load-smollm2.json"
    d = res(name)
    cg, lc = d["servers"]["candle-gate"], d["servers"]["llama.cpp"]
    rows = []
    for a, b in zip(cg, lc):
        rows.append([str(a["concurrency"]),
                     f"{f1(a['tok_per_s'])} ({ratio(a['tok_per_s'], cg[0]['tok_per_s'])})",
                     f"{f1(b['tok_per_s'])} ({ratio(b['tok_per_s'], lc[0]['tok_per_s'])})",
                     ratio(a["tok_per_s"], b["tok_per_s"]),
                     f"{secs(a['ttft_p50'])} / {secs(b['ttft_p50'])}",
                     f"{1000 * a['itl_p50']:.1f} / {ms(b['itl_p50'])}",
                     f"{a['distinct_max']} / {b['distinct_max']}"])
    header = ["clients", "candle-gate tok/s (vs 1 client)", "llama.cpp tok/s (vs 1 client)", "ratio",
              "TTFT p50 (cg / llama.cpp)", "ITL p50 (cg / llama.cpp)", "distinct completions per request (cg / llama.cpp)"]
    ip = {r["concurrency"]: r["tok_per_s"] for r in d["in_process"]}
    note = (f"In process (no HTTP), the same requests: {', '.join(f'{f1(v)} tok/s at {k}' for k, v in ip.items())} "
            f"client{'s' if len(ip) > 1 else ''}. ")
    return table(header, rows) + ["", note + res.source([name], doc)]


def t_prefix_cache_chat(res, doc):
    name = "prefix-cache-qwen05-zen4.json"
    runs = res(name)["chat"]["runs"]
    labels = {
        "candle-gate cold": ("candle-gate", "cold"),
        "candle-gate warm replay": ("candle-gate", "warm replay"),
        "candle-gate (no cache) cold": ("candle-gate `--no-prefix-cache`", "cold"),
        "candle-gate (no cache) warm replay": ("candle-gate `--no-prefix-cache`", "warm replay"),
        "llama.cpp cold": ("llama-server", "cold"),
        "llama.cpp warm replay": ("llama-server", "warm replay"),
    }
    rows = []
    for key, run in runs.items():
        server, pas = labels.get(key, (key, ""))
        p50 = run["ttft_p50_by_turn"]
        rows.append([server, pas, f"{run['total_s']:.1f} s", secs(p50[0]),
                     f"{secs(p50[-1])} ({p50[-1] / p50[0]:.2f}x)", secs(run["ttft_p95_by_turn"][-1]),
                     thousands(run["cached_tokens"])])
    header = ["server", "pass", "total", "TTFT p50, turn 1", f"TTFT p50, turn {len(p50)} (x turn 1)",
              f"TTFT p95, turn {len(p50)}", "prompt tokens from the cache"]
    distinct = res(name)["chat"]["distinct"]
    note = "Distinct completions per request over both passes: " + "; ".join(
        f"{k} {v['max']} at most ({v['requests_with_more_than_one']} requests with more than one)"
        for k, v in distinct.items()) + ". "
    return table(header, rows) + ["", note + res.source([name], doc)]


def t_prefix_cache_system(res, doc):
    name = "prefix-cache-system-qwen05-zen4.json"
    system = res(name)["system"]
    labels = {"candle-gate (no cache)": "candle-gate `--no-prefix-cache`", "llama.cpp": "llama-server"}
    rows = [[labels.get(k, k), f1(v["tok_s"]), secs(v["ttft_p50"]), secs(v["ttft_p95"]), f"{v['total_s']:.1f} s"]
            for k, v in system.items()]
    return table(["server", "tok/s", "TTFT p50", "TTFT p95", "total"], rows) + ["", res.source([name], doc)]


def t_prefix_cache_itl(res, doc):
    name = "prefix-cache-qwen05-zen4.json"
    itl = res(name)["itl"]
    labels = {"max-num-batched-tokens 256": "256 rows, chunks of 64 (defaults)",
              "max-num-batched-tokens 64": "`--max-num-batched-tokens 64 --prefill-chunk 64`"}
    rows = [[labels.get(k, k), f"{1000 * v['alone_p50']:.1f} / {ms(v['alone_p99'])}",
             f"{1000 * v['with_prefill_p50']:.1f} / {ms(v['with_prefill_p99'])}", secs(v["long_prompt_ttft"], 1)]
            for k, v in itl.items()]
    header = ["per-step budget", "ITL p50 / p99 alone", "ITL p50 / p99 beside the prefill", "the long prompt's TTFT"]
    return table(header, rows) + ["", res.source([name], doc)]


def ray_rounds(d: dict, setup: str) -> list[list[dict]]:
    """A setup's rounds (each a list of per-concurrency dicts); a one-round file is one round."""
    v = d["overhead"][setup]
    return v if v and isinstance(v[0], list) else [v]


def at_c(rnd: list[dict], c: int) -> dict:
    return next(x for x in rnd if x["concurrency"] == c)


def ray_medians(d, setup, base, c, key="tok_per_s"):
    """Per-round ratios (or differences, for TTFT) of `setup` against `base` at concurrency c."""
    ours, theirs = ray_rounds(d, setup), ray_rounds(d, base)
    return [at_c(o, c)[key] / at_c(t, c)[key] for o, t in zip(ours, theirs)]


def ray_added_ttft(d, setup, base, c):
    ours, theirs = ray_rounds(d, setup), ray_rounds(d, base)
    return [1000 * (at_c(o, c)["ttft_p50"] - at_c(t, c)["ttft_p50"]) for o, t in zip(ours, theirs)]


def rounds_cell(xs, fmt, unit="") -> str:
    """The median, then each round in parentheses: `0.84x (1.10, 0.84, 0.84)`."""
    if len(xs) == 1:
        return fmt(xs[0]) + unit
    return f"{fmt(median(xs))}{unit} ({', '.join(fmt(x) for x in xs)})"


def times(x: float) -> str:
    return f"{x:.2f}"


def signed(x: float) -> str:
    return f"{x:+.0f}"


def ray_ratio_table(res, doc, files, setups, with_itl=False, per_model=False, run_labels=None):
    """Median (rounds) of each setup against `serve` in the same round, at 1 and 8 clients.
    The first column: the setup's label, or the model (per_model), or the run (run_labels)."""
    rows = []
    for i, f in enumerate(files):
        d = res(f)
        base = next(k for k in d["overhead"] if k.startswith("serve"))
        for setup, label in setups:
            if setup not in d["overhead"]:
                continue
            first = run_labels[i] if run_labels else model_name(d["model"]) if per_model else label
            for c in (1, 8):
                row = [first, str(c),
                       rounds_cell(ray_medians(d, setup, base, c), times, "x"),
                       rounds_cell(ray_added_ttft(d, setup, base, c), signed, " ms")]
                if with_itl:
                    row.append(rounds_cell(ray_medians(d, setup, base, c, "server_itl_mean"), times, "x"))
                rows.append(row)
    header = ["run" if run_labels else "model" if per_model else "server", "clients", "vs serve", "TTFT p50 added"] + (
        ["the replica's own ITL vs serve's"] if with_itl else [])
    return table(header, grouped(rows)) + ["", "Median (rounds), each round against `serve` in the same round. "
                                           + res.source(files, doc)]


def t_ray_overhead(res, doc):
    name = "ray-serve-overhead-smollm2-zen4.json"
    d = res(name)
    labels = {"serve, 2 threads": "`candle-gate serve`, 2 threads", "ray, 1 replica x 2 threads": "Ray, 1 replica × 2 threads",
              "ray, 2 replicas x 1 thread": "Ray, 2 replicas × 1 thread"}
    base = ray_rounds(d, "serve, 2 threads")[0]
    rows = []
    for setup in d["overhead"]:
        for x in ray_rounds(d, setup)[0]:
            rows.append([labels.get(setup, setup), str(x["concurrency"]), f1(x["tok_per_s"]),
                         ratio(x["tok_per_s"], at_c(base, x["concurrency"])["tok_per_s"]),
                         f"{1000 * x['ttft_p50']:.1f} / {ms(x['ttft_p99'])}", ms(x["itl_p50"])])
    header = ["server", "clients", "tok/s", "vs serve", "TTFT p50 / p99", "ITL p50"]
    return table(header, grouped(rows)) + ["", res.source([name], doc)]


def t_ray_settings(res, doc):
    return ray_ratio_table(res, doc, ["ray-serve-overhead-settings-smollm2-zen4.json"], [
        ("ray, 1 replica x 2 threads", "Ray, 1 replica × 2 threads"),
        ("ray defaults, 1 x 2 threads", "the same with Ray's defaults"),
        ("ray, 2 replicas x 1 thread", "Ray, 2 replicas × 1 thread"),
    ])


def t_ray_interval(res, doc):
    return ray_ratio_table(res, doc, ["ray-serve-overhead-interval-smollm2-zen4.json"], [
        ("ray, 1 replica x 2 threads", "Ray, 1 replica × 2 threads, interval 50 ms"),
        ("ray, 1 x 2, stream interval 0", "the same, interval 0"),
    ])


def t_ray_larger_models(res, doc):
    return ray_ratio_table(res, doc, ["ray-serve-overhead-qwen05-zen4.json", "ray-serve-overhead-qwen15-zen4.json"],
                           [("ray, 1 replica x 2 threads", None)], per_model=True)


def t_ray_one_thread(res, doc):
    return ray_ratio_table(res, doc, ["ray-serve-overhead-1thread-qwen05-zen4.json",
                                      "ray-serve-overhead-1thread-smollm2-zen4.json"],
                           [("ray, 1 replica x 1 threads", None)], with_itl=True, per_model=True)


def t_ray_server_itl(res, doc):
    return ray_ratio_table(res, doc, ["ray-serve-overhead-server-itl-qwen05-zen4.json",
                                      "ray-serve-overhead-control-loop-qwen05-zen4.json"],
                           [("ray, 1 replica x 2 threads", None)], with_itl=True,
                           run_labels=["Qwen 0.5B, Ray's controller loop (0.1 s)", "the same, the loop every 0.5 s"])


def t_ray_idle(res, doc):
    name = "ray-serve-idle-smollm2-zen4.json"
    rows = [[k, rounds_cell(v, lambda x: pct(x, 1))] for k, v in res(name)["idle"].items()]
    return table(["an idle app (no requests)", "share of one core: median (rounds)"], rows) + [
        "", res.source([name], doc)]


def t_ray_routing(res, doc):
    name = "ray-serve-routing-smollm2-zen4.json"
    labels = {"session": "`session` (rendezvous hash, bounded load)", "pow2": "`pow2` (Ray's default)"}
    rows = []
    for k, v in res(name)["routing"].items():
        t = v["ttft_p50_by_turn"]
        c, p = v["cached_tokens_later_turns"], v["prompt_tokens_later_turns"]
        rows.append([labels.get(k, k), f"{v['total_s']:.1f} s", f"{t[0]:.2f} → {t[-1]:.2f} s",
                     f"{thousands(c)} of {thousands(p)} ({pct(c / p)})"])
    header = ["routing", "total", f"TTFT p50 turn 1 → {len(t)}", "later turns' prompt tokens from a prefix cache"]
    return table(header, rows) + ["", res.source([name], doc)]


# ---------------------------------------------------------------- probes, the gate, CUDA, the profile


def t_gate_heldout(res, doc):
    files = ["probe-split_k_f16-off-heldout24x128.json", "probe-split_k_f16-gated-heldout24x128.json",
             "probe-split_k_f16-gated-sampled-heldout24x128.json"]
    rows = []
    for f in files:
        d = res(f)
        comps = d["compositions"]
        flips = [c["step_flip_rate"] for c in comps]
        div = [c["diverging_sequences"] for c in comps]
        firsts = [s for c in comps for s in c["first_divergence"]]
        g = d.get("gate") or {}
        sampling = d.get("sampling")
        label = "off" if not g else f"gated (tau {g['tau']:.3f}, deep_tau {g['deep_tau']:.3f})"
        label += ", sampled (" + ", ".join(f"{k.replace('_', '-')} {v}" for k, v in sampling.items()) + ")" \
            if sampling else ", greedy"
        n = d["prompts"]
        rows.append([
            label,
            f"{pct(min(flips), 2)}–{pct(max(flips), 2)}" if max(flips) else "0",
            (f"{min(div)}–{max(div)}" if min(div) != max(div) else str(min(div))) + f" of {n}"
            + (f"; first at steps {min(firsts)}–{max(firsts)}" if firsts else ""),
            f"{round(d['identical_sequences_share'] * n)}/{n}",
            f"{pct(g['rechecks'] / g['steps'], 1)} of {thousands(g['steps'])}" if g else "0",
            str(g.get("corrections", 0)),
            f"{thousands(g['deep_rechecks'])} ({pct(g['deep_rechecks'] / g['steps'], 1)})" if g else "0",
        ])
    header = ["gate", f"step flip rate (over the {len(comps)} compositions)", "diverging sequences per composition",
              f"identical across all {len(comps) + 1} runs", "rechecked steps", "corrections", "deep rechecks"]
    return table(header, rows) + ["", res.source(files, doc)]


def t_kv_dtype_agreement(res, doc):
    files = ["kv-dtype-agreement-smollm2-zen4.json", "kv-dtype-agreement-qwen05-zen4.json"]
    rows = []
    for f in files:
        for r in res(f):
            rows.append([model_name(r["model"]), r["kv_dtype"], f"{r['identical']} of {r['chats']}",
                         pct(r["mean_prefix"], 1)])
    header = ["model", "K/V", "chats identical to the oracle over all 64 tokens",
              "tokens before the first divergence"]
    return table(header, grouped(rows)) + ["", res.source(files, doc)]


def t_endpoint_probe(res, doc):
    entries = [("endpoint-probe-qwen05.json", "native", "native (Candle's dispatch)"),
               ("endpoint-probe-qwen05.json", "invariant", "invariant"),
               ("endpoint-probe-qwen05-gated.json", "gated", "gated over native (the packaged calibration)"),
               ("endpoint-probe-qwen05-llamacpp.json", "llama.cpp", "llama-cpp-python server")]
    rows = []
    for f, key, label in entries:
        s = res(f)["servers"][key]
        m = s["summary"]
        divs = m["divergences"]
        gaps = m.get("gap_at_divergence")
        g = s.get("gate") or {}
        flipped = f"{m['prompts_flipped']}/{m['prompts']}"
        rows.append([
            label, str(m["requests"]), f"**{flipped}**" if m["prompts_flipped"] else flipped,
            ", ".join(str(x["position"]) for x in sorted(divs, key=lambda x: x["position"])) or "–",
            (f3(gaps["min"]) if gaps["min"] == gaps["max"] else f"{f3(gaps['min'])}–{f3(gaps['max'])}") if gaps else "–",
            f"{thousands(g['rechecks'])} of {thousands(g['steps'])} steps" if g.get("rechecks") else "–",
        ])
    header = ["server", "requests", "prompts with >1 distinct completion", "first divergence (tokens)",
              "top-1/top-2 logprob gap there", "gate rechecks"]
    return table(header, rows) + ["", res.source(list(dict.fromkeys(f for f, _, _ in entries)), doc)]


def t_cuda_timings(res, doc):
    name = "cuda-check-h200-v1.json"
    t = res(name)["timings"]
    row_counts = sorted({x["rows"] for x in t})
    keys = list(dict.fromkeys((x["model"], x["matmul"], x["dtype"], tuple(x["shape"])) for x in t))
    labels = {"smollm2-135m": "SmolLM2-135M", "qwen2.5-0.5b": "Qwen2.5-0.5B", "qwen2.5-1.5b": "Qwen2.5-1.5B"}
    rows = []
    for k in keys:
        by_rows = {x["rows"]: x for x in t if (x["model"], x["matmul"], x["dtype"], tuple(x["shape"])) == k}
        rows.append([labels.get(k[0], k[0]), k[1], k[2], f"[{k[3][0]}, {k[3][1]}]"] + [
            f"{by_rows[r]['invariant_us']:.0f} / {by_rows[r]['native_us']:.0f}" if r in by_rows else "" for r in row_counts])
    header = ["model", "matmul", "dtype", "[n, k]"] + [f"{r} row{'s' if r > 1 else ''}" for r in row_counts]
    return table(header, grouped(rows)) + ["", "µs per call, `invariant` / Candle's `native`. " + res.source([name], doc)]


def t_crossover(res, doc):
    name = "python/candle_gate/profiles/cpu.json"
    p = res(name)
    cells = [("q4_1", [1536, 576], 1), ("q4_1", [1536, 576], 8), ("q4_1", [576, 1536], 8), ("q4_1", [1536, 576], 64),
             ("q8_0", [49152, 576], 1), ("q8_0", [49152, 576], 8)]
    kernels = ["gemv_row_split", "invariant", "gemm", "candle"]
    rows = []
    for dtype, shape, n in cells:
        ns = {x["kernel"]: x["ns_per_call"] for x in p["dtypes"][dtype]["table"] if x["shape"] == shape and x["rows"] == n}
        rows.append([f"{dtype} [{shape[0]}, {shape[1]}]", str(n)] + [f"{ns[k] / 1000:.1f}" for k in kernels]
                    + [ratio(ns["candle"], ns["invariant"])])
    header = ["dtype, [n, k]", "rows", "row-split gemv", "invariant", "gemm", "Candle QMatMul", "invariant vs Candle"]
    cross = "; ".join(f"{dt} gemm from {v['crossover_rows']} rows (`row_split_max` {v['row_split_max']})"
                      for dt, v in p["dtypes"].items())
    return table(header, rows) + ["", f"µs per call (excerpt). Measured crossovers: {cross}. " + res.source([name], doc)]


# ---------------------------------------------------------------- the registry

TABLES = {
    "headline": t_headline,
    "headline-xeon": t_headline_xeon,
    "headline-xeon-d7eae0c": t_headline_xeon_d7eae0c,
    "headline-xeon-4870004": t_headline_xeon_4870004,
    "headline-zen3": t_headline_zen3,
    "headline-zen2": t_headline_zen2,
    "headline-zen2-7fdca56": t_headline_zen2_7fdca56,
    "step-costs-zen2": t_step_costs_zen2,
    "step-costs-zen2-final": partial(t_step_costs_zen2, name="step-costs-zen2-40f4736.json"),
    "step-costs-zen2-38d953f": partial(t_step_costs_zen2, name="step-costs-zen2-38d953f.json"),
    "peers-goals-zen3-85d0042": partial(peers_rows_table, names=["vs-peers-qwen15-1023-zen3-85d0042.json",
                                                                "vs-peers-synth8b-chat-zen3-85d0042.json",
                                                                "vs-peers-synth8b-8streams-zen3-85d0042.json"]),
    "vs-llama-cpp-zen1": t_vs_llama_cpp_zen1,
    "vs-llama-cpp-xeon": t_vs_llama_cpp_xeon,
    "vs-llama-cpp-zen3": t_vs_llama_cpp_zen3,
    "long-context-zen4": t_long_context_zen4,
    "zen4-latest": t_zen4_latest,
    "eight-streams-zen4": t_eight_streams_zen4,
    "grouped-attention-vs-llama-cpp": t_grouped_attention_vs_llama_cpp,
    "q8_0-avx512-vs-llama-cpp": t_q8_0_avx512_vs_llama_cpp,
    "long-context-2rounds": t_long_context_2rounds,
    "kquant-vs-llama-cpp": t_kquant_vs_llama_cpp,
    "packed-q4_k-vs-llama-cpp": t_packed_q4_k_vs_llama_cpp,
    "no-prefetch-vs-llama-cpp": t_no_prefetch_vs_llama_cpp,
    "huge-pages-vs-llama-cpp": t_huge_pages_vs_llama_cpp,
    "avx512-attention-vs-llama-cpp": t_avx512_attention_vs_llama_cpp,
    "packed-q4_1-vs-llama-cpp": t_packed_q4_1_vs_llama_cpp,
    "gemma-vs-llama-cpp": t_gemma_vs_llama_cpp,
    "canonical-quantize": t_canonical_quantize,
    "canonical-zen4": partial(modes_table, name="modes-canonical-vs-invariant-zen4-c9cf0ec.json"),
    "canonical-zen4-in-order": partial(modes_table, name="modes-canonical-vs-invariant-zen4-f3f18bf.json"),
    "canonical-zen4-unzeroed": partial(modes_table, name="modes-canonical-vs-invariant-zen4-c880b4f.json"),
    "ab-canonical-unzeroed": partial(ab_table, entries=ab_files("ab-canonical-lanes-unzeroed-{}-zen4.json", "qwen15", "qwen05", "gemma", "smollm2")),
    "peers-canonical-zen4": partial(peers_canonical_table, name="vs-peers-qwen15-chat-canonical-zen4.json"),
    "ab-kernels-canonical-in-order": partial(kernels_ab_table, name="ab-kernels-canonical-in-order-qwen15-zen4.json", tier=" (AVX-512 tier)"),
    "ab-kernels-canonical-in-order-avx2": partial(kernels_ab_table, name="ab-kernels-canonical-in-order-avx2-qwen15-zen4.json",
                                                  tier=" capped at AVX2 (`CANDLE_GATE_ISA=avx2`)"),
    "ab-canonical-in-order": partial(ab_table, entries=ab_files("ab-canonical-in-order-{}-zen4.json", "qwen15", "qwen05", "gemma", "smollm2")),
    "ab-ops-exp-batches": partial(ab_ops_table, name="ab-ops-exp-batches-zen4.json", tier=" (AVX-512 tier)"),
    "ab-ops-exp-batches-avx2": partial(ab_ops_table, name="ab-ops-exp-batches-avx2-zen4.json", tier=" capped at AVX2 (`CANDLE_GATE_ISA=avx2`)"),
    "ab-exp-batches": partial(ab_table, entries=ab_files("ab-exp-batches-{}-zen4.json", "smollm2", "gemma", "qwen05", "qwen15")),
    "ab-exp-batches-context": partial(ab_context_table, names=[f"ab-exp-batches-{m}-1024-zen4.json" for m in ("qwen05", "gemma")]),
    "ab-kernels-q8_0-odd-rows": partial(kernels_ab_table, name="ab-kernels-q8_0-odd-rows-qwen05-zen4.json", tier=" (AVX-512 tier)"),
    "ab-q8_0-odd-rows": partial(ab_table, entries=ab_files("ab-q8_0-odd-rows-{}-zen4.json", "gemma", "qwen05", "smollm2")),
    "ab-kernels-tile-prefetch": partial(kernels_ab_table, name="ab-kernels-tile-prefetch-qwen15-zen4.json", tier=" (AVX-512 tier)"),
    "ab-kernels-tile-prefetch-canonical": partial(kernels_ab_table, name="ab-kernels-tile-prefetch-canonical-qwen15-zen4.json",
                                                  tier=" (AVX-512 tier)"),
    "resident-memory-arena": partial(resident_memory_table, old="resident-memory-883fbfb-zen4.json",
                                     new="resident-memory-d2d9f91-zen4.json"),
    "ab-weight-arena": partial(ab_orders_table, files=[f"ab-weight-arena-{m}-zen4.json" for m in ("smollm2", "qwen05", "gemma", "qwen15")],
                               swapped=["ab-weight-arena-qwen15-reversed-zen4.json"], old="883fbfb", new="4fe02b1",
                               prompts="chat prompts"),
    "ab-arena-prefetch": partial(ab_orders_table, files=[f"ab-arena-prefetch-{m}-zen4.json" for m in ("smollm2", "qwen05", "gemma", "qwen15")],
                                 swapped=[f"ab-arena-prefetch-{m}-reversed-zen4.json" for m in ("smollm2", "qwen15")],
                                 old="883fbfb", new="c9216c4", prompts="chat prompts, `invariant` mode"),
    "ab-arena-prefetch-canonical": partial(ab_orders_table, swapped=["ab-arena-prefetch-canonical-qwen15-reversed-zen4.json"],
                                           old="883fbfb", new="c9216c4",
                                           files=[f"ab-arena-prefetch-canonical-{m}-zen4.json" for m in ("smollm2", "qwen05", "gemma", "qwen15")],
                                           prompts="chat prompts, `canonical` mode"),
    "ab-arena-prefetch-context": partial(ab_context_table, names=[f"ab-arena-prefetch-{m}-1024-zen4.json" for m in ("qwen05", "qwen15")]),
    "canonical-zen4-arena-prefetch": partial(modes_table, name="modes-canonical-vs-invariant-zen4-c9216c4.json"),
    "canonical-zen4-70ec7c6": partial(modes_table, name="modes-canonical-vs-invariant-zen4-70ec7c6.json"),
    "ab-kernels-q6k-prefetch": partial(kernels_ab_table, name="ab-kernels-q6k-prefetch-qwen15-zen4.json", tier=" (AVX-512 tier)"),
    "ab-q6k-prefetch": partial(ab_table, entries=ab_files("ab-q6k-prefetch-{}-zen4.json", "qwen15", "synth8b")),
    "ab-q6k-prefetch-context": partial(ab_context_table, names=[f"ab-q6k-prefetch-{m}-1024-zen4.json" for m in ("qwen05", "qwen15")]),
    "ab-kernels-q32-packed-avx2-smollm2": partial(kernels_ab_table, name="ab-kernels-q32-packed-avx2-smollm2-zen2.json"),
    "ab-kernels-q32-packed-avx2-qwen05": partial(kernels_ab_table, name="ab-kernels-q32-packed-avx2-qwen05-zen2.json"),
    "ab-q32-packed-avx2": partial(ab_table, entries=ab_files("ab-q32-packed-avx2-{}-zen2.json", "smollm2", "qwen05", "gemma",
                                                             "qwen15", "qwen15-rerun")),
    "ab-q32-packed-avx2-context": partial(ab_context_table, names=[f"ab-q32-packed-avx2-{m}-context-zen2.json"
                                                                  for m in ("smollm2", "qwen05")]),
    "ab-kernels-q80-rows-avx2": partial(kernels_ab_models_table, names=[f"ab-kernels-q80-rows-{m}-zen2.json"
                                                                         for m in ("gemma", "qwen05", "smollm2")]),
    "ab-q80-rows-avx2": partial(ab_table, entries=ab_files("ab-q80-rows-{}-zen2.json", "gemma", "qwen05", "smollm2",
                                                           "qwen15")),
    "ab-kernels-q80-rows5to7-avx2": partial(kernels_ab_table, name="ab-kernels-q80-rows5to7-gemma-zen2.json"),
    "ab-q80-rows5to7-avx2": partial(ab_table, entries=ab_files("ab-q80-rows5to7-{}-zen2.json", "gemma")),
    "ab-kernels-q80-tail-avx2": partial(kernels_ab_models_table, names=[f"ab-kernels-q80-tail-{m}-zen2.json"
                                                                         for m in ("gemma", "qwen05", "smollm2")]),
    "ab-q80-tail-avx2": partial(ab_table, entries=ab_files("ab-q80-tail-{}-zen2.json", "gemma", "qwen05", "smollm2",
                                                           "qwen15")),
    "ab-kernels-q80-one-row-loop": partial(kernels_ab_table, name="ab-kernels-q80-one-row-loop-gemma-zen2.json"),
    "ab-q80-one-row-loop": partial(ab_table, entries=ab_files("ab-q80-one-row-loop-{}-zen2.json", "gemma", "qwen05",
                                                              "smollm2", "smollm2-2streams")),
    "ab-kernels-avx512-segments-ahead": partial(kernels_ab_table,
                                                name="ab-kernels-avx512-segments-ahead-qwen15-xeon.json"),
    "ab-avx512-segments-ahead": partial(ab_table, entries=ab_files("ab-avx512-segments-ahead-{}-xeon.json", "qwen15",
                                                                   "synth8b", "qwen05", "gemma", "gemma8")),
    "ab-avx512-q32-ahead": partial(ab_table, entries=ab_files("ab-avx512-q32-ahead-{}-xeon.json", "smollm2", "qwen05")),
    "ab-kernels-q4k-one-row-ahead": partial(kernels_ab_models_table, names=[f"ab-kernels-q4k-one-row-ahead-{m}-zen2.json"
                                                                             for m in ("synth8b", "qwen15")]),
    "ab-q4k-one-row-ahead": partial(ab_table, entries=ab_files("ab-q4k-one-row-ahead-{}-zen2.json", "qwen15", "synth8b",
                                                               "qwen05", "gemma")),
    "ab-kernels-q41-one-row-ahead": partial(kernels_ab_models_table, names=[f"ab-kernels-q41-one-row-ahead-{m}-zen2.json"
                                                                             for m in ("smollm2", "qwen05")]),
    "ab-q41-one-row-ahead": partial(ab_table, entries=ab_files("ab-q41-one-row-ahead-{}-zen2.json", "smollm2", "qwen05",
                                                               "gemma")),
    "ab-kernels-q4k-three-avx2": partial(kernels_ab_table, name="ab-kernels-q4k-three-qwen15-zen2.json"),
    "ab-q4k-three-avx2": partial(ab_table, entries=ab_files("ab-q4k-three-{}-zen2.json", "qwen15", "qwen05", "gemma",
                                                            "synth8b")),
    "ab-kernels-q4k-four-avx2": partial(kernels_ab_table, name="ab-kernels-q4k-four-qwen15-zen2.json"),
    "ab-q4k-four-avx2": partial(ab_table, entries=ab_files("ab-q4k-four-{}-zen2.json", "qwen15", "qwen05", "gemma",
                                                           "synth8b")),
    "ab-attention-avx2-groups": partial(attention_ab_table, name="ab-attention-avx2-groups-zen2.json"),
    "ab-attention-avx2-groups-context": partial(ab_context_table,
                                                names=["ab-attention-avx2-groups-qwen05-4096-zen2.json"]),
    "ab-kernels-q4k-shuffle-avx2": partial(kernels_ab_table, name="ab-kernels-q4k-shuffle-synth8b-zen2.json"),
    "ab-q4k-shuffle-avx2": partial(ab_table, entries=ab_files("ab-q4k-shuffle-{}-zen2.json", "synth8b", "qwen15", "qwen05",
                                                              "gemma")),
    "ab-kernels-q4k-packed-avx2": partial(kernels_ab_table, name="ab-kernels-q4k-packed-avx2-qwen15-zen2.json"),
    "ab-q4k-packed-avx2": partial(ab_table, entries=ab_files("ab-q4k-packed-avx2-{}-zen2.json", "qwen15", "qwen05", "gemma",
                                                             "synth8b")),
    "ab-q4k-packed-avx2-context": partial(ab_context_table, names=["ab-q4k-packed-avx2-qwen15-1024-zen2.json"]),
    "peers-synth8b-zen2-196902c": partial(peers_rows_table, names=["vs-peers-synth8b-chat-zen2-196902c.json",
                                                                   "vs-peers-synth8b-8streams-zen2-196902c.json"]),
    "peers-goals-zen2-3cde664": partial(peers_rows_table, names=[f"vs-peers-qwen15-{c}-zen2-3cde664.json"
                                                                for c in ("chat", "1023", "4096")]
                                        + [f"vs-peers-synth8b-{c}-zen2-3cde664.json" for c in ("chat", "8streams")]),
    "peers-goals-zen2-300aba2": partial(peers_rows_table, names=[f"vs-peers-qwen15-{c}-zen2-300aba2.json"
                                                                for c in ("chat", "1023", "4096")]
                                        + [f"vs-peers-synth8b-{c}-zen2-300aba2.json" for c in ("chat", "8streams")]),
    "peers-goals-xeon-d7eae0c": partial(peers_rows_table, names=["vs-peers-qwen15-1023-xeon-d7eae0c.json",
                                                                 "vs-peers-synth8b-chat-xeon-d7eae0c.json",
                                                                 "vs-peers-synth8b-8streams-xeon-d7eae0c.json"]),
    "canonical-zen2": partial(modes_table, name="modes-canonical-vs-invariant-zen2-b2c8e50.json"),
    "ab-kernels-q4k-shuffles": partial(kernels_ab_table, name="ab-kernels-q4k-shuffles-qwen15-zen2.json"),
    "ab-q4k-shuffles": partial(ab_table, entries=ab_files("ab-q4k-shuffles-{}-zen2.json", "qwen15", "qwen05", "gemma")),
    "ab-attention-query-groups": partial(attention_ab_table, name="ab-attention-query-groups-zen2.json"),
    "ab-kernels-kquant-reductions": partial(kernels_ab_table, name="ab-kernels-kquant-reductions-qwen15-zen2.json"),
    "ab-kquant-reductions": partial(ab_table, entries=ab_files("ab-kquant-reductions-{}-zen2.json", "qwen15", "qwen05",
                                                               "gemma")),
    "peers-goals-zen2-4706764": partial(peers_rows_table, names=[f"vs-peers-qwen15-{c}-zen2-4706764.json"
                                                                for c in ("chat", "1023", "4096")]),
    "ab-attention-avx2-next": partial(attention_ab_table, name="ab-attention-avx2-next-zen3.json"),
    "ab-attention-avx2-next-context": partial(ab_context_table, names=[f"ab-attention-avx2-next-{m}-1024-zen3.json"
                                                                      for m in ("smollm2", "qwen15")],
                                              old="85d0042", new="2473aae-dirty"),
    "ab-attention-next-l2": partial(attention_ab_table, name="ab-attention-next-l2-zen4.json"),
    "ab-attention-next-l2-context": partial(ab_context_table, names=["ab-attention-next-l2-qwen15-4096-zen4.json"]),
    "peers-qwen15-4096-149167d": partial(peers_long_table, name="vs-peers-qwen15-4096-zen4-149167d.json"),
    "peers-synth8b-8bd30fc": partial(peers_long_table, name="vs-peers-synth8b-chat-zen4-8bd30fc.json"),
    "peers-goals-dadf6a5": partial(peers_rows_table, names=["vs-peers-qwen15-1023-zen4-dadf6a5.json",
                                                           "vs-peers-synth8b-8streams-zen4-dadf6a5.json"]),
    "canonical-scalar": t_canonical_scalar,
    "ab-session-start-xeon": t_ab_session_start_xeon,
    "peers": t_peers,
    "peers-canonical": partial(peers_canonical_table, name="vs-peers-qwen15-chat-canonical-xeon-spr.json"),
    "ab-no-prefetch": t_ab_no_prefetch,
    "ab-q8_0-scales": t_ab_q8_0_scales,
    "ab-issue31": t_ab_issue31,
    "ab-issue51": t_ab_issue51,
    "peers-qwen15-zen4": t_peers_qwen15_zen4,
    "peers-qwen15-zen4-sixteen-packed": t_peers_qwen15_zen4_sixteen_packed,
    "peers-synth8b-zen4": partial(peers_synth8b_table, name="vs-peers-synth8b-chat-zen4-sixteen-packed.json"),
    "peers-synth8b-zen4-e75fecd": partial(peers_synth8b_table, name="vs-peers-synth8b-chat-zen4-e75fecd.json"),
    "peers-qwen15-zen4-headline": partial(peers_qwen15_table, chat="headline-chat-zen4-eb7d734.json",
                                         ctx="vs-peers-qwen15-1023-zen4-e75fecd.json",
                                         long="headline-4096-zen4-eb7d734.json", long_context=4096),
    "ab-sixteen-packed": t_ab_sixteen_packed,
    "ab-sixteen-packed-context": t_ab_sixteen_packed_context,
    "ab-kernels-sixteen-packed": t_ab_kernels_sixteen_packed,
    "ab-kernels-q6k-four-rows": t_ab_kernels_q6k_four_rows,
    "ab-q8_0-avx512": t_ab_q8_0_avx512,
    "ab-packed-q4_1": t_ab_packed_q4_1,
    "speculative": t_speculative,
    "speculative-draft": t_speculative_draft,
    "speculative-ngram-longest": t_speculative_ngram_longest,
    "speculative-ngram-longest-k5-12": t_speculative_ngram_longest_k5_12,
    "speculative-draft-completion-packed": t_speculative_draft_completion_packed,
    "ab-draft-kquant": t_ab_draft_kquant,
    "serve-load": t_serve_load,
    "prefix-cache-chat": t_prefix_cache_chat,
    "prefix-cache-system": t_prefix_cache_system,
    "prefix-cache-itl": t_prefix_cache_itl,
    "ray-overhead": t_ray_overhead,
    "ray-settings": t_ray_settings,
    "ray-interval": t_ray_interval,
    "ray-larger-models": t_ray_larger_models,
    "ray-one-thread": t_ray_one_thread,
    "ray-routing": t_ray_routing,
    "ray-server-itl": t_ray_server_itl,
    "ray-idle": t_ray_idle,
    "gate-heldout": t_gate_heldout,
    "endpoint-probe": t_endpoint_probe,
    "kv-dtype-agreement": t_kv_dtype_agreement,
    "cuda-timings": t_cuda_timings,
    "crossover": t_crossover,
}

# ---------------------------------------------------------------- documents

MARKER = re.compile(r"^(?P<indent>[ \t]*)<!-- table:(?P<name>[A-Za-z0-9_.-]+) -->[ \t]*\n"
                    r"(?P<body>.*?)"
                    r"^(?P=indent)<!-- /table:(?P=name) -->[ \t]*$", re.M | re.S)
ANY_MARKER = re.compile(r"<!-- (/?)table:([^ ]*) -->")


def render_document(text: str, doc: str, res: Results, tables: dict = TABLES) -> tuple[str, list[str]]:
    """`text` with every marked table rendered, and the names rendered."""
    names: list[str] = []

    def one(m: re.Match) -> str:
        name, indent = m.group("name"), m.group("indent")
        if name not in tables:
            raise RenderError(f"{doc}: marker names no table: {name}")
        names.append(name)
        body = tables[name](res, doc)
        lines = [f"<!-- table:{name} -->"] + body + [f"<!-- /table:{name} -->"]
        return "\n".join((indent + line) if line else "" for line in lines)

    out = MARKER.sub(one, text)
    # A marker the pattern did not pair (a typo, a missing end) is an error, not a silent skip.
    opened = [n for closing, n in ANY_MARKER.findall(text) if not closing]
    closed = [n for closing, n in ANY_MARKER.findall(text) if closing]
    if sorted(opened) != sorted(names) or sorted(closed) != sorted(names):
        raise RenderError(f"{doc}: unpaired table markers: opened {sorted(set(opened) - set(names))}, "
                          f"closed {sorted(set(closed) - set(names))}")
    return out, names


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    s = heading.strip().lower()
    s = re.sub(r"<[^>]+>", "", s)
    s = "".join(ch for ch in s if ch in " -_" or unicodedata.category(ch)[0] in "LN")
    return s.replace(" ", "-")


def anchors(text: str) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    in_code = False
    for line in text.splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if in_code:
            continue
        m = re.match(r"^#{1,6} (.*?)#*\s*$", line)
        if m:
            s = slug(m.group(1))
            n = seen.get(s, 0)
            seen[s] = n + 1
            out.add(s if n == 0 else f"{s}-{n}")
    out.update(re.findall(r'<a (?:id|name)="([^"]+)"', text))
    return out


BENCH_LINK = re.compile(r"\]\((?:[./]*docs/|\./|)BENCHMARKS\.md#([^)\s]+)\)")


def broken_links(root: Path, benchmarks_text: str) -> list[str]:
    known = anchors(benchmarks_text)
    bad = [f"docs/BENCHMARKS.md: no section #{a}" for a in re.findall(r"\]\(#([^)\s]+)\)", benchmarks_text)
           if a not in known]
    for pattern in LINKING_DOCUMENTS:
        for path in sorted(root.glob(pattern)):
            text = path.read_text()
            for m in BENCH_LINK.finditer(text):
                if m.group(1) not in known:
                    bad.append(f"{path.relative_to(root)}: no section #{m.group(1)} in docs/BENCHMARKS.md")
    return bad


def run(root: Path, check: bool) -> int:
    res = Results(root)
    rendered: list[str] = []
    stale = []
    new_texts = {}
    for doc in DOCUMENTS:
        path = root / doc
        text = path.read_text()
        new, names = render_document(text, doc, res)
        rendered += names
        new_texts[doc] = new
        if new != text:
            stale.append(doc)
    problems = [f"table {n} is rendered into no document" for n in TABLES if n not in rendered]
    problems += broken_links(root, new_texts["docs/BENCHMARKS.md"])
    for p in problems:
        print(p, file=sys.stderr)
    if check:
        for doc in stale:
            print(f"{doc} differs from what benches/render_benchmarks.py writes: run it and commit the result",
                  file=sys.stderr)
        return 1 if stale or problems else 0
    for doc in stale:
        (root / doc).write_text(new_texts[doc])
        print(f"rewrote {doc}")
    return 1 if problems else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 if a document is not as rendered")
    ap.add_argument("--root", type=Path, default=ROOT, help="the repository root (default: this script's)")
    args = ap.parse_args(argv)
    try:
        return run(args.root, args.check)
    except RenderError as e:
        print(f"render_benchmarks: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
