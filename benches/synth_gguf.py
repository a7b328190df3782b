"""A GGUF with Llama-3.1-8B's shapes and llama.cpp's Q4_K_M dtype mix, random weights: an 8B-class
model for speed comparisons where no 8B file can be downloaded.

    python benches/synth_gguf.py [--out PATH] [--layers 32] [--seed 0] [--tokenizer-from MODEL_OR_PATH]
    python benches/vs_llama_cpp.py --models PATH --streams 1,8      # then: candle-gate against llama.cpp on it

Shapes: hidden 4096, FFN 14336, 32 heads of 128, 8 K/V heads, RMSNorm eps 1e-5, RoPE base 500000 (no
Llama 3.1 long-context RoPE scaling: the ``rope_freqs`` tensor is left out, which both engines treat as
plain RoPE). The vocabulary, and with it every ``tokenizer.*`` key (chat template included), is copied
from a small registry model (SmolLM2-135M, 49152 tokens), so token_embd and output have 49152 rows where
the real model has 128256: the file is 4.47 GB, not 4.92 GB, and a decode step reads 0.27 GB less
(output.weight's share), which both engines read alike.

The dtype mix is what ``llama-quantize ... Q4_K_M`` writes for Llama 3.1 8B: Q4_K for every matrix
but output.weight (Q6_K) and attn_v / ffn_down in the layers of llama.cpp's ``use_more_bits`` rule
(i < n/8, i >= 7n/8, or (i - n/8) % 3 == 2: 16 of 32 layers) (Q6_K); token_embd Q4_K; norms F32.

The gguf package quantizes neither Q4_K nor Q6_K, so the block bytes are written directly: random
quants, per-sub-block scales drawn near the middle of their range and f16 super-block scales chosen so
the dequantized weights have std ~0.02 and mean ~0 (printed for each type's first tensor, through
``gguf``'s dequantizer). Norm weights are 1. The output rows of the control tokens (end of turn, end of
text, ...) are zero, so their logit is 0 while the largest of the others is positive: greedy decoding
never stops early, and every stream runs its full number of tokens in both engines.

Tensors are generated and written one at a time (the largest, output.weight, is 165 MB), so the
writer's memory does not grow with the file: 0.45 GB peak RSS for the 32 layers, about a minute.
"""
from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from pathlib import Path
from typing import List, Tuple

import numpy as np

import gguf
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V

QK_K = 256
TARGET_STD = 0.02
HIDDEN, FFN, HEADS, KV_HEADS, HEAD_DIM = 4096, 14336, 32, 8, 128
#: Q4_K block: f16 d, f16 dmin, 12 bytes of packed 6-bit scales and mins, 128 bytes of nibbles.
Q4_K_BYTES = 2 + 2 + 12 + QK_K // 2
#: Q6_K block: 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales, f16 d.
Q6_K_BYTES = QK_K // 2 + QK_K // 4 + QK_K // 16 + 2


