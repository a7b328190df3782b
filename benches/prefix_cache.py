"""Prefix caching through the server, side by side in one run: candle-gate with its prefix cache,
candle-gate without it (``--no-prefix-cache``), and optionally llama.cpp's own ``llama-server``
(``--llama-server PATH``, built by ``benches/build_llama_server.sh``; its prompt cache on, as by
default, ``--parallel`` = the number of clients).

    pip install ".[serve,test]"
    python benches/prefix_cache.py [--model qwen2.5-coder-0.5b-instruct-q4_k_m]
        [--workloads chat,system,itl] [--conversations 8] [--turns 8] [--turn-tokens 340]
        [--questions 32] [--clients 8] [--system-tokens 1000] [--llama-server PATH] [--json OUT]

Workloads (every request streamed at temperature 0 by the official ``openai`` client):

* ``chat``: ``--conversations`` conversations of ``--turns`` turns run by as many clients, each
  turn a user message of about ``--turn-tokens`` tokens plus the model's answer, so the history
  grows to about turns x (turn-tokens + max-tokens). Then the same conversations are replayed
  (warm). Reports time to first token per turn (p50/p95 over conversations), turn-last over
  turn-1 TTFT, total time, prompt tokens served from the cache (``usage.prompt_tokens_details
  .cached_tokens``), and per request the distinct completions over the two passes (1: the
  cache did not change the answer).
* ``system``: one system prompt of ``--system-tokens`` tokens, ``--questions`` different
  questions from ``--clients`` clients: throughput and TTFT.
* ``itl``: inter-token latency (p50/p99) of one decoding stream alone, and while another
  request prefills a long prompt, at the server's default per-step budget and at
  ``--max-tokens-per-step 64``.

Numbers are printed, never asserted; run it with nothing else on the machine.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, List

import numpy as np

import candle_gate


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server process on loopback, ready when its /health answers 200."""

    def __init__(self, name: str, cmd: List[str], port: int):
        import httpx
        self.name, self.port = name, port
        self.url = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        t0 = time.time()
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {self.proc.returncode}: {' '.join(cmd)}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.time() - t0 > 600:
                self.stop()
                raise RuntimeError(f"{name} did not become healthy")
            time.sleep(0.3)

    def client(self):
        import openai
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=3600)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def start(kind: str, a: argparse.Namespace, gguf: str, extra: List[str] = ()) -> Server:
    port = free_port()
    if kind == "llama.cpp":
        cmd = [a.llama_server, "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "-t", str(a.threads),
               "--parallel", str(a.clients), "-c", str(a.clients * a.context_per_client), "--no-webui"]
    else:
        cmd = [sys.executable, "-m", "candle_gate", "serve", "--model", a.model, "--port", str(port),
               "--threads", str(a.threads), "--max-num-seqs", str(max(16, a.clients)), "--max-queue", "1024",
               *(["--no-prefix-cache"] if kind == "candle-gate (no cache)" else []), *extra]
    return Server(kind, cmd, port)


def paragraph(tokens: int, seed: int) -> str:
    """About `tokens` tokens of plain prose, different for every seed."""
    words, i = [], seed
    while len(words) * 1.3 < tokens:
        words += (f"Item {i}: the warehouse in district {i * 7 % 31} shipped {i * 13 % 97 + 3} crates of "
                  f"parts on day {i % 28 + 1}, and the night shift logged {i * 11 % 17} delays.").split()
        i += 1
    return " ".join(words)


#: the model's name in requests (candle-gate checks it; llama-server takes any)
MODEL = ["default"]


