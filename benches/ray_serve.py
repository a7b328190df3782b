"""Replicas on Ray Serve against ``candle-gate serve`` directly, side by side in one run.

    pip install ".[ray,test]"
    python benches/ray_serve.py [--model NAME] [--concurrency 1,8] [--prompts 8] [--max-tokens 32]
        [--rounds 1] [--setups serve,ray,...] [--conversations 8] [--turns 4] [--turn-tokens 200]
        [--parts overhead,routing,idle] [--json OUT]

Two parts (and a third, below), every request a streamed chat completion at temperature 0
through the official ``openai`` client, every server started here on loopback:

* **overhead and scaling** (``benches/serve_load.py``'s request set and measures): ``candle-gate
  serve`` with 2 threads; the Ray app with 1 replica of 2 threads (the cost of Ray's proxy and
  router) with candle-gate's settings (``candle_gate.ray.SERVE_ENV`` and a 50 ms stream
  interval), with the stream interval at 0, and with Ray's defaults; the Ray app with 2 replicas
  of 1 thread each. On a 2-core machine the two replicas share the two cores: that measures the
  fleet's mechanics, not added capacity. ``--setups`` picks some of them. Beside the client's
  measures, the server's own mean inter-token time (its ``/metrics``): a ratio above 1 there is
  time lost inside the engine's process (CPU shared with Ray's), not in the proxy.
* **routing**: the 2-replica app, ``--conversations`` multi-turn chats (each turn about
  ``--turn-tokens`` tokens of prose plus the answer, one client per conversation, each sending its
  own ``x-session-id``), with ``--routing session`` (a session keeps its replica) and ``--routing
  pow2`` (Ray's default): total time, TTFT per turn, and the share of prompt tokens served from
  a prefix cache (``usage.prompt_tokens_details.cached_tokens``).

``--parts idle`` measures what an idle Ray app's processes take from the machine's CPU (every
process's time from /proc, in cores), with candle-gate's control loop interval and Ray's default.

Numbers are printed, never asserted; run it with nothing else on the machine.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any, Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import candle_gate  # noqa: E402
import candle_gate.ray  # noqa: E402
from candle_gate.bench import bench_prompt  # noqa: E402
from candle_gate.cli import parse_concurrency  # noqa: E402
import prefix_cache  # noqa: E402
from prefix_cache import pct, run_chats  # noqa: E402
from serve_load import free_port, level, one_request, stop, wait_ready  # noqa: E402


def start(label: str, model: str, port: int, extra: List[str], env: Optional[Dict[str, str]] = None) -> Any:
    import subprocess
    cmd = [sys.executable, "-m", "candle_gate", "serve", "--model", model, "--port", str(port),
           "--served-model-name", "bench-model", "--max-num-seqs", "16", "--max-queue", "1024", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, **(env or {})})
    try:
        wait_ready(f"http://127.0.0.1:{port}/health", proc, 600)
    except BaseException:
        stop(proc, 120)
        raise
    print(f"# {label}: {' '.join(cmd[3:])}", flush=True)
    return proc


#: Ray Serve's own defaults for the settings ``candle_gate.ray.SERVE_ENV`` changes: the setup that
#: shows what those settings buy
RAY_DEFAULTS = {"RAY_SERVE_USE_GRPC_BY_DEFAULT": "0", "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "1",
                "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "1", "RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE": "1",
                "RAY_SERVE_LOG_TO_STDERR": "1", "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.1"}
assert set(RAY_DEFAULTS) == set(candle_gate.ray.SERVE_ENV), "RAY_DEFAULTS must undo every SERVE_ENV setting"


def setups_for(threads: int) -> List[tuple]:
    """(key, label, serve flags, environment): ``candle-gate serve``, the Ray app with
    candle-gate's settings, without its stream interval, with Ray's defaults (and no stream
    interval), each with ``threads`` engine threads; and two replicas of one thread."""
    t = str(threads)
    return [("serve", f"serve, {t} threads", ["--threads", t], None),
            ("ray", f"ray, 1 replica x {t} threads", ["--replicas", "1", "--threads", t], None),
            ("ray-unbatched", f"ray, 1 x {t}, stream interval 0",
             ["--replicas", "1", "--threads", t, "--stream-interval-ms", "0"], None),
            ("ray-defaults", f"ray defaults, 1 x {t} threads",
             ["--replicas", "1", "--threads", t, "--stream-interval-ms", "0"], RAY_DEFAULTS),
            ("ray-2x1", "ray, 2 replicas x 1 thread", ["--replicas", "2", "--threads", "1"], None)]


SETUPS = setups_for(2)


def client(port: int, session: str = ""):
    import openai
    headers = {"x-session-id": session} if session else None
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=3600,
                         default_headers=headers)


#: the server histogram whose mean is a stream's inter-token time
ITL = "candle_gate:inter_token_latency_seconds"


def server_itl(port: int) -> tuple:
    """The server's own ``candle_gate:inter_token_latency_seconds`` (sum, count) from its
    /metrics (through Ray's proxy, the one replica's): where a token's time goes inside the
    engine's process, before any proxy."""
    import httpx
    from candle_gate.server.metrics import samples
    got = {name: v for name, _, v in samples(httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text)}
    return got.get(f"{ITL}_sum", 0.0), got.get(f"{ITL}_count", 0.0)


