"""candle-gate against llama.cpp on the same GGUF, side by side in one run.

    pip install ".[peer]"          # llama-cpp-python, built from source by pip
    python benches/vs_llama_cpp.py [--models smollm2-135m-instruct-q4_1,qwen2.5-coder-0.5b-instruct-q4_k_m]
                                   [--streams 1,8] [--new-tokens 64] [--rounds 2] [--threads 2] [--json OUT]
                                   [--context 1024,4096,16384]

Both engines get the same prompts as the same token ids (candle-gate's tokenizer and chat
template render them once; a base model without a template, such as Gemma 3 270M, gets the same
requests as plain text) and decode greedily. For each model, stream count and round,
candle-gate (``invariant`` mode) and llama.cpp run in alternation, and each reports:

* prefill tok/s: prompt tokens / time to the first token, one stream;
* decode tok/s: tokens generated after every stream's first token / the time that took, summed
  over streams (llama.cpp decodes the streams as one batch of sequences, as its server does).

With ``--context N,...`` each stream's prompt is instead N tokens of running text (the same ids to
both engines, a different text per stream), prefilled in chunks of 512 by both, and llama.cpp runs
twice per round, flash attention off and on, keeping its better figure of the two
(``--llama-flash-attn off`` or ``on`` runs only that one). The bandwidth
line then counts the K/V bytes each decode step reads at that context (f16, both engines' default)
on top of the weights.

After one short warm-up run each (pages the weights in), the table keeps each side's best round and prints candle-gate / llama.cpp. The bandwidth line
divides the weight bytes one decode step reads by the measured single-stream step time and by a
measured read bandwidth (a large ``numpy`` sum on as many threads as the engines use, measured
before the run, before each model and before each single-stream round, the best kept), as the
share of the limit that decode reaches. Because a shared host's bandwidth moves (by a third within
an hour on the Zen 3 VM), each single-stream round's share against the bandwidth read just before
it is printed too; the first figure, the best rate over the best bandwidth, is the conservative one.
Nothing here is asserted: numbers depend on the machine.

On a VM whose CPU reports AMX but faults on AMX tiles (seen on a KVM Xeon: llama.cpp's AMX
buffer type crashes in ``llama_decode``), build llama.cpp without AMX, keeping its AVX-512 VNNI
kernels and weight repacking:

    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
      -DGGML_AVX_VNNI=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON \
      -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" \
      pip install --force-reinstall --no-deps --no-cache-dir llama-cpp-python

The run prints llama.cpp's ``llama_print_system_info()`` and records it in the JSON.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import time
from typing import Dict, List

import numpy as np

import candle_gate
from candle_gate import Engine, Model
from candle_gate.bench import bench_ids


def read_bandwidth_gbs(threads: int) -> float:
    """Read bandwidth with `threads` readers (numpy releases the GIL while it sums), as both
    engines decode with that many threads: one core alone cannot draw the machine's bandwidth."""
    from concurrent.futures import ThreadPoolExecutor

    a = np.ones(1 << 28, dtype=np.uint8)  # 256 MiB, more than any cache
    parts = np.array_split(a.view(np.uint64), threads)
    best = float("inf")
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(np.sum, parts))
        for _ in range(5):
            t = time.perf_counter()
            list(pool.map(np.sum, parts))
            best = min(best, time.perf_counter() - t)
    return a.nbytes / best / 1e9


def prompts(model: Model, n: int) -> List[List[int]]:
    return [bench_ids(model, i) for i in range(n)]


def long_prompt(model: Model, n: int, salt: int) -> List[int]:
    """n tokens of running text (a paragraph whose numbers change each time)."""
    parts, i = [], salt * 10007
    while True:
        chunk = [f"Section {i + j}. The river rose {(i + j) * 7 % 93} centimetres overnight, and the "
                 f"{(i + j) * 13 % 41 + 2} families on the east bank moved their belongings to the school on the "
                 f"hill, where volunteers served soup until {(i + j) % 12 + 1} o'clock. " for j in range(64)]
        parts.extend(chunk)
        i += 64
        ids = model.tokenize("".join(parts))
        if len(ids) >= n:
            return ids[:n]


def candle_gate_run(model: Model, toks: List[List[int]], new_tokens: int, threads: int,
                    chunk: int = 4096) -> Dict[str, float]:
    longest = max(len(t) for t in toks)
    eng = Engine(model, mode="invariant", max_num_seqs=max(16, len(toks)), max_tokens_per_step=chunk + len(toks),
                 prefill_chunk=chunk, threads=threads,
                 kv_budget_tokens=max(65536, (longest + new_tokens + 64) * len(toks)))
    t0 = time.perf_counter()
    ids = [eng.submit(t, max_new_tokens=new_tokens) for t in toks]
    started, first = set(), None
    while len(started) < len(ids) and eng.has_work:
        eng.step()
        for ev in eng.events():
            if ev["type"] == "token":
                started.add(ev["id"])
                if first is None:
                    first = time.perf_counter() - t0
    n, t1 = 0, time.perf_counter()
    while eng.has_work:
        eng.step()
        n += sum(1 for ev in eng.events() if ev["type"] == "token")
    dt = time.perf_counter() - t1
    eng.run(ids)
    return {"prefill_tok_s": len(toks[0]) / first if len(toks) == 1 else float("nan"),
            "decode_tok_s": n / dt if dt > 0 else 0.0}


