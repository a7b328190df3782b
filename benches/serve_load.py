"""Load benchmark for `candle-gate serve`, side by side with llama.cpp's Python server.

    pip install ".[serve,test]"                      # the server and the openai client
    pip install "llama-cpp-python[server]"            # only for --peer
    python benches/serve_load.py [--model NAME] [--concurrency 1,4,8,16] [--prompts 8] [--repeats 2]
                                 [--max-tokens 32] [--peer] [--json OUT]

Each server is started here on loopback with the same GGUF and 2 threads, and driven by the
same client: the official ``openai`` package, streaming chat completions at temperature 0.
At each concurrency c, c client threads send the same request set (``--prompts`` chats, each
``--repeats`` times, in a fixed shuffled order) and the run reports:

* tok/s: streamed content chunks (one token each on both servers) over the level's wall time;
* time to first token and inter-token latency (between consecutive chunks), p50 and p99;
* distinct: per prompt, the number of distinct completions over every level so far (1 = the
  request got the same answer at every concurrency), as the maximum over prompts.

``candle-gate (in-process)`` is the same requests through ``Engine`` directly, at 1 and at the
largest concurrency, to show what HTTP costs. Nothing is asserted: numbers depend on the
machine; run it with nothing else on it.
"""
from __future__ import annotations

import argparse
import json
import random
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

import candle_gate
from candle_gate.bench import bench_prompt
from candle_gate.cli import parse_concurrency


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 600) -> None:
    import httpx
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            r = httpx.get(url, timeout=2)
        except httpx.HTTPError:
            r = None
        if r is not None and r.status_code == 200:
            return
        if r is not None and r.status_code == 503:  # candle-gate's /health after a failed load
            try:
                body = r.json()
            except ValueError:
                body = None
            if isinstance(body, dict) and body.get("status") == "error":
                raise RuntimeError(f"the server could not load the model: {body.get('error')}")
        time.sleep(0.5)
    raise RuntimeError(f"{url} not ready after {timeout} s")


def server_command(kind: str, model_path: str, name: str, port: int,
                   args: Sequence[str] = ("--mode", "invariant"), threads: int = 2) -> Tuple[List[str], str]:
    """The command line of a server on 127.0.0.1:``port`` and its readiness URL. ``kind``:
    ``candle-gate`` (``args``: its mode/gate/profile flags) or ``llama.cpp`` (llama-cpp-python's
    server on the same GGUF)."""
    if kind == "candle-gate":
        cmd = [sys.executable, "-m", "candle_gate", "serve", "--model", model_path, "--port", str(port),
               "--served-model-name", name, *args, "--max-num-seqs", "16", "--threads", str(threads)]
        return cmd, f"http://127.0.0.1:{port}/health"
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", model_path, "--model_alias", name,
           "--port", str(port), "--n_threads", str(threads), "--n_threads_batch", str(threads), "--n_ctx", "4096",
           # By default a new request cuts off the one streaming (its client sees a short, normal
           # end): queue them instead, as a server under test must.
           "--interrupt_requests", "False", "--verbose", "False"]
    return cmd, f"http://127.0.0.1:{port}/v1/models"


def start(kind: str, model_path: str, name: str, port: int, args: Sequence[str] = ("--mode", "invariant"),
          threads: int = 2, log: Optional[str] = None, timeout: float = 600) -> subprocess.Popen:
    """Starts a server (:func:`server_command`) and waits until it answers; its output goes to
    the file ``log`` (appended) or is discarded. Stopped again if it does not become ready."""
    cmd, health = server_command(kind, model_path, name, port, args, threads)
    out = open(log, "ab") if log else subprocess.DEVNULL
    try:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    finally:
        if log:
            out.close()  # the child has its own copy
    try:
        wait_ready(health, proc, timeout)
    except BaseException:
        stop(proc)
        raise
    return proc