def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's rule (llama-quant.cpp) for the layers whose attn_v and ffn_down Q4_K_M keeps in Q6_K."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def q4_k_blocks(rng: np.random.Generator, n_blocks: int) -> np.ndarray:
    """Random Q4_K blocks: value = d * sc[j] * q - dmin * m[j], q uniform in 0..15 (mean 7.5, std 4.61),
    sc[j] in 32..63, m[j] = round(sc[j] * 7.5 / 8) with dmin = 8 d so that each sub-block's mean is ~0."""
    b = np.empty((n_blocks, Q4_K_BYTES), dtype=np.uint8)
    sc = rng.integers(32, 64, size=(n_blocks, 8), dtype=np.uint8)
    m = np.rint(sc.astype(np.float32) * (7.5 / 8)).astype(np.uint8)
    d = (TARGET_STD / (4.61 * 47.5) * rng.uniform(0.8, 1.2, size=n_blocks)).astype(np.float16)
    b[:, 0:2] = d.view(np.uint8).reshape(n_blocks, 2)
    b[:, 2:4] = (d.astype(np.float32) * 8).astype(np.float16).view(np.uint8).reshape(n_blocks, 2)
    s = b[:, 4:16]
    # The 12-byte packing that llama.cpp's get_scale_min_k4 reads back (gguf.quants.Q4_K.get_scale_min).
    s[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    s[:, 4:8] = m[:, 0:4] | ((m[:, 4:8] >> 4) << 6)
    s[:, 8:12] = (sc[:, 4:8] & 0x0F) | ((m[:, 4:8] & 0x0F) << 4)
    b[:, 16:] = rng.integers(0, 256, size=(n_blocks, QK_K // 2), dtype=np.uint8)
    return b


def q6_k_blocks(rng: np.random.Generator, n_blocks: int) -> np.ndarray:
    """Random Q6_K blocks: value = d * scale[k] * (q - 32), q uniform in 0..63 (std 18.47), scale in 8..16."""
    b = np.empty((n_blocks, Q6_K_BYTES), dtype=np.uint8)
    b[:, :192] = rng.integers(0, 256, size=(n_blocks, 192), dtype=np.uint8)
    b[:, 192:208] = rng.integers(8, 17, size=(n_blocks, 16), dtype=np.uint8)
    d = (TARGET_STD / (18.47 * 12) * rng.uniform(0.8, 1.2, size=n_blocks)).astype(np.float16)
    b[:, 208:210] = d.view(np.uint8).reshape(n_blocks, 2)
    return b


BLOCKS = {Q.Q4_K: (Q4_K_BYTES, q4_k_blocks), Q.Q6_K: (Q6_K_BYTES, q6_k_blocks)}


def plan(n_layers: int, n_vocab: int) -> List[Tuple[str, Q, Tuple[int, ...]]]:
    """(name, dtype, shape as (rows, row length)) in llama.cpp's tensor order."""
    t: List[Tuple[str, Q, Tuple[int, ...]]] = [("token_embd.weight", Q.Q4_K, (n_vocab, HIDDEN))]
    for i in range(n_layers):
        more = Q.Q6_K if use_more_bits(i, n_layers) else Q.Q4_K
        t += [(f"blk.{i}.attn_norm.weight", Q.F32, (HIDDEN,)),
              (f"blk.{i}.attn_q.weight", Q.Q4_K, (HEADS * HEAD_DIM, HIDDEN)),
              (f"blk.{i}.attn_k.weight", Q.Q4_K, (KV_HEADS * HEAD_DIM, HIDDEN)),
              (f"blk.{i}.attn_v.weight", more, (KV_HEADS * HEAD_DIM, HIDDEN)),
              (f"blk.{i}.attn_output.weight", Q.Q4_K, (HIDDEN, HEADS * HEAD_DIM)),
              (f"blk.{i}.ffn_norm.weight", Q.F32, (HIDDEN,)),
              (f"blk.{i}.ffn_gate.weight", Q.Q4_K, (FFN, HIDDEN)),
              (f"blk.{i}.ffn_up.weight", Q.Q4_K, (FFN, HIDDEN)),
              (f"blk.{i}.ffn_down.weight", more, (HIDDEN, FFN))]
    t += [("output_norm.weight", Q.F32, (HIDDEN,)), ("output.weight", Q.Q6_K, (n_vocab, HIDDEN))]
    return t


def nbytes(dtype: Q, shape: Tuple[int, ...]) -> int:
    if dtype == Q.F32:
        return 4 * int(np.prod(shape))
    rows, cols = shape
    return rows * cols // QK_K * BLOCKS[dtype][0]


def tokenizer_fields(path: str):
    """Every ``tokenizer.*`` key of a GGUF, as (key, value, type, array element type)."""
    r = gguf.GGUFReader(path)
    out = []
    for key, f in r.fields.items():
        if key.startswith("tokenizer."):
            sub = f.types[-1] if f.types[0] == V.ARRAY else None
            out.append((key, f.contents(), f.types[0], sub))
    return out


def default_out(n_layers: int) -> Path:
    stem = "synthetic-llama-3.1-8b-shapes" + ("" if n_layers == 32 else f"-{n_layers}l")
    try:
        from candle_gate.models import cache_dir
        d = cache_dir()
    except ImportError:
        d = Path("/tmp")
    return d / f"{stem}.Q4_K_M.gguf"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="default: the candle-gate cache dir (or /tmp), "
                    "synthetic-llama-3.1-8b-shapes[-<N>l].Q4_K_M.gguf")
    ap.add_argument("--layers", type=int, default=32, help="32 for the 8B shapes; fewer for a quick smoke test")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tokenizer-from", default=None,
                    help="a registry model name or a GGUF path whose tokenizer.* keys are copied "
                         "(default: candle-gate's default model, SmolLM2-135M-Instruct)")
    a = ap.parse_args(argv)
    if a.layers < 1:
        ap.error("--layers must be positive")
    out = Path(a.out) if a.out else default_out(a.layers)
    out.parent.mkdir(parents=True, exist_ok=True)

    if a.tokenizer_from and os.path.isfile(a.tokenizer_from):
        tok_path = a.tokenizer_from
    else:
        from candle_gate.models import resolve
        tok_path = str(resolve(a.tokenizer_from))
    fields = tokenizer_fields(tok_path)
    by_key = {k: v for k, v, _, _ in fields}
    tokens = by_key["tokenizer.ggml.tokens"]
    n_vocab = len(tokens)
    token_type = np.asarray(by_key.get("tokenizer.ggml.token_type", [1] * n_vocab))
    silent = set(np.nonzero(token_type == 3)[0].tolist())  # CONTROL tokens: end of turn, end of text, ...
    for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        if k in by_key:
            silent.add(int(by_key[k]))

    tensors = plan(a.layers, n_vocab)
    total = sum(nbytes(dt, sh) for _, dt, sh in tensors)
    print(f"writing {out}: {a.layers} layers, vocab {n_vocab} (tokenizer of {tok_path}), "
          f"{len(tensors)} tensors, {total / 1e9:.2f} GB of tensor data", flush=True)

    w = gguf.GGUFWriter(str(out), "llama")
    w.add_name(f"synthetic Llama-3.1-8B shapes, {a.layers} layers, random Q4_K_M weights (seed {a.seed})")
    w.add_block_count(a.layers)
    w.add_context_length(131072)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_vocab_size(n_vocab)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for key, val, vtype, sub in fields:
        w.add_key_value(key, val, vtype, sub)
    for name, dt, shape in tensors:
        if dt == Q.F32:
            w.add_tensor_info(name, shape, np.dtype(np.float32), nbytes(dt, shape))
        else:
            rows, cols = shape
            byte_shape = (rows, cols // QK_K * BLOCKS[dt][0])
            w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), nbytes(dt, shape), raw_dtype=dt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()

    rng = np.random.default_rng(a.seed)
    checked = set()
    t0, done = time.perf_counter(), 0
    for i, (name, dt, shape) in enumerate(tensors):
        if dt == Q.F32:
            data = np.ones(shape, dtype=np.float32)
        else:
            rows, cols = shape
            per_row = cols // QK_K
            block_bytes, make = BLOCKS[dt]
            data = make(rng, rows * per_row)
            if name == "output.weight":
                data.reshape(rows, per_row, block_bytes)[sorted(silent)] = 0  # d = 0: a zero row
            if dt not in checked:
                checked.add(dt)
                x = gguf.quants.dequantize(data[: 64 * per_row].reshape(64, -1), dt)
                print(f"  {name} ({dt.name}): dequantized weights mean {x.mean():+.5f} std {x.std():.5f}", flush=True)
            data = data.reshape(rows, per_row * block_bytes)
        w.write_tensor_data(data)
        done += data.nbytes
        del data
        if name.endswith("ffn_down.weight") or i == len(tensors) - 1:
            dt_s = time.perf_counter() - t0
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
            print(f"  [{i + 1}/{len(tensors)}] {name}: {done / 1e9:.2f}/{total / 1e9:.2f} GB, "
                  f"{dt_s:.0f} s, peak RSS {rss:.2f} GB", flush=True)
    w.close()
    print(f"wrote {out} ({out.stat().st_size / 1e9:.2f} GB)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