def overhead(a: argparse.Namespace) -> Dict[str, Any]:
    cs = parse_concurrency(a.concurrency)
    chats = [bench_prompt(i) for i in range(a.prompts)]
    order = [i for i in range(a.prompts) for _ in range(a.repeats)]
    setups = [s for s in setups_for(a.threads) if s[0] in a.setups.split(",")]
    if not setups or setups[0][0] != "serve":
        raise SystemExit(f"--setups: serve first, then any of {', '.join(s[0] for s in SETUPS[1:])}")
    setups = [(label, extra, env) for _, label, extra, env in setups]
    # rows[label][round][level]: the setups alternate within each round, so that each ratio pairs
    # runs minutes apart rather than a whole bench apart (this host's bandwidth drifts).
    rows: Dict[str, List[List[Dict[str, Any]]]] = {label: [] for label, _, _ in setups}
    for rnd in range(a.rounds):
        for label, extra, env in setups:
            port = free_port()
            proc = start(label, a.model, port, extra, env)
            try:
                c = client(port)
                one_request(c, "bench-model", chats[0], 4)  # warm-up
                rows[label].append([])
                for n in cs:
                    s0, c0 = server_itl(port)
                    r = level(c, "bench-model", chats, order, n, a.max_tokens)
                    s1, c1 = server_itl(port)
                    r["server_itl_mean"] = (s1 - s0) / max(c1 - c0, 1)
                    r.pop("texts")
                    rows[label][-1].append(r)
                    print(f"  round {rnd + 1} {label:28s} c={n:<3} {r['tok_per_s']:7.1f} tok/s  TTFT p50 "
                          f"{1e3 * r['ttft_p50']:7.1f} ms p99 {1e3 * r['ttft_p99']:7.1f} ms  ITL p50 "
                          f"{1e3 * r['itl_p50']:6.1f} ms  server's ITL mean {1e3 * r['server_itl_mean']:6.1f} ms",
                          flush=True)
            finally:
                stop(proc, 120)
    base = rows[setups[0][0]]
    print("# against `candle-gate serve` in the same round: the median over rounds (and each round)")
    for label, rounds in rows.items():
        for i, n in enumerate(cs):
            ratio = [r[i]["tok_per_s"] / b[i]["tok_per_s"] for b, r in zip(base, rounds)]
            ttft = [1e3 * (r[i]["ttft_p50"] - b[i]["ttft_p50"]) for b, r in zip(base, rounds)]
            itl = [r[i]["server_itl_mean"] / b[i]["server_itl_mean"] for b, r in zip(base, rounds)]
            print(f"  {label:28s} c={n:<3} tok/s {statistics.median(ratio):.2f}x serve's "
                  f"({', '.join(f'{x:.2f}' for x in ratio)}), TTFT p50 {statistics.median(ttft):+.1f} ms "
                  f"({', '.join(f'{x:+.0f}' for x in ttft)}), server's own ITL {statistics.median(itl):.2f}x "
                  f"({', '.join(f'{x:.2f}' for x in itl)})")
    return rows


