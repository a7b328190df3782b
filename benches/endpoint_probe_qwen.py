"""The endpoint probe against four servers on the same Qwen2.5-Coder 0.5B GGUF.

    pip install ".[serve,endpoint]" "llama-cpp-python[server]"
    python benches/endpoint_probe_qwen.py [--gated-profile PROFILE.json]    # the full run (long)
    python benches/endpoint_probe_qwen.py --prompts 2 --repeats 2 --max-tokens 4 --concurrency 1,2   # smoke

One after the other, each on loopback with 2 threads (started and stopped with the helpers of
benches/serve_load.py), and probed by ``candle_gate.probe.endpoint.probe_endpoint`` with the same
settings (chat completions at temperature 0 with top-2 logprobs; every prompt ``--repeats`` times
alone, in a burst and interleaved at each ``--concurrency``; docs/ENDPOINT_PROBE.md):

* ``native``: ``candle-gate serve --mode native`` (gate off): Candle's own dispatch, whose Q4_K /
  Q6_K paths change bits with the row count;
* ``invariant``: ``candle-gate serve --mode invariant``;
* ``gated``: ``candle-gate serve --mode native --gate gated`` (with ``--profile P`` when
  ``--gated-profile P`` is given; else the calibration the engine finds: the user's profile, then
  the one shipped in the package);
* ``llama.cpp``: ``python -m llama_cpp.server`` (llama-cpp-python) on the same GGUF.

Prompts: the first ``--prompts`` held-out chats of tests/data/heldout_chats.json. Writes one
JSON (``--json``; each server's summary, its command and the probe's full report, rewritten
after each server) and prints a side-by-side table: prompts with more than one distinct
completion, the most distinct completions of a prompt, the mean majority share (K/N), the first
divergence positions, the logprob gap there, the fingerprints seen, errors and wall time (and
candle-gate's gate counters from /metrics). Nothing is asserted; run the full benchmark with nothing else on the machine.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from serve_load import free_port, server_command, start, stop  # noqa: E402

import candle_gate  # noqa: E402
from candle_gate.probe import endpoint as ep  # noqa: E402
from candle_gate.cli import parse_concurrency  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
MODEL = "qwen2.5-coder-0.5b-instruct-q4_k_m"
PROMPTS = os.path.join(HERE, "..", "tests", "data", "heldout_chats.json")
OUT = os.path.join(HERE, "results", "endpoint-probe-qwen05.json")
SERVERS = ("native", "invariant", "gated", "llama.cpp")
FORMAT = "candle-gate endpoint probe bench 1"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def server_spec(name: str, gated_profile: Optional[str]) -> Tuple[Optional[Tuple[str, List[str]]], Optional[str]]:
    """(kind, candle-gate flags) for a server name, or (None, why it is skipped)."""
    if name == "native":
        return ("candle-gate", ["--mode", "native", "--gate", "off"]), None
    if name == "invariant":
        return ("candle-gate", ["--mode", "invariant", "--gate", "off"]), None
    if name == "gated":
        # Without a profile the engine takes the first calibration for this model in native mode
        # from the user's profile, then the package's (the server prints which).
        if not gated_profile:
            return ("candle-gate", ["--mode", "native", "--gate", "gated"]), None
        if not os.path.exists(gated_profile):
            return None, f"--gated-profile {gated_profile} does not exist"
        return ("candle-gate", ["--mode", "native", "--gate", "gated", "--profile", os.path.abspath(gated_profile)]), None
    if name == "llama.cpp":
        try:
            import llama_cpp.server.app  # noqa: F401
        except ImportError as e:
            return None, f"llama-cpp-python's server is not installed ({e}); pip install 'llama-cpp-python[server]'"
        return ("llama.cpp", []), None
    raise ValueError(f"unknown server {name!r}; choose from {', '.join(SERVERS)}")


def gate_metrics(port: int) -> Optional[Dict[str, int]]:
    """candle-gate's gate counters from /metrics (None when the server has none)."""
    import httpx
    try:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    except httpx.HTTPError:
        return None
    from candle_gate.server.metrics import GATE_COUNTERS, samples
    got = {name: v for name, _, v in samples(text)}
    out = {k: int(got[f"candle_gate:gate_{k}_total"]) for k in GATE_COUNTERS if f"candle_gate:gate_{k}_total" in got}
    return out or None