def stop(proc: subprocess.Popen, timeout: float = 60) -> None:
    """SIGTERM, then SIGKILL after ``timeout`` seconds."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def one_request(client, name: str, chat, max_tokens: int) -> Dict[str, Any]:
    t0 = time.perf_counter()
    stream = client.chat.completions.create(model=name, messages=chat, max_tokens=max_tokens, temperature=0,
                                            seed=0, stream=True)
    times, text = [], []
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta and chunk.choices[0].delta.content:
            times.append(time.perf_counter())
            text.append(chunk.choices[0].delta.content)
    return {"t0": t0, "times": times, "text": "".join(text)}


def level(client, name: str, chats, order: List[int], c: int, max_tokens: int) -> Dict[str, Any]:
    t0 = time.perf_counter()
    with ThreadPoolExecutor(c) as pool:
        outs = list(pool.map(lambda i: (i, one_request(client, name, chats[i], max_tokens)), order))
    wall = time.perf_counter() - t0
    tokens = sum(len(o["times"]) for _, o in outs)
    ttft = [o["times"][0] - o["t0"] for _, o in outs if o["times"]]
    itl = [b - a for _, o in outs for a, b in zip(o["times"], o["times"][1:])]
    q = lambda xs, p: float(np.percentile(xs, p)) if xs else float("nan")
    return {"concurrency": c, "tok_per_s": tokens / wall, "tokens": tokens,
            "ttft_p50": q(ttft, 50), "ttft_p99": q(ttft, 99), "itl_p50": q(itl, 50), "itl_p99": q(itl, 99),
            "texts": [(i, o["text"]) for i, o in outs]}


def in_process(model_path: str, chats, order: List[int], c: int, max_tokens: int) -> float:
    eng = candle_gate.Engine(candle_gate.Model.load(model_path), max_num_seqs=16, threads=2)
    t0 = time.perf_counter()
    tokens = 0
    pending = list(order)
    live: set = set()
    while pending or live:
        while pending and len(live) < c:
            live.add(eng.submit(chats[pending.pop(0)], max_new_tokens=max_tokens, chat=True))
        eng.step()
        for ev in eng.events():
            if ev["type"] == "token":
                tokens += 1
            elif ev["type"] == "finished":
                live.discard(ev["id"])
                eng.result(ev["id"])
    return tokens / (time.perf_counter() - t0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=candle_gate.DEFAULT_MODEL)
    ap.add_argument("--concurrency", default="1,4,8,16")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--peer", action="store_true", help="also llama-cpp-python's server")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    import openai
    cs = parse_concurrency(a.concurrency)
    path = str(candle_gate.resolve(a.model))
    name = "bench-model"
    chats = [bench_prompt(i) for i in range(a.prompts)]
    order = [i for i in range(a.prompts) for _ in range(a.repeats)]
    random.Random(0).shuffle(order)
    servers = ["candle-gate"] + (["llama.cpp"] if a.peer else [])
    report: Dict[str, Any] = {"model": a.model, "max_tokens": a.max_tokens, "prompts": a.prompts,
                              "repeats": a.repeats, "servers": {}}
    for kind in servers:
        port = free_port()
        proc = start(kind, path, name, port)
        try:
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0,
                                   timeout=600)
            one_request(client, name, chats[0], 4)  # warm-up
            seen: Dict[int, set] = {i: set() for i in range(a.prompts)}
            rows = []
            for c in cs:
                r = level(client, name, chats, order, c, a.max_tokens)
                for i, t in r.pop("texts"):
                    seen[i].add(t)
                r["distinct_max"] = max(len(v) for v in seen.values())
                rows.append(r)
                print(f"{kind:<12} c={c:<3} {r['tok_per_s']:7.1f} tok/s  ttft p50 {r['ttft_p50']:.3f}s "
                      f"p99 {r['ttft_p99']:.3f}s  itl p50 {1e3 * r['itl_p50']:.1f}ms p99 {1e3 * r['itl_p99']:.1f}ms  "
                      f"distinct {r['distinct_max']}", flush=True)
            report["servers"][kind] = rows
        finally:
            stop(proc)
    ip = {c: in_process(path, chats, order, c, a.max_tokens) for c in sorted({1, max(cs)})}
    report["in_process"] = [{"concurrency": c, "tok_per_s": v} for c, v in ip.items()]
    for c, v in ip.items():
        print(f"{'in-process':<12} c={c:<3} {v:7.1f} tok/s", flush=True)

    print(f"\n{'server':<12} {'c':>3} {'tok/s':>7} {'vs c=1':>7} {'TTFT p50/p99 s':>15} {'ITL p50/p99 ms':>15} {'distinct':>8}")
    for kind, rows in report["servers"].items():
        base = rows[0]["tok_per_s"]
        for r in rows:
            print(f"{kind:<12} {r['concurrency']:>3} {r['tok_per_s']:7.1f} {r['tok_per_s'] / base:6.2f}x "
                  f"{r['ttft_p50']:7.3f}/{r['ttft_p99']:<7.3f} {1e3 * r['itl_p50']:7.1f}/{1e3 * r['itl_p99']:<7.1f} "
                  f"{r['distinct_max']:>8}")
    cg = report["servers"]["candle-gate"]
    one = next((r for r in cg if r["concurrency"] == 1), None)
    if one and 1 in ip:
        print(f"HTTP streaming, one client: {one['tok_per_s']:.1f} tok/s = {one['tok_per_s'] / ip[1]:.2f}x in-process")
    if "llama.cpp" in report["servers"]:
        for a_, b in zip(cg, report["servers"]["llama.cpp"]):
            print(f"c={a_['concurrency']}: candle-gate / llama.cpp = {a_['tok_per_s'] / b['tok_per_s']:.2f}x")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
