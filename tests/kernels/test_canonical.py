"""The canonical mode end to end on the CPU: the order a CUDA warp computes (docs/CUDA.md), run
by the real model: sensible text, and every request's bits the same alone and in a batch."""
import numpy as np
import pytest

import candle_gate

pytestmark = pytest.mark.model  # loads a model, or serves one

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]


@pytest.fixture(scope="module")
def canonical():
    return candle_gate.Model.load(layout="canonical")


def test_canonical_mode_is_listed_and_answers(canonical):
    assert "canonical" in candle_gate.MODES
    r = canonical.generate([PROMPTS[0]], max_new_tokens=4)[0]
    assert r.text.startswith(" Paris")


def test_canonical_mode_gives_a_request_the_same_bits_alone_and_batched(canonical):
    batched = canonical.generate(PROMPTS, max_new_tokens=12)
    for prompt, b in zip(PROMPTS, batched):
        a = canonical.generate([prompt], max_new_tokens=12)[0]
        assert a.token_ids.tolist() == b.token_ids.tolist(), prompt
        assert a.margins.view(np.uint32).tolist() == b.margins.view(np.uint32).tolist(), prompt
        assert a.fingerprint == b.fingerprint


def test_canonical_logits_differ_from_invariant_only_by_rounding(canonical):
    # Another order over the same quantized weights: not the same bits as `invariant`, but the
    # same numbers to within activation quantization and rounding.
    invariant = candle_gate.Model.load(layout="invariant")
    toks = canonical.tokenize(PROMPTS[1])
    a, b = canonical._native.logits(toks), invariant._native.logits(toks)
    assert a.view(np.uint32).tolist() != b.view(np.uint32).tolist()
    assert int(np.argmax(a)) == int(np.argmax(b))
    assert float(np.abs(a - b).max()) < 0.05 * float(np.abs(b).max())


@pytest.mark.parametrize("name", [
    "smollm2-135m-instruct-q4_1",
    "qwen2.5-coder-0.5b-instruct-q4_k_m",
    pytest.param("qwen2.5-coder-1.5b-instruct-q4_k_m", marks=pytest.mark.slow),
    "gemma-3-270m-q4_k_m",
])
def test_probe_finds_no_mismatch_in_canonical_mode_on_every_registry_model(name):
    # The whole forward in the canonical order (docs/CANONICAL.md): every composition the probe
    # builds (batches, mixed prefill, staggered arrivals...) leaves each request's logits bitwise
    # its solo run's, on each registry model's dtypes (Q4_1/Q8_0, Q5_0/Q4_K/Q6_K/Q8_0, ...).
    import candle_gate.probe as probe
    r = probe.run_probe(name, prompts=PROMPTS, max_new_tokens=6, mode="canonical", progress=False,
                        mixed_prefill_every=1000)
    assert r["scored_steps"] > 0
    for c in r["compositions"]:
        assert c["logit_bit_mismatches"] == 0 and c["diverging_sequences"] == 0, (name, c)
    assert r["distinct_outputs"] == [1] * len(PROMPTS)
