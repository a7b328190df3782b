"""SentencePiece-style tokenization over a GGUF vocabulary, written from the algorithm's
description (llama.cpp's `llm_tokenizer_spm`), sharing no code with candle-gate: the added
tokens (user-defined, always; control, never, in user text) are cut out longest first over the
whole text, as llama.cpp partitions; each run of text between them has its spaces made `▁` and
is merged pair by pair, the highest-scoring joinable pair first (leftmost among equals), with
byte-token fallback for what is left (tests/test_gemma.py)."""
from __future__ import annotations

import heapq


class SpmReference:
    def __init__(self, path: str, reader=None):
        from gguf import GGUFReader

        r = reader or GGUFReader(path)
        tokens = r.fields["tokenizer.ggml.tokens"].contents()
        scores = r.fields["tokenizer.ggml.scores"].contents()
        types = r.fields["tokenizer.ggml.token_type"].contents()
        self.bos = int(r.fields["tokenizer.ggml.bos_token_id"].contents())
        self.ids, self.scores, self.byte = {}, scores, {}
        self.added = []
        for i, (t, ty) in enumerate(zip(tokens, types)):
            if ty == 6:
                self.byte[int(t[3:5], 16)] = i
            elif ty == 4:
                self.added.append((t, i))
            if ty not in (3, 6):
                self.ids.setdefault(t, i)
        self.added.sort(key=lambda p: -len(p[0]))

    def _partition(self, text: str):
        """Fragments: ``str`` runs of text and ``int`` added tokens."""
        frags = [text]
        for piece, tid in self.added:
            out = []
            for f in frags:
                if isinstance(f, int):
                    out.append(f)
                    continue
                parts = f.split(piece)
                for j, p in enumerate(parts):
                    if j:
                        out.append(tid)
                    if p:
                        out.append(p)
            frags = out
        return frags

    def _spm(self, text: str):
        sym = list(text.replace(" ", "\u2581"))
        alive = [True] * len(sym)
        nxt = list(range(1, len(sym))) + [-1]
        prv = list(range(-1, len(sym) - 1))
        heap = []

        def push(a, b):
            t = sym[a] + sym[b]
            if t in self.ids:
                heapq.heappush(heap, (-self.scores[self.ids[t]], a, b, t))

        for a in range(len(sym) - 1):
            push(a, a + 1)
        while heap:
            _, a, b, t = heapq.heappop(heap)
            if not (alive[a] and alive[b]) or sym[a] + sym[b] != t or nxt[a] != b:
                continue
            sym[a], alive[b] = t, False
            nxt[a] = nxt[b]
            if nxt[b] != -1:
                prv[nxt[b]] = a
            if prv[a] != -1:
                push(prv[a], a)
            if nxt[a] != -1:
                push(a, nxt[a])
        out = []
        i = 0 if sym else -1
        while i != -1:
            s = sym[i]
            out.extend([self.ids[s]] if s in self.ids else [self.byte[b] for b in s.encode()])
            i = nxt[i]
        return out

    def encode(self, text: str):
        """Ids of user text, BOS first (as the GGUF asks)."""
        ids = [self.bos]
        for f in self._partition(text):
            ids.extend([f] if isinstance(f, int) else self._spm(f))
        return ids
