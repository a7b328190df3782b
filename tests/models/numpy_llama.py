"""A plain numpy llama forward with weights dequantized by the `gguf` package: shares no code
with candle-gate, so agreement checks the model code (tests/test_reference.py)."""
from __future__ import annotations

import numpy as np


def load_weights(r, keep_f32=()) -> dict:
    """Every tensor of GGUF reader ``r``, dequantized by the `gguf` package, as float64 arrays in
    their [rows, cols] shape (those named in ``keep_f32`` stay float32: a large embedding)."""
    from gguf.quants import dequantize

    w = {}
    for t in r.tensors:
        a = dequantize(t.data, t.tensor_type).astype(np.float32 if t.name in keep_f32 else np.float64)
        w[t.name] = a.reshape([int(d) for d in reversed(t.shape)]) if a.ndim > 1 else a
    return w


class RmsNorm:
    eps: float

    def _norm(self, x, w):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.eps) * w


class NumpyLlama(RmsNorm):
    def __init__(self, path: str):
        from gguf import GGUFReader

        r = GGUFReader(path)
        meta = {}
        for k, f in r.fields.items():
            if k.startswith("llama.") or k == "general.architecture":
                meta[k] = f.contents()
        self.n_layer = int(meta["llama.block_count"])
        self.hidden = int(meta["llama.embedding_length"])
        self.n_head = int(meta["llama.attention.head_count"])
        self.n_kv = int(meta["llama.attention.head_count_kv"])
        self.hd = self.hidden // self.n_head
        self.eps = float(meta["llama.attention.layer_norm_rms_epsilon"])
        base = float(meta["llama.rope.freq_base"])
        self.inv_freq = 1.0 / base ** (np.arange(0, self.hd, 2, dtype=np.float64) / self.hd)
        self.w = load_weights(r)
        if "output.weight" not in self.w:
            self.w["output.weight"] = self.w["token_embd.weight"]

    def _rope(self, x, pos):
        # x: [T, H, hd], interleaved pairs (GGUF llama layout)
        ang = pos[:, None] * self.inv_freq[None, :]
        c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        a, b = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = a * c - b * s
        out[..., 1::2] = a * s + b * c
        return out

    def logits(self, tokens) -> np.ndarray:
        """Logits (float64) at every position of `tokens`, causal, from position 0."""
        T = len(tokens)
        pos = np.arange(T, dtype=np.float64)
        x = self.w["token_embd.weight"][np.asarray(tokens)]
        g = self.n_head // self.n_kv
        mask = np.triu(np.full((T, T), -np.inf), 1)
        for i in range(self.n_layer):
            def p(n, i=i):
                return self.w[f"blk.{i}.{n}.weight"]
            h = self._norm(x, p("attn_norm"))
            q = (h @ p("attn_q").T).reshape(T, self.n_head, self.hd)
            k = (h @ p("attn_k").T).reshape(T, self.n_kv, self.hd)
            v = (h @ p("attn_v").T).reshape(T, self.n_kv, self.hd)
            q, k = self._rope(q, pos), self._rope(k, pos)
            k = np.repeat(k, g, axis=1)
            v = np.repeat(v, g, axis=1)
            att = np.einsum("thd,shd->hts", q, k) / np.sqrt(self.hd) + mask
            att = np.exp(att - att.max(-1, keepdims=True))
            att /= att.sum(-1, keepdims=True)
            o = np.einsum("hts,shd->thd", att, v).reshape(T, self.hidden)
            x = x + o @ p("attn_output").T
            h = self._norm(x, p("ffn_norm"))
            gate = h @ p("ffn_gate").T
            up = h @ p("ffn_up").T
            x = x + (gate / (1 + np.exp(-gate)) * up) @ p("ffn_down").T
        x = self._norm(x, self.w["output_norm.weight"])
        return x @ self.w["output.weight"].T


