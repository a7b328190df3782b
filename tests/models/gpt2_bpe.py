"""An independent GPT-2 byte-level BPE, to check candle-gate's tokenizer against.

Nothing here shares code with the Rust side (which uses the `tokenizers` crate): the vocabulary
and merges are read with the `gguf` package, pre-tokenization uses the `regex` module with the
pattern llama.cpp and Qwen2's ``tokenizer.json`` give, and the merge loop is OpenAI's original
``encoder.py`` algorithm (lowest-ranked pair first). Added tokens follow llama.cpp's rule for
text that is not a template: user-defined tokens (type 4) are matched, control tokens are not.
"""
from __future__ import annotations

import unicodedata
from functools import lru_cache
from typing import Dict, List, Tuple

import gguf
import regex

QWEN2_SPLIT = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _byte_to_unicode() -> Dict[int, str]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


class Gpt2Bpe:
    def __init__(self, gguf_path: str):
        r = gguf.GGUFReader(gguf_path)
        assert r.fields["tokenizer.ggml.pre"].contents() == "qwen2", "this reference implements the qwen2 split"
        tokens: List[str] = r.fields["tokenizer.ggml.tokens"].contents()
        types: List[int] = r.fields["tokenizer.ggml.token_type"].contents()
        merges: List[str] = r.fields["tokenizer.ggml.merges"].contents()
        self.vocab = {t: i for i, t in enumerate(tokens)}
        self.ranks: Dict[Tuple[str, str], int] = {tuple(m.split(" ", 1)): i for i, m in enumerate(merges)}
        self.user_defined = sorted((t for t, ty in zip(tokens, types) if ty == 4), key=len, reverse=True)
        self.split = regex.compile(QWEN2_SPLIT)
        self.b2u = _byte_to_unicode()

    @lru_cache(maxsize=None)  # noqa: B019 (one tokenizer per test session)
    def _bpe(self, word: str) -> Tuple[str, ...]:
        parts = list(word)
        none = 1 << 62
        while len(parts) > 1:
            rank, first = min((self.ranks.get(pair, none), i) for i, pair in enumerate(zip(parts, parts[1:])))
            if rank == none:
                break
            a, b = parts[first], parts[first + 1]
            merged, i = [], 0
            while i < len(parts):
                if i < len(parts) - 1 and parts[i] == a and parts[i + 1] == b:
                    merged.append(a + b)
                    i += 2
                else:
                    merged.append(parts[i])
                    i += 1
            parts = merged
        return tuple(parts)

    def _encode_plain(self, text: str) -> List[int]:
        out = []
        for piece in self.split.findall(unicodedata.normalize("NFC", text)):
            word = "".join(self.b2u[b] for b in piece.encode("utf-8"))
            out.extend(self.vocab[p] for p in self._bpe(word))
        return out

    def encode(self, text: str) -> List[int]:
        out, gap, i = [], [], 0
        while i < len(text):
            hit = next((t for t in self.user_defined if text.startswith(t, i)), None)
            if hit:
                out += self._encode_plain("".join(gap))
                gap = []
                out.append(self.vocab[hit])
                i += len(hit)
            else:
                gap.append(text[i])
                i += 1
        return out + self._encode_plain("".join(gap))
