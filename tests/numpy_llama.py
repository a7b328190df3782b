"""A plain numpy llama forward with weights dequantized by the `gguf` package: shares no code
with candle-gate, so agreement checks the model code (tests/test_reference.py)."""
from __future__ import annotations

import numpy as np


class NumpyLlama:
    def __init__(self, path: str):
        from gguf import GGUFReader
        from gguf.quants import dequantize

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
        self.w = {}
        for t in r.tensors:
            a = dequantize(t.data, t.tensor_type).astype(np.float64)
            self.w[t.name] = a.reshape([int(d) for d in reversed(t.shape)]) if a.ndim > 1 else a
        if "output.weight" not in self.w:
            self.w["output.weight"] = self.w["token_embd.weight"]

    def _norm(self, x, w):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.eps) * w

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
