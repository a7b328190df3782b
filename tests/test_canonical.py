"""The canonical mode end to end on the CPU: the order a CUDA warp computes (docs/CUDA.md), run
by the real model: sensible text, and every request's bits the same alone and in a batch."""
import numpy as np
import pytest

import candle_gate

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]


@pytest.fixture(scope="module")
def canonical():
    return candle_gate.Model.load(mode="canonical")


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
    invariant = candle_gate.Model.load(mode="invariant")
    toks = canonical.tokenize(PROMPTS[1])
    a, b = canonical._native.logits(toks), invariant._native.logits(toks)
    assert a.view(np.uint32).tolist() != b.view(np.uint32).tolist()
    assert int(np.argmax(a)) == int(np.argmax(b))
    assert float(np.abs(a - b).max()) < 0.05 * float(np.abs(b).max())
