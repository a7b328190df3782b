"""candle-gate against llama.cpp and ik_llama.cpp on the same GGUF, side by side in one run.

    pip install ".[peer]"          # llama-cpp-python (built from source by pip) and ik-llama-cpp-python
    python benches/vs_llama_cpp.py [--models smollm2-135m-instruct-q4_1,qwen2.5-coder-0.5b-instruct-q4_k_m,/path/x.gguf]
                                   [--streams 1,8] [--new-tokens 64] [--rounds 2] [--threads 2] [--json OUT]
                                   [--context 1024,4096,16384] [--peers llama,ik]

Neither peer is a CI dependency: both come from the ``peer`` extra, which CI never installs. A
``--models`` entry is a registry name or a path to a GGUF file. An 8B-class comparison without
downloading an 8B model (a file of random weights with Llama-3.1-8B's shapes and Q4_K_M's dtype mix,
benches/synth_gguf.py; 4.47 GB, written in about a minute):

    python benches/synth_gguf.py --out /tmp/llama8b-shapes.gguf \
      && python benches/vs_llama_cpp.py --models /tmp/llama8b-shapes.gguf --streams 1,8

Every peer setting of a case (a context and a stream count) is loaded at once, each with its own
K/V cache and, where it repacks weights (llama.cpp's CPU repacking of Q4_K, ik's ``-rtr``), its own
copy of them: on the 8B shapes (4.5 GB of weights, 128 KiB of f16 K/V a token) a 24 GiB host holds
the short prompts with every setting, but at ``--context`` keep to one flash-attention setting per
peer (``--llama-flash-attn off --ik-flash-attn off``) and few streams.

Both engines get the same prompts as the same token ids (candle-gate's tokenizer and chat
template render them once; a base model without a template, such as Gemma 3 270M, gets the same
requests as plain text) and decode greedily. For each model, stream count and round,
candle-gate (``invariant`` mode, or ``--mode``) and llama.cpp run in alternation, and each reports:

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

**ik_llama.cpp** (``--peers ik``; ``pip install ik-llama-cpp-python==0.1.5``, a prebuilt manylinux
wheel), llama.cpp's CPU-optimised fork, is the second peer, run in the same alternation and printed
beside llama.cpp's better setting with its own ratio (candle-gate / ik_llama.cpp). ``--peers``
defaults to every peer that is installed; a peer that is not is skipped with a line saying so. The
wheel's ``IkLlama`` class only decodes one sequence and samples in a Python loop over the vocabulary,
so the bench drives ik's C API (``ik_llama_cpp._ctypes_api``, an older llama.h than upstream's:
``llama_kv_cache_clear``, ``llama_free_model``) the way it drives llama.cpp's: one context with
``n_seq_max`` = streams, the streams decoded as one ``llama_batch`` of sequences, logits read through
``llama_get_logits_ith`` and the greedy argmax taken with numpy, only the engine timed. It runs in a
worker process of its own (this script with ``--ik-worker``), so that its ggml, its OpenMP runtime
and its ``GGML_ASSERT`` aborts stay out of this process: a setting that aborts is reported and
dropped, the rest of the run goes on. ik runs with its context defaults (fused up/gate, graph reuse)
and flash attention off; with ``--context``, off and on (``--ik-flash-attn``), its better figure kept
as for llama.cpp. ``--ik-repack on`` adds its run-time repacking of the weights into row-interleaved
types (``-rtr``: no mmap, the weights copied at load).

The 0.1.5 wheel is a generic x86-64 build (AVX2, FMA, F16C; its system info line, printed and
recorded, says ``AVX512 = 0``), so on an AVX-512 host it runs without the AVX-512/VNNI kernels a
native build of ik uses, and its flash attention aborts (``GGML_ASSERT(S > 0)``, iqk_fa_templates.h)
on several sequences at once. For a native build, compile the sdist's vendored ik_llama.cpp
(``pip download --no-binary :all: --no-deps ik-llama-cpp-python==0.1.5``, unpack, then ``cmake -B
build -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=ON -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF
-DLLAMA_BUILD_SERVER=OFF vendor/ik_llama.cpp && cmake --build build -j``) and point the installed
package at it: ``IK_LLAMA_CPP_LIB_PATH=$PWD/build/src/libllama.so`` (not tried here: a long build).
The wheel's batched prefill is wrong on SmolLM2's Q4_1 (a prompt of 32 tokens or more gives logits
whose argmax is end-of-text where ik's own token-by-token prefill, candle-gate and llama.cpp agree
on text; Qwen2.5's Q4_K_M and synth_gguf.py's Q4_K/Q6_K agree): its SmolLM2 prefill figure times that kernel.
Both peers' threads are OpenMP threads that spin at barriers, so a host with other work on its
cores slows them far more than candle-gate (beside a compile, ik decoded SmolLM2 at 1.4 tok/s on two
threads and 25 on one): compare on a quiet host.
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
import provenance
from candle_gate import Engine, Model, layout_for
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
                    chunk: int = 4096, mode: str = "invariant") -> Dict[str, float]:
    longest = max(len(t) for t in toks)
    eng = Engine(model, mode=mode, max_num_seqs=max(16, len(toks)), max_tokens_per_step=chunk + len(toks),
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


_QUIET = None


def _quiet_llama_cpp(lc):
    """llama.cpp's log callback that drops everything, made once and kept alive for the process
    (llama.cpp holds it). llama_cpp is imported only where llama.cpp runs: never in ik's worker."""
    global _QUIET
    if _QUIET is None:
        _QUIET = lc.llama_log_callback(_quiet)
    return _QUIET