def _quiet(level, text, user_data):
    pass


try:
    import llama_cpp as _lc
    _QUIET = _lc.llama_log_callback(_quiet)  # kept alive for the process: llama.cpp holds it
except ImportError:
    _QUIET = None


class LlamaCpp:
    """llama.cpp through llama-cpp-python's C API: one context, one sequence per stream."""

    def __init__(self, path: str, streams: int, threads: int, n_ctx_per_seq: int,
                 n_batch: int = 0, flash_attn: bool = False):
        import llama_cpp as lc
        self.lc = lc
        lc.llama_log_set(_QUIET, ctypes.c_void_p())
        lc.llama_backend_init()
        mp = lc.llama_model_default_params()
        self.model = lc.llama_model_load_from_file(path.encode(), mp)
        cp = lc.llama_context_default_params()
        cp.n_ctx = n_ctx_per_seq * streams
        cp.n_batch = n_batch or max(512, n_ctx_per_seq)
        cp.n_ubatch = cp.n_batch
        if hasattr(cp, "flash_attn_type"):
            cp.flash_attn_type = 1 if flash_attn else 0
        elif hasattr(cp, "flash_attn"):
            cp.flash_attn = flash_attn
        self.n_batch = cp.n_batch
        cp.n_seq_max = streams
        cp.n_threads = threads
        cp.n_threads_batch = threads
        self.ctx = lc.llama_init_from_model(self.model, cp)
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        self.batch = lc.llama_batch_init(cp.n_batch, 0, streams)

    def close(self):
        self.lc.llama_batch_free(self.batch)
        self.lc.llama_free(self.ctx)
        self.lc.llama_model_free(self.model)

    def _decode(self, items):
        """items: (token, pos, seq, want_logits); returns argmax per wanted item."""
        b = self.batch
        for i, (tok, pos, seq, want) in enumerate(items):
            b.token[i], b.pos[i], b.n_seq_id[i] = tok, pos, 1
            b.seq_id[i][0] = seq
            b.logits[i] = want
        b.n_tokens = len(items)
        if self.lc.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed")
        out = []
        for i, (_, _, _, want) in enumerate(items):
            if want:
                p = self.lc.llama_get_logits_ith(self.ctx, i)
                out.append(int(np.argmax(np.ctypeslib.as_array(p, shape=(self.n_vocab,)))))
        return out

    def run(self, toks: List[List[int]], new_tokens: int) -> Dict[str, float]:
        self.lc.llama_memory_clear(self.lc.llama_get_memory(self.ctx), True)
        t0 = time.perf_counter()
        last, first = [], None
        for s, t in enumerate(toks):
            for c0 in range(0, len(t), self.n_batch):
                got = self._decode([(tok, i, s, i == len(t) - 1) for i, tok in enumerate(t) if c0 <= i < c0 + self.n_batch])
            last.append(got[0])
            if first is None:
                first = time.perf_counter() - t0
        pos = [len(t) for t in toks]
        n, t1 = 0, time.perf_counter()
        for _ in range(new_tokens - 1):
            last = self._decode([(last[s], pos[s], s, True) for s in range(len(toks))])
            pos = [p + 1 for p in pos]
            n += len(toks)
        dt = time.perf_counter() - t1
        return {"prefill_tok_s": len(toks[0]) / first if len(toks) == 1 else float("nan"),
                "decode_tok_s": n / dt if dt > 0 else 0.0}


#: ``--llama-flash-attn``: which of llama.cpp's flash-attention settings a long-context run tries
FLASH_ATTN = {"both": (False, True), "off": (False,), "on": (True,)}


