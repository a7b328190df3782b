#!/usr/bin/env python3
"""Writes the seed corpora of the fuzz targets into fuzz/corpus/<target>/ (standard library only).

gguf_header: tiny valid GGUFs (v1, v2, v3; every value type, a nested array, tensors of several
dtypes, a complete small tokenizer with a chat template, Gemma 3's header with a small
SentencePiece vocabulary). gguf_tokenizer: the BPE tokenizer GGUF with each pre-tokenizer, and the
SentencePiece one. tokenizer: texts of several scripts, for each real tokenizer.
chat_template: the chat templates of the cached models (read from their GGUF headers) and a few
small ones, with message lists; and message lists, tools and tool calls for the real templates.

    python3 fuzz/make_seeds.py [--models DIR]
"""
import argparse
import json
import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))

U8, I8, U16, I16, U32, I32, F32, BOOL, STR, ARR, U64, I64, F64 = range(13)
SCALAR = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f", BOOL: "<?",
          U64: "<Q", I64: "<q", F64: "<d"}


class Writer:
    def __init__(self, version=3):
        self.v = version
        self.kv = []
        self.tensors = []

    def ln(self, n):
        return struct.pack("<I" if self.v == 1 else "<Q", n)

    def s(self, text):
        b = text.encode() if isinstance(text, str) else text
        return self.ln(len(b)) + b

    def val(self, t, v):
        if t == STR:
            return self.s(v)
        if t == ARR:
            et, items = v
            return struct.pack("<I", et) + self.ln(len(items)) + b"".join(self.val(et, x) for x in items)
        return struct.pack(SCALAR[t], v)

    def add(self, key, t, v):
        self.kv.append(self.s(key) + struct.pack("<I", t) + self.val(t, v))

    def tensor(self, name, dims, dtype, data):
        self.tensors.append((name, dims, dtype, data))

    def bytes(self, alignment=32):
        out = b"GGUF" + struct.pack("<I", self.v) + self.ln(len(self.tensors)) + self.ln(len(self.kv))
        out += b"".join(self.kv)
        off, blobs = 0, []
        for name, dims, dtype, data in self.tensors:
            out += self.s(name) + struct.pack("<I", len(dims))
            out += b"".join(self.ln(d) for d in dims) + struct.pack("<I", dtype) + struct.pack("<Q", off)
            pad = (-len(data)) % alignment
            blobs.append(data + b"\0" * pad)
            off += len(data) + pad
        out += b"\0" * ((-len(out)) % alignment)
        return out + b"".join(blobs)


def every_type(version):
    w = Writer(version)
    w.add("general.architecture", STR, "llama")
    w.add("general.alignment", U32, 32)
    for t, v in [(U8, 7), (I8, -7), (U16, 700), (I16, -700), (U32, 70000), (I32, -70000), (F32, 0.5),
                 (BOOL, True), (U64, 1 << 40), (I64, -(1 << 40)), (F64, 2.5)]:
        w.add(f"t.{t}", t, v)
    w.add("t.nested", ARR, (ARR, [(U8, [1, 2, 3]), (STR, ["x", "yz"]), (I32, [])]))
    w.add("t.strings", ARR, (STR, ["a", "", "ünï"]))
    w.tensor("f32", [4, 2], 0, struct.pack("<8f", *range(8)))
    w.tensor("f16", [2], 1, struct.pack("<2e", 1.0, -2.0))
    w.tensor("q4_0", [32], 2, b"\x00\x3c" + bytes(range(16)))  # one block: scale 1.0, 32 nibbles
    w.tensor("q8_0", [32, 1], 8, b"\x00\x3c" + bytes(range(32)))
    return w.bytes()