#: ``--peers``: the name, the label printed, the module that must be importable, how to install it
PEERS = {"llama": ("llama.cpp", "llama_cpp", "pip install llama-cpp-python"),
         "ik": ("ik_llama.cpp", "ik_llama_cpp", "pip install ik-llama-cpp-python==0.1.5")}


class BatchDecoder:
    """What llama.cpp's and ik_llama.cpp's C APIs share: a ``llama_batch`` of (token, position,
    sequence) rows, ``llama_decode``, ``llama_get_logits_ith``. Subclasses set lc (the bindings),
    ctx, batch, n_batch and n_vocab."""

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

    def _timed(self, toks: List[List[int]], new_tokens: int) -> Dict[str, float]:
        """Prefill each stream in chunks of n_batch, then decode all streams as one batch a step."""
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


class LlamaCpp(BatchDecoder):
    """llama.cpp through llama-cpp-python's C API: one context, one sequence per stream."""

    def __init__(self, path: str, streams: int, threads: int, n_ctx_per_seq: int,
                 n_batch: int = 0, flash_attn: bool = False):
        import llama_cpp as lc
        self.lc = lc
        lc.llama_log_set(_quiet_llama_cpp(lc), ctypes.c_void_p())
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

    def run(self, toks: List[List[int]], new_tokens: int) -> Dict[str, float]:
        self.lc.llama_memory_clear(self.lc.llama_get_memory(self.ctx), True)
        return self._timed(toks, new_tokens)


