"""The default model end to end from Python: generation, chat, CLI, determinism, bad input."""
import json
import subprocess
import sys

import numpy as np
import pytest

import candle_gate
from candle_gate import CandleGateError


def run_cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "candle_gate", *args], capture_output=True, text=True,
                          env=env, timeout=600)


@pytest.mark.model
def test_cli_capital_of_france():
    r = run_cli("generate", "The capital of France is", "--max-new-tokens", "8")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(" Paris"), r.stdout


@pytest.mark.model
@pytest.mark.parametrize("prompt,answer", [
    ("The capital of Japan is", "Tokyo"),
    ("The capital of Italy is", "Rome"),
    ("The largest planet in the solar system is", "Jupiter"),
    ("The chemical symbol for gold is", "Au"),
])
def test_factual_prompts(model, prompt, answer):
    [r] = model.generate([prompt], max_new_tokens=8)
    assert answer in r.text, r.text


@pytest.mark.model
def test_chat_reply_stops_at_end_of_turn(model):
    [r] = model.generate([[{"role": "user", "content": "What is 2+2?"}]], max_new_tokens=48)
    assert r.finish_reason == "eos", (r.finish_reason, r.text)
    assert "4" in r.text
    assert "<|im_end|>" not in r.text
    assert int(r.token_ids[-1]) in model._native.stop_ids


@pytest.mark.model
def test_generate_returns_numpy_and_fingerprint(model):
    rs = model.generate(["Once upon a time", "The capital of France is"], max_new_tokens=6)
    assert [len(r.token_ids) for r in rs] == [6, 6]
    for r in rs:
        assert isinstance(r.token_ids, np.ndarray) and r.token_ids.dtype == np.uint32
        assert isinstance(r.margins, np.ndarray) and r.margins.dtype == np.float32
        assert (r.margins >= 0).all()
        assert len(r.fingerprint) == 32
        assert model.detokenize(r.token_ids) == r.text
    assert rs[1].text.startswith(" Paris")


@pytest.mark.model
def test_stop_strings(model):
    [r] = model.generate(["The capital of France is"], max_new_tokens=16, stop=["\n"])
    assert r.finish_reason == "stop" and "\n" not in r.text and r.text.startswith(" Paris")


@pytest.mark.model
def test_stop_string_spanning_tokens_cuts_at_its_first_occurrence(model):
    prompt = "Once upon a time, in a small village by the sea,"
    [full] = model.generate([prompt], max_new_tokens=24)
    # a stop string that starts inside one token and ends inside a later one
    pieces = [model.detokenize(full.token_ids[:i]) for i in range(len(full.token_ids) + 1)]
    start = len(pieces[3]) + 1
    stop = full.text[start:len(pieces[6]) - 1]
    assert len(stop) >= 3
    [r] = model.generate([prompt], max_new_tokens=24, stop=["never-appears-xyz", stop])
    assert r.finish_reason == "stop"
    assert r.text == full.text[:full.text.index(stop)]


@pytest.mark.model
def test_cli_greedy_json_is_the_same_each_run():
    """Greedy decoding draws nothing: no freshly drawn seed makes two runs' JSON differ (issue 53)."""
    a, b = (run_cli("generate", "The capital of France is", "--max-new-tokens", "4", "--json") for _ in range(2))
    assert a.returncode == 0, a.stderr
    assert a.stdout == b.stdout and "seed" not in json.loads(a.stdout)


@pytest.mark.model
def test_cli_json_and_chat():
    r = run_cli("generate", "What is 2+2?", "--chat", "--json", "--max-new-tokens", "48")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert {"text", "token_ids", "margins", "fingerprint", "finish_reason"} <= set(out)
    assert out["finish_reason"] == "eos"


@pytest.mark.model
def test_two_runs_bitwise_equal(model):
    toks = model.tokenize("The history of the printing press begins")
    a = model._native.logits(toks)
    b = model._native.logits(toks)
    assert a.view(np.uint32).tolist() == b.view(np.uint32).tolist()
    r1 = model.generate(["The history of the printing press begins"], max_new_tokens=10)[0]
    r2 = model.generate(["The history of the printing press begins"], max_new_tokens=10)[0]
    assert r1.token_ids.tolist() == r2.token_ids.tolist()
    assert r1.margins.view(np.uint32).tolist() == r2.margins.view(np.uint32).tolist()
    assert r1.fingerprint == r2.fingerprint


@pytest.mark.model
def test_utf8_streaming_is_safe(model):
    # Emoji and accented text are split across byte-level tokens; every streamed delta must be
    # valid text and the deltas must add up to the final text.
    eng = candle_gate.Engine(model)
    rid = eng.submit("Write three emoji: 🎉🚀🌍 and the word café", max_new_tokens=12)
    deltas = [ev["text"] for ev in eng.stream() if ev["type"] == "token"]
    r = eng.result(rid)
    assert "".join(deltas) == r.text
    for d in deltas:
        d.encode("utf-8")
    bytes_ = model._native.token_bytes([int(t) for t in model.tokenize("🎉")])
    assert bytes_.decode("utf-8") == "🎉"


@pytest.mark.model
def test_model_path_and_config(model):
    c = model.config
    assert (c["n_layer"], c["hidden"], c["n_head"], c["n_kv_head"], c["vocab"]) == (30, 576, 9, 3, 49152)
    assert model.sha256() == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