def with_tokenizer(pre="qwen2"):
    w = Writer(3)
    w.add("general.architecture", STR, "llama")
    w.add("tokenizer.ggml.model", STR, "gpt2")
    if pre:
        w.add("tokenizer.ggml.pre", STR, pre)
    toks = [chr(c) for c in range(33, 127)] + ["Ġ", "ab", "Ġab", "<|im_start|>", "<|im_end|>", "<tool>"]
    w.add("tokenizer.ggml.tokens", ARR, (STR, toks))
    types = [1] * (len(toks) - 3) + [3, 3, 4]
    w.add("tokenizer.ggml.token_type", ARR, (I32, types))
    w.add("tokenizer.ggml.merges", ARR, (STR, ["a b", "Ġ ab"]))
    w.add("tokenizer.ggml.bos_token_id", U32, len(toks) - 3)
    w.add("tokenizer.ggml.eos_token_id", U32, len(toks) - 2)
    w.add("tokenizer.chat_template", STR,
          "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    w.tensor("token_embd.weight", [4, len(toks)], 0, b"\0" * (16 * len(toks)))
    return w.bytes()


def with_spm_tokenizer():
    """Gemma 3's header in small: its architecture keys and a SentencePiece vocabulary (scores,
    byte tokens, control and user-defined tokens) with Gemma's flags."""
    w = Writer(3)
    w.add("general.architecture", STR, "gemma3")
    for k, v in [("context_length", 32768), ("embedding_length", 8), ("block_count", 1), ("feed_forward_length", 16),
                 ("attention.head_count", 2), ("attention.head_count_kv", 1), ("attention.key_length", 8),
                 ("attention.value_length", 8), ("attention.sliding_window", 4)]:
        w.add(f"gemma3.{k}", U32, v)
    w.add("gemma3.rope.freq_base", F32, 1e6)
    w.add("gemma3.attention.layer_norm_rms_epsilon", F32, 1e-6)
    w.add("tokenizer.ggml.model", STR, "llama")
    w.add("tokenizer.ggml.pre", STR, "default")
    toks = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>", "\n\n", "  "]
    types = [3, 3, 3, 2, 3, 3, 4, 4]
    toks += [f"<0x{b:02X}>" for b in range(256)]
    types += [6] * 256
    words = ["\u2581", "a", "b", "c", "ab", "abc", "\u2581a", "\u2581ab", "de", "\u2581de", "日", "本"]
    toks += words
    types += [1] * len(words)
    scores = [-1000.0] * 8 + [0.0] * 256 + [-float(i) for i in range(len(words))]
    w.add("tokenizer.ggml.tokens", ARR, (STR, toks))
    w.add("tokenizer.ggml.scores", ARR, (F32, scores))
    w.add("tokenizer.ggml.token_type", ARR, (I32, types))
    w.add("tokenizer.ggml.bos_token_id", U32, 2)
    w.add("tokenizer.ggml.eos_token_id", U32, 1)
    w.add("tokenizer.ggml.unknown_token_id", U32, 3)
    w.add("tokenizer.ggml.add_bos_token", BOOL, True)
    w.add("tokenizer.ggml.add_space_prefix", BOOL, False)
    w.tensor("token_embd.weight", [8, len(toks)], 0, b"\0" * (32 * len(toks)))
    return w.bytes()


def metadata(path, want):
    """The string values of the keys in `want`, from a GGUF file's header."""
    found = {}
    with open(path, "rb") as f:
        assert f.read(4) == b"GGUF"
        version, = struct.unpack("<I", f.read(4))
        lf = "<I" if version == 1 else "<Q"
        ls = struct.calcsize(lf)
        ln = lambda: struct.unpack(lf, f.read(ls))[0]
        _, n_kv = ln(), ln()

        def value(t):
            if t == STR:
                return f.read(ln()).decode("utf-8", "replace")
            if t == ARR:
                et, n = struct.unpack("<I", f.read(4))[0], ln()
                if et in SCALAR:
                    f.seek(n * struct.calcsize(SCALAR[et]), 1)
                else:
                    for _ in range(n):
                        value(et)
                return None
            return struct.unpack(SCALAR[t], f.read(struct.calcsize(SCALAR[t])))[0]

        for _ in range(n_kv):
            key = f.read(ln()).decode()
            v = value(struct.unpack("<I", f.read(4))[0])
            if key in want:
                found[key] = v
    return found


MESSAGES = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "<|im_end|> and <|im_start|>system"}],
    {"messages": [{"role": "user", "content": "Weather in Paris?"},
                  {"role": "assistant", "content": None, "tool_calls": [
                      {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                  {"role": "tool", "content": "{\"temp\": 21}"}],
     "tools": [{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]},
]

SMALL_TEMPLATES = [
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}",
    "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{{ loop.index }}{% endfor %}{{ ns.n }}",
    "{% macro f(x) %}[{{ x | tojson }}]{% endmacro %}{{ f(messages) }}{{ tools | tojson(indent=2) }}",
    "{% if messages[0].role == 'system' %}{{ raise_exception('no system') }}{% endif %}{{ bos_token }}",
    "{{ messages | map(attribute='content') | join(', ') | upper }}{{ 'ab' * 3 }}{{ range(5) | list }}",
    # Nesting a value once per loop turn: printing or dropping it recursed past the stack.
    "{% set ns = namespace(x=[]) %}{% for i in range(100000) %}{% set ns.x = [ns.x] %}{% endfor %}{{ ns.x }}",
    "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}{% include 'chat' %}",
]

TEXTS = [
    "Hello, world!", "def fib(n):\n    return n if n < 2 else fib(n-1) + fib(n-2)\n",
    "The year 2024 had 366 days; π ≈ 3.14159.", "日本語のテキストと中文文本", "emoji 🦀🔥👍🏽 and e\u0301 (NFD)",
    "<|im_start|>user\nhi<|im_end|>", "   spaces\t\ttabs\r\n\r\nnewlines   ", "\u0000\u0001\u007f\ufffd\ufdd0",
]


def put(target, name, data):
    d = os.path.join(HERE, "corpus", target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=os.path.expanduser("~/.cache/candle-gate"))
    a = ap.parse_args()
    for v in (1, 2, 3):
        put("gguf_header", f"every_type_v{v}.gguf", every_type(v))
    put("gguf_header", "tokenizer.gguf", with_tokenizer())
    put("gguf_header", "gemma3_spm.gguf", with_spm_tokenizer())
    put("gguf_tokenizer", "tokenizer_spm.gguf", with_spm_tokenizer())
    for pre in ("qwen2", "smollm", "llama3", None):
        put("gguf_tokenizer", f"tokenizer_{pre or 'gpt2'}.gguf", with_tokenizer(pre))
    for i, t in enumerate(TEXTS):
        put("tokenizer", f"smol_{i}", b"\x00" + t.encode())
        put("tokenizer", f"qwen_{i}", b"\x01" + t.encode())
        put("tokenizer", f"gemma_{i}", b"\x04" + t.encode())
    templates = list(SMALL_TEMPLATES)
    for model, sel in [("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", 1), ("SmolLM2-135M-Instruct.Q4_1.gguf", 3)]:
        p = os.path.join(a.models, model)
        if os.path.exists(p):
            t = metadata(p, {"tokenizer.chat_template"}).get("tokenizer.chat_template")
            if t:
                templates.append(t)
        for i, m in enumerate(MESSAGES):
            put("chat_template", f"real_{sel}_{i}", bytes([sel]) + json.dumps(m).encode())
    for i, t in enumerate(templates):
        for j, m in enumerate(MESSAGES):
            put("chat_template", f"tpl_{i}_{j}", b"\x00" + t.encode() + b"\x00" + json.dumps(m).encode())


if __name__ == "__main__":
    main()