class IkEngine(BatchDecoder):
    """ik_llama.cpp through its wheel's ctypes bindings of llama.h (ik's older API), as
    :class:`LlamaCpp` drives llama.cpp: one context, one sequence per stream, greedy argmax in
    numpy. Runs inside the ``--ik-worker`` process, never beside llama.cpp."""

    def __init__(self, path: str, streams: int, threads: int, n_ctx_per_seq: int,
                 n_batch: int = 0, flash_attn: bool = False, repack: bool = False):
        import ik_llama_cpp._ctypes_api as C
        self.lc = C
        C.llama_backend_init()
        mp = C.llama_model_default_params()
        mp.repack_tensors = repack
        if repack:
            mp.use_mmap = False  # run-time repacking rewrites the weights in memory (ik's -rtr does the same)
        self.model = C.llama_model_load_from_file(path.encode(), mp)
        if not self.model:
            raise RuntimeError(f"ik_llama.cpp could not load {path}")
        cp = C.llama_context_default_params()
        cp.n_ctx = n_ctx_per_seq * streams
        cp.n_batch = n_batch or max(512, n_ctx_per_seq)
        cp.n_ubatch = cp.n_batch
        cp.flash_attn = flash_attn
        cp.n_seq_max = streams
        cp.n_threads = threads
        cp.n_threads_batch = threads
        self.n_batch = cp.n_batch
        self.ctx = C.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise RuntimeError("ik_llama.cpp could not create its context")
        self.n_vocab = C.llama_vocab_n_tokens(C.llama_model_get_vocab(self.model))
        self.batch = C.llama_batch_init(cp.n_batch, 0, streams)

    def close(self):
        self.lc.llama_batch_free(self.batch)
        self.lc.llama_free(self.ctx)
        self.lc.llama_free_model(self.model)

    def run(self, toks: List[List[int]], new_tokens: int) -> Dict[str, float]:
        self.lc.llama_kv_cache_clear(self.ctx)
        return self._timed(toks, new_tokens)


def _ik_system_info(lib) -> str:
    lib.llama_print_system_info.restype = ctypes.c_char_p
    return lib.llama_print_system_info().decode().strip()


def ik_worker() -> int:
    """The ``--ik-worker`` loop: one JSON request a line on stdin, one JSON answer a line on the
    original stdout (the C libraries' own prints are sent to stderr)."""
    proto = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    import ik_llama_cpp
    import ik_llama_cpp._ctypes_api as C
    log_cb = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)
    quiet = log_cb(_quiet)  # kept alive while the library may call it
    C._lib.llama_log_set.argtypes = [log_cb, ctypes.c_void_p]
    C._lib.llama_log_set(quiet, None)
    eng = None
    for line in sys.stdin:
        req = json.loads(line)
        cmd = req.pop("cmd")
        if cmd == "info":
            out = {"version": ik_llama_cpp.__version__, "system_info": _ik_system_info(C._lib)}
        elif cmd == "load":
            eng = IkEngine(**req)
            out = {}
        elif cmd == "run":
            out = eng.run(req["toks"], req["new_tokens"])
        elif cmd == "close":
            eng.close()
            eng = None
            out = {}
        else:
            raise ValueError(f"unknown worker command {cmd!r}")
        proto.write(json.dumps(out) + "\n")
        proto.flush()
    return 0


class PeerAborted(RuntimeError):
    pass


class IkLlamaCpp:
    """The parent's side of an ``--ik-worker`` process (one per engine setting, loaded once)."""

    def __init__(self, path: str, streams: int, threads: int, n_ctx_per_seq: int,
                 n_batch: int = 0, flash_attn: bool = False, repack: bool = False):
        import subprocess
        import tempfile
        self.log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--ik-worker"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True)
        self._ask(cmd="load", path=path, streams=streams, threads=threads, n_ctx_per_seq=n_ctx_per_seq,
                  n_batch=n_batch, flash_attn=flash_attn, repack=repack)

    @staticmethod
    def info() -> Dict[str, str]:
        """ik's version and ``llama_print_system_info()``, from a worker of its own."""
        import subprocess
        r = subprocess.run([sys.executable, os.path.abspath(__file__), "--ik-worker"], input='{"cmd": "info"}\n',
                           capture_output=True, text=True, check=True)
        return json.loads(r.stdout)

    def _ask(self, **req):
        try:
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except BrokenPipeError:
            line = ""
        if not line:
            self.proc.wait()
            self.log.seek(0)
            err = [ln.strip() for ln in self.log.read().splitlines() if ln.strip()]
            why = next((ln for ln in err if "GGML_ASSERT" in ln or "error" in ln.lower()), err[-1] if err else "")
            raise PeerAborted(f"exit status {self.proc.returncode}: {why}")
        return json.loads(line)

    def run(self, toks: List[List[int]], new_tokens: int) -> Dict[str, float]:
        return self._ask(cmd="run", toks=toks, new_tokens=new_tokens)

    def close(self):
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait()
        self.log.close()