def summarize(report: Dict[str, Any]) -> Dict[str, Any]:
    """The numbers of the table, from one probe report."""
    prompts = report["prompts"]
    scored = [e for e in prompts if e["n"] > 0]
    flipped = [e for e in prompts if e["distinct"] > 1]
    gaps = [e["gap_at_divergence"] for e in flipped if e["gap_at_divergence"] is not None]
    per_c: Dict[str, int] = {}
    for e in prompts:
        for c, v in e["by_concurrency"].items():
            per_c[c] = per_c.get(c, 0) + (v["distinct"] > 1)
    return {
        "prompts": len(prompts),
        "prompts_flipped": len(flipped),
        "max_distinct": max((e["distinct"] for e in prompts), default=0),
        "mean_majority_share": (statistics.fmean(e["k_of_n"][0] / e["k_of_n"][1] for e in scored)
                                if scored else None),
        "prose_flips": report["prose_flips"],
        "divergences": [{"prompt": e["index"], "position": e["first_divergence"], "unit": e["divergence_unit"],
                         "gap": e["gap_at_divergence"], "distinct": e["distinct"], "k_of_n": e["k_of_n"]}
                        for e in flipped],
        "gap_at_divergence": ({"min": min(gaps), "median": statistics.median(gaps), "max": max(gaps)}
                              if gaps else None),
        "prompts_flipped_by_concurrency": per_c,
        "fingerprints": report["fingerprints"],
        "fingerprint_change": report["fingerprint_change"],
        "flip_under_one_fingerprint": report["flip_under_one_fingerprint"],
        "errors": report["errors"],
        "requests": report["requests"],
        "retries": report["retries"],
        "logprobs": report["logprobs"],
        "wall_s": report["elapsed_s"],
    }


def _positions(s: Dict[str, Any], limit: int = 6) -> str:
    """The prompts' first divergence positions, smallest first (``12t``: tokens, ``40c``: chars)."""
    divs = sorted(s["divergences"], key=lambda d: (d["unit"] != "tokens", d["position"]))
    if not divs:
        return "-"
    xs = [f"{d['position']}{'t' if d['unit'] == 'tokens' else 'c'}" for d in divs]
    return ",".join(xs[:limit]) + (f",+{len(xs) - limit}" if len(xs) > limit else "")


def requests_per_server(n_prompts: int, repeats: int, levels: Sequence[int], orders: Sequence[str]) -> int:
    """As probe_endpoint schedules them (docs/ENDPOINT_PROBE.md, "The load")."""
    passes = ("alone" in orders) + sum(("burst" in orders and not (c == 1 and "alone" in orders))
                                       + ("interleaved" in orders) for c in levels)
    return n_prompts * repeats * passes


def format_table(servers: Dict[str, Any]) -> str:
    names = list(servers)
    rows: List[List[str]] = [["", *names]]

    def cell(name: str, f) -> str:
        e = servers[name]
        if "summary" not in e:
            return "skipped" if "skipped" in e else "failed"
        return f(e["summary"])

    def gap(s: Dict[str, Any]) -> str:
        g = s["gap_at_divergence"]
        if g is None:
            return "-"
        return f"{g['min']:.3f}/{g['median']:.3f}/{g['max']:.3f}"

    def fps(s: Dict[str, Any]) -> str:
        f = s["fingerprints"]
        return f"{len(f)}" + (f" ({f[0][:11]})" if len(f) == 1 and f[0] != "None" else (" (none)" if f == ["None"] else ""))

    spec = [
        ("prompts >1 distinct", lambda s: f"{s['prompts_flipped']}/{s['prompts']}"),
        ("  within one concurrency", lambda s: " ".join(f"{c}:{v}" for c, v in s["prompts_flipped_by_concurrency"].items())),
        ("max distinct", lambda s: str(s["max_distinct"])),
        ("mean majority share", lambda s: "-" if s["mean_majority_share"] is None else f"{s['mean_majority_share']:.3f}"),
        ("first divergence at", _positions),
        ("gap min/med/max", gap),
        ("fingerprints", fps),
        ("errors / requests", lambda s: f"{s['errors']}/{s['requests']}"),
        ("wall s (probe)", lambda s: f"{s['wall_s']:.1f}"),
    ]
    for label, f in spec:
        rows.append([label, *[cell(n, f) for n in names]])
    rows.append(["server start s", *[f"{servers[n]['startup_s']:.1f}" if "startup_s" in servers[n] else "-"
                                     for n in names]])
    rows.append(["gate rechecks/steps", *[f"{servers[n]['gate']['rechecks']}/{servers[n]['gate']['steps']}"
                                          if (servers[n].get("gate") or {}).get("steps") is not None else "-"
                                          for n in names]])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(x.ljust(w) for x, w in zip(r, widths)).rstrip() for r in rows]
    for n in names:
        e = servers[n]
        if "skipped" in e:
            lines.append(f"{n}: skipped: {e['skipped']}")
        elif "error" in e:
            lines.append(f"{n}: failed: {e['error']}")
        elif e["summary"]["logprobs"]["note"]:
            lines.append(f"{n}: {e['summary']['logprobs']['note']}")
    return "\n".join(lines)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=MODEL, help=f"a model known to `candle-gate fetch` or a .gguf path (default {MODEL})")
    ap.add_argument("--prompts", type=int, default=24, help="the first N held-out chats (default 24)")
    ap.add_argument("--prompts-file", default=PROMPTS)
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--concurrency", default="1,4,8")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--orders", default=None, help="subset of alone,burst,interleaved (default all)")
    ap.add_argument("--stream", action="store_true", help="streaming requests")
    ap.add_argument("--gated-profile", default=None, metavar="P",
                    help="the profile for the gated server (--mode native --gate gated --profile P); "
                         "default: the engine's own lookup (the user's profile, then the package's)")
    ap.add_argument("--servers", default=",".join(SERVERS), help=f"a subset of {','.join(SERVERS)}")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--log-dir", default=None, help="the servers' output (default: a new temporary directory)")
    ap.add_argument("--json", default=OUT, help=f"default {os.path.relpath(OUT)}")
    a = ap.parse_args(argv)
    if a.prompts < 1 or a.repeats < 1 or a.max_tokens < 1:
        ap.error("--prompts, --repeats and --max-tokens must be positive")
    try:
        a.concurrency = parse_concurrency(a.concurrency)
        a.orders = ep.parse_orders(a.orders)
    except ValueError as e:
        ap.error(str(e))
    a.servers = [x.strip() for x in a.servers.split(",") if x.strip()]
    bad = [x for x in a.servers if x not in SERVERS]
    if bad or not a.servers:
        ap.error(f"--servers: unknown {bad or a.servers}; choose from {','.join(SERVERS)}")
    return a