# ---- bad input -------------------------------------------------------------------------------

def write_gguf(path, arch="llama", drop=None, bad_shape=None):
    import gguf
    w = gguf.GGUFWriter(str(path), arch)
    h, ffn, nl = 64, 128, 1
    w.add_block_count(nl)
    w.add_embedding_length(h)
    w.add_feed_forward_length(ffn)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_context_length(128)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_tokenizer_model("gpt2")
    toks = [chr(c) for c in range(33, 127)] + ["ab"]
    w.add_token_list(toks)
    w.add_token_merges(["a b"])
    w.add_eos_token_id(0)
    kv = h // 4 * 2
    shapes = {"token_embd.weight": (len(toks), h), "output_norm.weight": (h,),
              "blk.0.attn_norm.weight": (h,), "blk.0.ffn_norm.weight": (h,),
              "blk.0.attn_q.weight": (h, h), "blk.0.attn_k.weight": (kv, h), "blk.0.attn_v.weight": (kv, h),
              "blk.0.attn_output.weight": (h, h), "blk.0.ffn_gate.weight": (ffn, h),
              "blk.0.ffn_up.weight": (ffn, h), "blk.0.ffn_down.weight": (h, ffn)}
    if bad_shape:
        shapes[bad_shape] = (shapes[bad_shape][0] * 2,) + shapes[bad_shape][1:]
    for name, shape in shapes.items():
        if name != drop:
            w.add_tensor(name, np.full(shape, 0.01, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_tiny_valid_gguf_loads(tmp_path):
    p = tmp_path / "ok.gguf"
    write_gguf(p)
    m = candle_gate.Model.load(str(p))
    [r] = m.generate([[1, 2, 3]], max_new_tokens=2)
    assert 1 <= len(r.token_ids) <= 2 and r.finish_reason in ("eos", "length")


@pytest.mark.parametrize("kind,needle", [
    ("not_gguf", "not a GGUF file"),
    pytest.param("truncated", "truncated", marks=pytest.mark.model),  # cut from the real model
    ("arch", "unsupported architecture `gpt2`"),
    ("missing", "missing tensor `blk.0.ffn_up.weight`"),
    ("shape", "blk.0.attn_q.weight"),
    ("nofile", "neither a file nor a known model name"),
])
def test_bad_model_files_raise_clear_errors(tmp_path, kind, needle):
    p = tmp_path / "m.gguf"
    if kind == "not_gguf":
        p.write_bytes(b"hello, this is not a model" * 10)
    elif kind == "truncated":
        src = candle_gate.resolve()
        with open(src, "rb") as f:
            p.write_bytes(f.read(5_000_000))
    elif kind == "arch":
        write_gguf(p, arch="gpt2")
    elif kind == "missing":
        write_gguf(p, drop="blk.0.ffn_up.weight")
    elif kind == "shape":
        write_gguf(p, bad_shape="blk.0.attn_q.weight")
    elif kind == "nofile":
        p = tmp_path / "does-not-exist.gguf"
    with pytest.raises((CandleGateError, FileNotFoundError)) as e:
        candle_gate.Model.load(str(p))
    assert needle in str(e.value)


@pytest.mark.model
def test_bad_generate_inputs(model):
    with pytest.raises(ValueError, match="empty prompt"):
        model.generate([""], max_new_tokens=4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        model.generate(["hi"], max_new_tokens=0)
    with pytest.raises(TypeError):
        model.generate([3.5], max_new_tokens=4)
    with pytest.raises(ValueError, match="unknown mode"):
        candle_gate.Engine(model, mode="fastest")
    with pytest.raises(ValueError, match="unknown weight layout"):
        candle_gate.Model.load(layout="fastest")
    # the mode is the engine's: a Model.load given one says where it went
    with pytest.raises(TypeError, match=r"Engine\(model, mode=\.\.\., profile=\.\.\.\)"):
        candle_gate.Model.load(mode="canonical")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        model.generate([[10**9]], max_new_tokens=2)


@pytest.mark.model
def test_model_download_is_atomic_and_verified(tmp_path, monkeypatch):
    """A cache with a half-written temp file still downloads and verifies the real model."""
    from candle_gate import models
    monkeypatch.setenv("CANDLE_GATE_CACHE", str(tmp_path))
    (tmp_path / ".download-leftover").mkdir()
    (tmp_path / ".download-leftover" / "SmolLM2-135M-Instruct.Q4_1.gguf.part").write_bytes(b"partial")
    # A file at the final name is trusted only by name; make sure resolve() finds nothing yet.
    assert not (tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf").exists()
    p = models.fetch(quiet=True)
    assert models._sha256(p) == models.KNOWN_MODELS[models.DEFAULT_MODEL].sha256


def test_host_signature_names_what_decides_the_bits():
    from candle_gate import _native
    inv = _native.host_signature("invariant")
    # Our kernels and math are compiled for a fixed target: that is all that enters...
    assert inv.startswith("target=") and "gemm[" not in inv and "candle_q[" not in inv
    assert _native.host_signature("split_k_f16") == inv
    # ...while modes over Candle's run-time dispatched kernels also carry what this host picked.
    assert _native.host_signature("gemm").startswith(inv + ";gemm[")
    assert "candle_q[" in _native.host_signature("native")
    with pytest.raises(ValueError, match="unknown mode"):
        _native.host_signature("fastest")