#: ``--llama-flash-attn``: which of llama.cpp's flash-attention settings a long-context run tries
FLASH_ATTN = {"both": (False, True), "off": (False,), "on": (True,)}


#: ``--ik-repack``: whether ik_llama.cpp repacks the weights at load (its ``-rtr``)
IK_REPACK = {"off": (False,), "on": (True,), "both": (False, True)}


def peer_engines(model: Model, c: int, n_ctx: int, ctx: int, a: argparse.Namespace, aborted: Dict[str, str]):
    """(label, result key, engine) for each peer setting this run tries; an ik setting that aborts
    at load is recorded in ``aborted`` and left out."""
    out = []
    n_batch = 512 if ctx else 0
    if "llama" in a.peers:
        for fa in (FLASH_ATTN[a.llama_flash_attn] if ctx else (False,)):
            out.append((f"llama.cpp{' fa' if fa else ''}", "llama_cpp",
                        LlamaCpp(model.path, c, a.threads, n_ctx, n_batch=n_batch, flash_attn=fa)))
    if "ik" in a.peers:
        for fa in (FLASH_ATTN[a.ik_flash_attn] if ctx else (False,)):
            for repack in IK_REPACK[a.ik_repack]:
                label = f"ik_llama.cpp{' fa' if fa else ''}{' rtr' if repack else ''}"
                try:
                    out.append((label, "ik_llama_cpp", IkLlamaCpp(model.path, c, a.threads, n_ctx, n_batch=n_batch,
                                                                  flash_attn=fa, repack=repack)))
                except PeerAborted as e:
                    aborted[label] = f"at load: {e}"
                    print(f"  {label} aborted at load ({e}): left out", file=sys.stderr, flush=True)
    return out