def compare(model: Model, name: str, ctx: int, c: int, a: argparse.Namespace, bw: float):
    """One model at one context (0: the short chat prompts) and stream count, both engines in
    alternating rounds; returns the table row and the best bandwidth seen."""
    toks = [long_prompt(model, ctx, s) for s in range(c)] if ctx else prompts(model, c)
    n_ctx = max(len(t) for t in toks) + a.new_tokens + 8
    chunk = 512 if ctx else 4096
    # Long contexts: llama.cpp with flash attention off and on, its better figure kept.
    fas = FLASH_ATTN[a.llama_flash_attn] if ctx else (False,)
    peers = [(f"llama.cpp{' fa' if fa else ''}", LlamaCpp(model.path, c, a.threads, n_ctx, n_batch=512 if ctx else 0, flash_attn=fa))
             for fa in fas]
    ours_best: Dict[str, float] = {}
    peer_best: Dict[str, float] = {}
    # Single stream: each candle-gate round's decode rate over the bandwidth read just
    # before it, since a shared host's bandwidth moves between minutes.
    paired: List[float] = []
    warm = [t[:64] for t in toks]  # warm-up: page in the weights, both sides
    candle_gate_run(model, warm, 4, a.threads)
    for _, peer in peers:
        peer.run(warm, 4)
    peer_which: Dict[str, str] = {}
    for rnd in range(a.rounds):
        sides = [("candle-gate", lambda: candle_gate_run(model, toks, a.new_tokens, a.threads, chunk), ours_best)]
        sides += [(label, (lambda p=peer: p.run(toks, a.new_tokens)), peer_best) for label, peer in peers]
        for side, fn, best in sides:
            pair = side == "candle-gate" and c == 1
            if pair:
                bw_round = read_bandwidth_gbs(a.threads)
                bw = max(bw, bw_round)
            r = fn()
            if pair:
                kv = (ctx + a.new_tokens // 2) * model.config["kv_bytes_per_token_f16"] if ctx else 0
                paired.append((model.config["bytes_per_decode_token"] + kv) * r["decode_tok_s"] / 1e9 / bw_round)
            for k, v in r.items():
                if not np.isnan(v) and v > best.get(k, 0.0):
                    best[k] = v
                    if side != "candle-gate":
                        peer_which[k] = side
            print(f"  {name} context={ctx or 'chat'} streams={c} round {rnd + 1} {side}: "
                  + ", ".join(f"{k} {v:.1f}" for k, v in r.items() if not np.isnan(v)), file=sys.stderr, flush=True)
    for _, peer in peers:
        peer.close()
    row = {"model": name, "streams": c, "context": ctx, "candle_gate": ours_best, "llama_cpp": peer_best,
           "llama_cpp_setting": peer_which}
    if c == 1:
        # Bytes one decode step reads: the weights, and the K/V of every cached position.
        kv = (ctx + a.new_tokens // 2) * model.config["kv_bytes_per_token_f16"] if ctx else 0
        step_bytes = model.config["bytes_per_decode_token"] + kv
        row["decode_gbs"] = step_bytes * ours_best["decode_tok_s"] / 1e9
        row["bandwidth_share_paired"] = sorted(paired)
    return row, bw


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(candle_gate.models.KNOWN_MODELS))
    ap.add_argument("--streams", default="1,8")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--json", default=None)
    ap.add_argument("--context", default="", help="prompt lengths in tokens, e.g. 1024,4096,16384 (default: short chat prompts)")
    ap.add_argument("--llama-flash-attn", default="both", choices=sorted(FLASH_ATTN),
                    help="llama.cpp's flash attention at --context: both (its better figure kept), or only off or "
                         "on, which halves its time where one setting is known to win (off won Qwen2.5's decode "
                         "at 4k and 16k on the 2-core Zen 4)")
    a = ap.parse_args(argv)
    contexts = [int(x) for x in a.context.split(",") if x] or [0]
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        print("llama-cpp-python is not installed: pip install '.[peer]'", file=sys.stderr)
        return 2
    streams = [int(s) for s in a.streams.split(",")]
    bw = read_bandwidth_gbs(a.threads)
    print(f"read bandwidth ({a.threads} threads summing 256 MiB): {bw:.1f} GB/s; threads {a.threads}", flush=True)
    # What each side's build picked on this host (llama.cpp's SIMD and AMX builds differ).
    peer_build = llama_cpp.llama_print_system_info().decode().strip()
    print(f"llama.cpp {llama_cpp.__version__}: {peer_build}", flush=True)
    rows = []
    for name in a.models.split(","):
        # A shared host's bandwidth moves: measured again before each model, and the best seen is
        # the limit (the share is then, if anything, understated).
        bw = max(bw, read_bandwidth_gbs(a.threads))
        model = Model.load(name)
        for ctx in contexts:
            for c in streams:
                row, bw = compare(model, name, ctx, c, a, bw)
                rows.append(row)
    print(f"read bandwidth, best of the measurements: {bw:.1f} GB/s", flush=True)
    for row in rows:
        if "decode_gbs" in row:
            row["bandwidth_share"] = row["decode_gbs"] / bw
    print(f"\n{'model':<38} {'context':>7} {'streams':>7} {'metric':<8} {'candle-gate':>12} {'llama.cpp':>10} {'ratio':>7}")
    for r in rows:
        for k, label in (("prefill_tok_s", "prefill"), ("decode_tok_s", "decode")):
            if k in r["candle_gate"] and k in r["llama_cpp"]:
                o, p = r["candle_gate"][k], r["llama_cpp"][k]
                which = r["llama_cpp_setting"].get(k, "")
                fa = " (llama.cpp with flash attention)" if which.endswith(" fa") else ""
                ctx = r["context"] or "chat"
                print(f"{r['model']:<38} {ctx:>7} {r['streams']:>7} {label:<8} {o:>12.1f} {p:>10.1f} {o / p:>6.2f}x{fa}")
        if "bandwidth_share" in r:
            paired = r["bandwidth_share_paired"]
            print(f"{r['model']:<38} {'':>7} decode at {100 * r['bandwidth_share']:.0f}% of the read-bandwidth limit "
                  f"(each round against the bandwidth read just before it: "
                  f"{', '.join(f'{100 * x:.0f}%' for x in paired)})")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"read_bandwidth_gbs": bw, "threads": a.threads, "llama_cpp_build": peer_build, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
