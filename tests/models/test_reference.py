"""An independent check of the model code: a plain numpy llama forward (weights dequantized by
the `gguf` package, float64) against candle-gate's FP32 reference lane and its fast lanes."""
import numpy as np
import pytest

import candle_gate
from .numpy_llama import NumpyLlama

pytestmark = pytest.mark.model  # loads a model, or serves one


@pytest.fixture(scope="module")
def np_model():
    return NumpyLlama(str(candle_gate.resolve()))


PROMPTS = ["The capital of France is", "def add(a, b):\n    return", "Water boils at"]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_reference_lane_matches_numpy(model, np_model, prompt):
    toks = model.tokenize(prompt)
    want = np_model.logits(toks)
    for n in (1, len(toks)):
        ref = model._native.logits(toks[:n], "reference").astype(np.float64)
        rel = np.abs(ref - want[n - 1]).max() / np.abs(want[n - 1]).max()
        assert rel < 1e-4, (n, rel)
    blockwise = model._native.logits(toks, "reference", "blockwise")
    dense = model._native.logits(toks, "reference", "dense")
    assert blockwise.view(np.uint32).tolist() == dense.view(np.uint32).tolist()


def test_fast_lanes_against_numpy(np_model):
    toks = candle_gate.Model.load().tokenize(PROMPTS[0])
    want = np_model.logits(toks)[-1]
    model = candle_gate.Model.load()
    gemm = model._native.logits(toks, mode="gemm").astype(np.float64)
    inv = model._native.logits(toks, mode="invariant").astype(np.float64)
    scale = np.abs(want).max()
    assert np.abs(gemm - want).max() / scale < 1e-3
    # the quantized-activation lane is further off (Q8 activations), but picks the same token
    assert np.abs(inv - want).max() / scale < 0.1
    assert inv.argmax() == want.argmax() == gemm.argmax()