def main(argv: Optional[Sequence[str]] = None) -> int:
    a = parse_args(argv)
    from candle_gate.probe import load_prompts
    prompts = load_prompts(a.prompts_file)
    if a.prompts > len(prompts):
        print(f"--prompts {a.prompts}: {a.prompts_file} holds {len(prompts)}", file=sys.stderr)
        return 2
    prompts = prompts[:a.prompts]
    path = str(candle_gate.resolve(a.model))
    name = MODEL if a.model == MODEL else os.path.splitext(os.path.basename(path))[0]
    log_dir = a.log_dir or tempfile.mkdtemp(prefix="endpoint-probe-logs-")
    os.makedirs(log_dir, exist_ok=True)
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
    settings = {"prompts": a.prompts, "prompts_file": os.path.relpath(a.prompts_file), "repeats": a.repeats,
                "concurrency": a.concurrency, "orders": a.orders, "max_tokens": a.max_tokens, "temperature": 0.0,
                "top_logprobs": ep.DEFAULT_TOP_LOGPROBS, "stream": a.stream, "threads": a.threads}
    out: Dict[str, Any] = {"format": FORMAT, "model": a.model, "gguf": path, "served_model_name": name,
                           "settings": settings, "host": {"cpus": os.cpu_count(), "platform": sys.platform},
                           "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "servers": {}}
    total = requests_per_server(len(prompts), a.repeats, a.concurrency, a.orders)
    log(f"{len(prompts)} prompts x {a.repeats} repeats, concurrency {','.join(map(str, a.concurrency))}, "
        f"max_tokens {a.max_tokens}{', streaming' if a.stream else ''}: {total} requests per server; "
        f"servers {', '.join(a.servers)}; server logs in {log_dir}")
    for k, sname in enumerate(a.servers):
        spec, why = server_spec(sname, a.gated_profile)
        if spec is None:
            log(f"[{k + 1}/{len(a.servers)}] {sname}: skipped: {why}")
            out["servers"][sname] = {"skipped": why}
            continue
        kind, flags = spec
        port = free_port()
        cmd, _ = server_command(kind, path, name, port, flags, a.threads)
        entry: Dict[str, Any] = {"kind": kind, "command": cmd, "log": os.path.join(log_dir, f"{sname}.log")}
        log(f"[{k + 1}/{len(a.servers)}] {sname}: starting {' '.join(cmd[1:])}")
        t0 = time.time()
        try:
            proc = start(kind, path, name, port, flags, a.threads, log=entry["log"])
        except Exception as e:
            entry["error"] = f"did not start: {e} (log: {entry['log']})"
            log(f"{sname}: {entry['error']}")
            out["servers"][sname] = entry
            continue
        entry["startup_s"] = round(time.time() - t0, 1)
        log(f"{sname}: ready after {entry['startup_s']} s; probing ({total} requests)")
        try:
            report = ep.probe_endpoint(f"http://127.0.0.1:{port}/v1", name, prompts, repeats=a.repeats,
                                       concurrency=a.concurrency, max_tokens=a.max_tokens, temperature=0.0,
                                       orders=a.orders, stream=a.stream, timeout=600, progress=True)
            if kind == "candle-gate":
                entry["gate"] = gate_metrics(port)
        except Exception as e:
            entry["error"] = f"{type(e).__name__}: {e}"
            log(f"{sname}: the probe failed: {entry['error']}")
        finally:
            stop(proc)
        if "error" not in entry:
            entry["summary"] = summarize(report)
            entry["report"] = report
            s = entry["summary"]
            log(f"{sname}: {s['prompts_flipped']}/{s['prompts']} prompts with >1 distinct completion, "
                f"max distinct {s['max_distinct']}, errors {s['errors']}/{s['requests']}, {s['wall_s']:.1f} s")
        out["servers"][sname] = entry
        if a.json:
            ep.write_json(out, a.json)
    out["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    print(format_table(out["servers"]))
    if a.json:
        ep.write_json(out, a.json)
        log(f"written to {a.json}")
    return 0 if any("summary" in e for e in out["servers"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