class NumpyGemma3(RmsNorm):
    """Gemma 3 in plain numpy (float64), from llama.cpp's `gemma3` graph: embeddings times
    √hidden; per layer RMSNorm, attention with RMSNorm on each q and k head and NeoX RoPE (local
    layers: a sliding window and base 10,000; every sixth layer global), a norm on the attention
    output, then the same sandwich around a GELU(tanh)-gated FFN; tied output embeddings. Shares
    no code with candle-gate (tests/test_gemma.py)."""

    def __init__(self, path: str, reader=None):
        """``reader``: a ``gguf.GGUFReader`` of ``path`` already open (reading a 262k-token
        vocabulary's metadata takes seconds)."""
        from gguf import GGUFReader

        r = reader or GGUFReader(path)
        meta = {k: f.contents() for k, f in r.fields.items() if k.startswith("gemma3.")}
        self.n_layer = int(meta["gemma3.block_count"])
        self.hidden = int(meta["gemma3.embedding_length"])
        self.n_head = int(meta["gemma3.attention.head_count"])
        self.n_kv = int(meta["gemma3.attention.head_count_kv"])
        self.hd = int(meta["gemma3.attention.key_length"])
        self.eps = float(meta["gemma3.attention.layer_norm_rms_epsilon"])
        self.window = int(meta["gemma3.attention.sliding_window"])
        self.local = [i % 6 < 5 for i in range(self.n_layer)]
        freqs = np.arange(0, self.hd, 2, dtype=np.float64) / self.hd
        self.inv_freq = {False: 1.0 / float(meta["gemma3.rope.freq_base"]) ** freqs, True: 1.0 / 10000.0 ** freqs}
        # The 262k-row embedding stays float32 (1.3 GB in float64); rows are widened on use.
        self.w = load_weights(r, keep_f32={"token_embd.weight"})

    def _rope(self, x, pos, local):
        ang = pos[:, None] * self.inv_freq[local][None, :]
        c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        half = self.hd // 2
        a, b = x[..., :half], x[..., half:]
        return np.concatenate([a * c - b * s, a * s + b * c], axis=-1)

    def hidden_states(self, tokens) -> np.ndarray:
        """The final-normed hidden state (float64) at every position of `tokens`."""
        T = len(tokens)
        pos = np.arange(T, dtype=np.float64)
        x = self.w["token_embd.weight"][np.asarray(tokens)].astype(np.float64) * np.sqrt(self.hidden)
        g = self.n_head // self.n_kv
        t, s = np.arange(T)[:, None], np.arange(T)[None, :]
        masks = {False: np.where(s > t, -np.inf, 0.0), True: np.where((s > t) | (t - s >= self.window), -np.inf, 0.0)}
        for i in range(self.n_layer):
            def p(n, i=i):
                return self.w[f"blk.{i}.{n}.weight"]
            local = self.local[i]
            h = self._norm(x, p("attn_norm"))
            q = self._norm((h @ p("attn_q").T).reshape(T, self.n_head, self.hd), p("attn_q_norm"))
            k = self._norm((h @ p("attn_k").T).reshape(T, self.n_kv, self.hd), p("attn_k_norm"))
            v = (h @ p("attn_v").T).reshape(T, self.n_kv, self.hd)
            q, k = self._rope(q, pos, local), self._rope(k, pos, local)
            k, v = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
            att = np.einsum("thd,shd->hts", q, k) / np.sqrt(self.hd) + masks[local]
            att = np.exp(att - att.max(-1, keepdims=True))
            att /= att.sum(-1, keepdims=True)
            o = np.einsum("hts,shd->thd", att, v).reshape(T, self.n_head * self.hd)
            x = x + self._norm(o @ p("attn_output").T, p("post_attention_norm"))
            h = self._norm(x, p("ffn_norm"))
            gate, up = h @ p("ffn_gate").T, h @ p("ffn_up").T
            gelu = 0.5 * gate * (1 + np.tanh(np.sqrt(2 / np.pi) * (gate + 0.044715 * gate**3)))
            x = x + self._norm((gelu * up) @ p("ffn_down").T, p("post_ffw_norm"))
        return self._norm(x, self.w["output_norm.weight"])

    def logits_of(self, h: np.ndarray) -> np.ndarray:
        """Logits (float64) of one hidden state, through the tied embedding in row chunks."""
        e = self.w["token_embd.weight"]
        return np.concatenate([e[i:i + 32768].astype(np.float64) @ h for i in range(0, len(e), 32768)])

    def last_logits(self, tokens) -> np.ndarray:
        return self.logits_of(self.hidden_states(tokens)[-1])