def stream_chat(client: Any, messages: List[Dict[str, str]], max_tokens: int) -> Dict[str, Any]:
    """One streamed chat completion: its text, TTFT, inter-token gaps and cached tokens."""
    t0 = time.perf_counter()
    first, last, gaps, parts, cached, prompt = None, None, [], [], None, None
    stream = client.chat.completions.create(model=MODEL[0], messages=messages, max_tokens=max_tokens, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    for ch in stream:
        if ch.usage is not None:
            prompt = ch.usage.prompt_tokens
            d = getattr(ch.usage, "prompt_tokens_details", None)
            cached = getattr(d, "cached_tokens", None) if d is not None else None
        if ch.choices and ch.choices[0].delta.content:
            now = time.perf_counter()
            if first is None:
                first = now
            else:
                gaps.append(now - last)
            last = now
            parts.append(ch.choices[0].delta.content)
    end = time.perf_counter()
    return {"text": "".join(parts), "ttft": (first or end) - t0, "gaps": gaps, "cached": cached, "e2e": end - t0,
            "prompt_tokens": prompt}


def pct(xs: List[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else float("nan")


def run_chats(server: Any, a: argparse.Namespace, client_for: Any = None) -> List[List[Dict[str, Any]]]:
    """Every conversation, turn by turn, one client each (``client_for(c)``, default the server's
    client): per conversation, per turn, the result."""
    def one(c: int) -> List[Dict[str, Any]]:
        client, history, out = (client_for(c) if client_for else server.client()), [], []
        for t in range(a.turns):
            history.append({"role": "user", "content": paragraph(a.turn_tokens, 1000 * c + 37 * t) +
                            f"\nQuestion {t}: which district shipped the most crates so far?"})
            r = stream_chat(client, history, a.max_tokens)
            history.append({"role": "assistant", "content": r["text"]})
            out.append(r)
        return out
    with ThreadPoolExecutor(a.conversations) as ex:
        return list(ex.map(one, range(a.conversations)))


def chat_workload(servers: List[Server], a: argparse.Namespace) -> Dict[str, Any]:
    rows: Dict[str, Any] = {}
    texts: Dict[str, List[List[List[str]]]] = {}
    for s in servers:
        passes = 1 if "no cache" in s.name else 2
        for p in range(passes):
            t0 = time.perf_counter()
            res = run_chats(s, a)
            total = time.perf_counter() - t0
            ttft = [[res[c][t]["ttft"] for c in range(a.conversations)] for t in range(a.turns)]
            cached = [r["cached"] for conv in res for r in conv]
            label = f"{s.name} {'cold' if p == 0 else 'warm replay'}"
            rows[label] = {
                "total_s": total,
                "ttft_p50_by_turn": [pct(x, 50) for x in ttft],
                "ttft_p95_by_turn": [pct(x, 95) for x in ttft],
                "cached_tokens": None if any(c is None for c in cached) else int(sum(cached)),
                "tokens": sum(len(r["gaps"]) + 1 for conv in res for r in conv),
            }
            texts.setdefault(s.name, []).append([[r["text"] for r in conv] for conv in res])
            r = rows[label]
            print(f"  chat  {label:34s} total {total:7.1f} s  TTFT p50 turn 1 {r['ttft_p50_by_turn'][0]:6.2f} s, "
                  f"turn {a.turns} {r['ttft_p50_by_turn'][-1]:6.2f} s (x{r['ttft_p50_by_turn'][-1] / r['ttft_p50_by_turn'][0]:.2f}), "
                  f"p95 turn {a.turns} {r['ttft_p95_by_turn'][-1]:6.2f} s, cached tokens {r['cached_tokens']}", flush=True)
    distinct = {}
    for name, passes in texts.items():
        per_request = [len({p[c][t] for p in passes}) for c in range(a.conversations) for t in range(a.turns)]
        distinct[name] = {"max": max(per_request), "requests_with_more_than_one": sum(d > 1 for d in per_request)}
        print(f"  chat  {name:34s} distinct completions per request over its passes: max {distinct[name]['max']}, "
              f"{distinct[name]['requests_with_more_than_one']} of {len(per_request)} requests with more than one")
    return {"runs": rows, "distinct": distinct}


def system_workload(servers: List[Server], a: argparse.Namespace) -> Dict[str, Any]:
    system = "You answer questions about this log.\n" + paragraph(a.system_tokens, 424242)
    questions = [f"How many crates did district {q % 31} ship on day {q % 28 + 1}? Answer briefly." for q in range(a.questions)]
    rows = {}
    for s in servers:
        client = s.client()
        t0 = time.perf_counter()
        with ThreadPoolExecutor(a.clients) as ex:
            def ask(q: str, client: Any = client) -> Dict[str, Any]:
                return stream_chat(client, [{"role": "system", "content": system}, {"role": "user", "content": q}],
                                   a.max_tokens)
            res = list(ex.map(ask, questions))
        total = time.perf_counter() - t0
        toks = sum(len(r["gaps"]) + 1 for r in res)
        ttft = [r["ttft"] for r in res]
        rows[s.name] = {"total_s": total, "tok_s": toks / total, "ttft_p50": pct(ttft, 50), "ttft_p95": pct(ttft, 95)}
        print(f"  system {s.name:33s} {toks / total:6.1f} tok/s  TTFT p50 {pct(ttft, 50):6.2f} s p95 {pct(ttft, 95):6.2f} s  "
              f"total {total:6.1f} s", flush=True)
    return rows


def itl_workload(a: argparse.Namespace, gguf: str) -> Dict[str, Any]:
    rows = {}
    long_prompt = paragraph(a.long_prompt_tokens, 777)
    for budget in (None, 64):
        extra = [] if budget is None else ["--max-tokens-per-step", str(budget), "--prefill-chunk", str(budget)]
        s = start("candle-gate", a, gguf, extra)
        try:
            client = s.client()
            msgs = [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]
            alone = stream_chat(client, msgs, 128)
            with ThreadPoolExecutor(2) as ex:
                f = ex.submit(stream_chat, client, msgs, 128)
                time.sleep(alone["ttft"] + 0.5)  # the stream is decoding when the long prompt arrives
                g = ex.submit(stream_chat, client, [{"role": "user", "content": long_prompt}], 4)
                busy, long_r = f.result(), g.result()
            label = f"max-tokens-per-step {budget or 256}"
            rows[label] = {"alone_p50": pct(alone["gaps"], 50), "alone_p99": pct(alone["gaps"], 99),
                           "with_prefill_p50": pct(busy["gaps"], 50), "with_prefill_p99": pct(busy["gaps"], 99),
                           "long_prompt_ttft": long_r["ttft"]}
            r = rows[label]
            print(f"  itl   {label:34s} alone p50 {1e3 * r['alone_p50']:6.1f} ms p99 {1e3 * r['alone_p99']:6.1f} ms; "
                  f"beside a {a.long_prompt_tokens}-token prefill p50 {1e3 * r['with_prefill_p50']:6.1f} ms "
                  f"p99 {1e3 * r['with_prefill_p99']:6.1f} ms (its TTFT {r['long_prompt_ttft']:.1f} s)", flush=True)
        finally:
            s.stop()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct-q4_k_m")
    ap.add_argument("--workloads", default="chat,system,itl")
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--turn-tokens", type=int, default=340)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--questions", type=int, default=32)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--system-tokens", type=int, default=1000)
    ap.add_argument("--long-prompt-tokens", type=int, default=3000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-cold", action="store_true", help="skip the server without a prefix cache (the slow one)")
    ap.add_argument("--llama-server", default=None, help="path to llama.cpp's llama-server binary")
    ap.add_argument("--context-per-client", type=int, default=4096, help="llama-server: -c is clients x this")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    gguf = candle_gate.models.resolve(a.model)
    MODEL[0] = a.model
    work = a.workloads.split(",")
    kinds = ["candle-gate"] + ([] if a.no_cold else ["candle-gate (no cache)"]) + (["llama.cpp"] if a.llama_server else [])
    print(f"# {a.model}, {os.cpu_count()} CPUs, {a.threads} threads per server")
    report: Dict[str, Any] = {"model": a.model, "args": vars(a)}
    for w in ("chat", "system"):
        if w not in work:
            continue
        servers = []
        try:
            for k in kinds:
                servers.append(start(k, a, gguf))
            report[w] = (chat_workload if w == "chat" else system_workload)(servers, a)
        finally:
            for s in servers:
                s.stop()
    if "itl" in work:
        report["itl"] = itl_workload(a, gguf)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