def cpu_seconds() -> Dict[int, float]:
    """Every process's user + system CPU seconds so far (Linux /proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        out[int(pid)] = (int(fields[11]) + int(fields[12])) / tick
    return out


def idle(a: argparse.Namespace) -> Dict[str, Any]:
    """The CPU an idle Ray app takes from the machine (every process but this one, in cores),
    with ``SERVE_ENV``'s control loop interval and with Ray's default, alternating rounds."""
    key = "RAY_SERVE_CONTROL_LOOP_INTERVAL_S"
    setups = [(f"control loop {candle_gate.ray.SERVE_ENV[key]} s (SERVE_ENV)", None),
              (f"control loop {RAY_DEFAULTS[key]} s (Ray's default)", {key: RAY_DEFAULTS[key]})]
    out: Dict[str, List[float]] = {label: [] for label, _ in setups}
    for rnd in range(a.rounds):
        for label, env in setups:
            proc = start(label, a.model, free_port(), ["--replicas", "1", "--threads", "2"], env)
            try:
                time.sleep(10)  # past the deployment's start
                t0, c0 = time.monotonic(), cpu_seconds()
                time.sleep(a.idle_seconds)
                t1, c1 = time.monotonic(), cpu_seconds()
            finally:
                stop(proc, 120)
            used = sum(c1[p] - c0.get(p, 0.0) for p in c1 if p != os.getpid()) / (t1 - t0)
            out[label].append(used)
            print(f"  round {rnd + 1} {label:36s} idle: {100 * used:5.1f}% of one core", flush=True)
    for label, used in out.items():
        print(f"  {label:36s} median {100 * statistics.median(used):5.1f}% of one core", flush=True)
    return out


def routing(a: argparse.Namespace) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for mode in ("session", "pow2"):
        port = free_port()
        proc = start(f"ray, 2 replicas, routing {mode}", a.model, port,
                     ["--replicas", "2", "--threads", "1", "--routing", mode])
        try:
            prefix_cache.MODEL[0] = "bench-model"  # the served name
            t0 = time.perf_counter()
            res = run_chats(None, a, lambda c, port=port: client(port, f"conversation-{c}"))
            total = time.perf_counter() - t0
        finally:
            stop(proc, 120)
        later = [r for conv in res for r in conv[1:]]
        ttft = [[conv[t]["ttft"] for conv in res] for t in range(a.turns)]
        cached = sum(r["cached"] or 0 for r in later)
        # Prompt tokens of turns 2..: what a perfect prefix cache could have served is at least
        # the previous turns' history; report the share of all later-turn prompt tokens cached.
        prompt = sum(r.get("prompt_tokens") or 0 for r in later)
        out[mode] = {"total_s": total, "ttft_p50_by_turn": [pct(x, 50) for x in ttft],
                     "cached_tokens_later_turns": cached, "prompt_tokens_later_turns": prompt}
        print(f"  routing {mode:8s} total {total:6.1f} s  TTFT p50 turn 1 {out[mode]['ttft_p50_by_turn'][0]:.3f} s, "
              f"turn {a.turns} {out[mode]['ttft_p50_by_turn'][-1]:.3f} s  cached tokens in turns 2-{a.turns}: "
              f"{cached}" + (f" of {prompt} ({cached / prompt:.0%})" if prompt else ""), flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=candle_gate.DEFAULT_MODEL)
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=1, help="alternating rounds of the overhead setups")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--turn-tokens", type=int, default=200)
    ap.add_argument("--parts", default="overhead,routing", help="any of overhead, routing, idle")
    ap.add_argument("--idle-seconds", type=float, default=20.0, help="the idle part's sampling window")
    ap.add_argument("--setups", default=",".join(s[0] for s in SETUPS),
                    help="the overhead part's setups: serve, then any of " + ", ".join(s[0] for s in SETUPS[1:]))
    ap.add_argument("--threads", type=int, default=2,
                    help="the engine's threads in the overhead part's serve and one-replica setups (1 leaves "
                         "Ray's processes a core of their own on a 2-core machine)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    print(f"# {a.model}, {os.cpu_count()} CPUs", flush=True)
    report: Dict[str, Any] = {"model": a.model, "args": vars(a)}
    if "overhead" in a.parts:
        report["overhead"] = overhead(a)
    if "routing" in a.parts:
        report["routing"] = routing(a)
    if "idle" in a.parts:
        report["idle"] = idle(a)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