def compare(model: Model, name: str, ctx: int, c: int, a: argparse.Namespace, bw: float):
    """One model at one context (0: the short chat prompts) and stream count, candle-gate and each
    peer setting in alternating rounds; returns the table row and the best bandwidth seen."""
    toks = [long_prompt(model, ctx, s) for s in range(c)] if ctx else prompts(model, c)
    n_ctx = max(len(t) for t in toks) + a.new_tokens + 8
    chunk = 512 if ctx else 4096
    # Long contexts: each peer with flash attention off and on, its better figure kept.
    aborted: Dict[str, str] = {}
    peers = peer_engines(model, c, n_ctx, ctx, a, aborted)
    best: Dict[str, Dict[str, float]] = {"candle_gate": {}, "llama_cpp": {}, "ik_llama_cpp": {}}
    which: Dict[str, Dict[str, str]] = {"llama_cpp": {}, "ik_llama_cpp": {}}
    # Single stream: each candle-gate round's decode rate over the bandwidth read just
    # before it, since a shared host's bandwidth moves between minutes.
    paired: List[float] = []

    def peer_run(label, engine, toks, new_tokens):
        """The peer's figures, or None where its process aborted (reported, then left out)."""
        try:
            return engine.run(toks, new_tokens)
        except PeerAborted as e:
            aborted[label] = str(e)
            print(f"  {name} context={ctx or 'chat'} streams={c} {label} aborted ({e}): left out",
                  file=sys.stderr, flush=True)
            peers[:] = [p for p in peers if p[0] != label]
            engine.close()
            return None

    warm = [t[:64] for t in toks]  # warm-up: page in the weights, every side
    candle_gate_run(model, warm, 4, a.threads, mode=a.mode)
    for label, _, peer in list(peers):
        peer_run(label, peer, warm, 4)
    for rnd in range(a.rounds):
        sides = [("candle-gate", "candle_gate", lambda: candle_gate_run(model, toks, a.new_tokens, a.threads, chunk, a.mode))]
        sides += [(label, key, (lambda lb=label, p=peer: peer_run(lb, p, toks, a.new_tokens)))
                  for label, key, peer in peers]
        for side, key, fn in sides:
            pair = side == "candle-gate" and c == 1
            if pair:
                bw_round = read_bandwidth_gbs(a.threads)
                bw = max(bw, bw_round)
            r = fn()
            if r is None:
                continue
            if pair:
                kv = (ctx + a.new_tokens // 2) * model.config["kv_bytes_per_token_f16"] if ctx else 0
                paired.append((model.config["bytes_per_decode_token"] + kv) * r["decode_tok_s"] / 1e9 / bw_round)
            for k, v in r.items():
                if not np.isnan(v) and v > best[key].get(k, 0.0):
                    best[key][k] = v
                    if key in which:
                        which[key][k] = side
            print(f"  {name} context={ctx or 'chat'} streams={c} round {rnd + 1} {side}: "
                  + ", ".join(f"{k} {v:.1f}" for k, v in r.items() if not np.isnan(v)), file=sys.stderr, flush=True)
    for _, _, peer in peers:
        peer.close()
    row = {"model": name, "streams": c, "context": ctx, "candle_gate": best["candle_gate"],
           "llama_cpp": best["llama_cpp"], "llama_cpp_setting": which["llama_cpp"],
           "ik_llama_cpp": best["ik_llama_cpp"], "ik_llama_cpp_setting": which["ik_llama_cpp"]}
    if aborted:
        row["peer_aborted"] = aborted
    if c == 1:
        # Bytes one decode step reads: the weights, and the K/V of every cached position.
        kv = (ctx + a.new_tokens // 2) * model.config["kv_bytes_per_token_f16"] if ctx else 0
        step_bytes = model.config["bytes_per_decode_token"] + kv
        row["decode_gbs"] = step_bytes * best["candle_gate"]["decode_tok_s"] / 1e9
        row["bandwidth_share_paired"] = sorted(paired)
    return row, bw


def available_peers(requested: str) -> List[str]:
    """The ``--peers`` that are installed, in order; each missing one said on a line of its own."""
    import importlib.util
    out = []
    for p in [x.strip() for x in requested.split(",") if x.strip()]:
        if p not in PEERS:
            raise SystemExit(f"--peers: unknown peer {p!r} (known: {', '.join(PEERS)})")
        label, module, install = PEERS[p]
        if importlib.util.find_spec(module) is None:
            print(f"{label} is not installed ({install}): skipped", flush=True)
        else:
            out.append(p)
    return out


#: a peer label's setting words, as the table's notes say them
SETTING_WORDS = {"fa": "flash attention", "rtr": "run-time repacking"}


def print_table(rows: List[dict]) -> None:
    """candle-gate beside llama.cpp's better setting and ik_llama.cpp's, each with candle-gate / peer."""
    print(f"\n{'model':<38} {'context':>7} {'streams':>7} {'metric':<8} {'candle-gate':>12} {'llama.cpp':>10} {'ratio':>7}"
          f" {'ik_llama.cpp':>12} {'ratio':>7}")
    for r in rows:
        shown = os.path.basename(r["model"]) if os.sep in r["model"] else r["model"]
        for k, label in (("prefill_tok_s", "prefill"), ("decode_tok_s", "decode")):
            if k not in r["candle_gate"] or not (k in r["llama_cpp"] or k in r["ik_llama_cpp"]):
                continue
            o = r["candle_gate"][k]
            cells, notes = [], []
            for key, width in (("llama_cpp", 10), ("ik_llama_cpp", 12)):
                if k in r[key]:
                    p = r[key][k]
                    cells.append(f"{p:>{width}.1f} {o / p:>6.2f}x")
                    engine, *setting = r[f"{key}_setting"].get(k, "").split(" ")
                    if setting:
                        notes.append(f"{engine} with " + " and ".join(SETTING_WORDS[w] for w in setting))
                else:
                    cells.append(f"{'-':>{width}} {'-':>7}")
            ctx = r["context"] or "chat"
            note = f" ({'; '.join(notes)})" if notes else ""
            print(f"{shown:<38} {ctx:>7} {r['streams']:>7} {label:<8} {o:>12.1f} {' '.join(cells)}{note}")
        if "bandwidth_share" in r:
            paired = r["bandwidth_share_paired"]
            print(f"{shown:<38} {'':>7} decode at {100 * r['bandwidth_share']:.0f}% of the read-bandwidth limit "
                  f"(each round against the bandwidth read just before it: "
                  f"{', '.join(f'{100 * x:.0f}%' for x in paired)})")
        for label, why in r.get("peer_aborted", {}).items():
            print(f"{shown:<38} {'':>7} {label} aborted: {why}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(candle_gate.models.KNOWN_MODELS),
                    help="registry names or paths to GGUF files, comma-separated")
    ap.add_argument("--streams", default="1,8")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--mode", default="invariant",
                    help="candle-gate's mode (weights packed as that mode packs them; default: invariant)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--context", default="", help="prompt lengths in tokens, e.g. 1024,4096,16384 (default: short chat prompts)")
    ap.add_argument("--peers", default=",".join(PEERS),
                    help="the peers to run, of llama (llama.cpp) and ik (ik_llama.cpp); default: both, each "
                         "skipped with a line saying so if it is not installed")
    ap.add_argument("--llama-flash-attn", default="both", choices=sorted(FLASH_ATTN),
                    help="llama.cpp's flash attention at --context: both (its better figure kept), or only off or "
                         "on, which halves its time where one setting is known to win (off won Qwen2.5's decode "
                         "at 4k and 16k on the 2-core Zen 4)")
    ap.add_argument("--ik-flash-attn", default="both", choices=sorted(FLASH_ATTN),
                    help="the same for ik_llama.cpp (a setting that aborts is reported and left out)")
    ap.add_argument("--ik-repack", default="off", choices=sorted(IK_REPACK),
                    help="ik_llama.cpp's run-time repacking of the weights (-rtr): off, on, or both (its better "
                         "figure kept)")
    a = ap.parse_args(argv)
    contexts = [int(x) for x in a.context.split(",") if x] or [0]
    a.peers = available_peers(a.peers)
    if not a.peers:
        print("no peer is installed: pip install '.[peer]'", file=sys.stderr)
        return 2
    streams = [int(s) for s in a.streams.split(",")]
    bw = read_bandwidth_gbs(a.threads)
    print(f"read bandwidth ({a.threads} threads summing 256 MiB): {bw:.1f} GB/s; threads {a.threads}", flush=True)
    # What each side's build picked on this host (llama.cpp's SIMD and AMX builds differ; ik's wheel is generic).
    builds = {}
    if "llama" in a.peers:
        import llama_cpp
        builds["llama_cpp_build"] = llama_cpp.llama_print_system_info().decode().strip()
        print(f"llama.cpp {llama_cpp.__version__}: {builds['llama_cpp_build']}", flush=True)
    if "ik" in a.peers:
        info = IkLlamaCpp.info()
        builds["ik_llama_cpp_build"] = info["system_info"]
        builds["ik_llama_cpp_version"] = info["version"]
        lib = os.environ.get("IK_LLAMA_CPP_LIB_PATH")
        print(f"ik_llama.cpp (ik-llama-cpp-python {info['version']}{', ' + lib if lib else ''}): "
              f"{info['system_info']}", flush=True)
    rows = []
    for name in a.models.split(","):
        # A shared host's bandwidth moves: measured again before each model, and the best seen is
        # the limit (the share is then, if anything, understated).
        bw = max(bw, read_bandwidth_gbs(a.threads))
        model = Model.load(name, layout=layout_for(a.mode))
        for ctx in contexts:
            for c in streams:
                row, bw = compare(model, name, ctx, c, a, bw)
                rows.append(row)
    print(f"read bandwidth, best of the measurements: {bw:.1f} GB/s", flush=True)
    for row in rows:
        if "decode_gbs" in row:
            row["bandwidth_share"] = row["decode_gbs"] / bw
    print_table(rows)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({**provenance.stamp(), "read_bandwidth_gbs": bw, "threads": a.threads, "mode": a.mode,
                       "peers": a.peers, **builds, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(ik_worker() if sys.argv[1:] == ["--ik-worker"] else main())
