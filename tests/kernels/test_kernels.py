"""Property tests of the kernel claims over random shapes, dtypes and row counts."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from candle_gate._native import _testing  # test scaffolding, not the binding's API

BLOCK = {"q4_0": 32, "q4_1": 32, "q5_0": 32, "q5_1": 32, "q8_0": 32, "q2k": 256, "q3k": 256,
         "q4k": 256, "q5k": 256, "q6k": 256, "q8k": 256, "f16": 1, "f32": 1}


@settings(max_examples=60, deadline=None)
@given(dtype=st.sampled_from(sorted(BLOCK)), n=st.integers(1, 300), kb=st.integers(1, 6),
       m=st.integers(1, 40), seed=st.integers(0, 2**32))
def test_invariant_is_bitwise_gemv_and_gemm_is_close(dtype, n, kb, m, seed):
    k = kb * max(BLOCK[dtype], 32)
    out = _testing.kernel_outputs(dtype, n, k, m, seed)
    gemv, inv, gemm = out["gemv_row_split"], out["invariant"], out["gemm"]
    assert gemv.shape == (m * n,)
    assert inv.view(np.uint32).tolist() == gemv.view(np.uint32).tolist()
    # Row 0 alone, and the first rows alone as a smaller batch, get the same bits as inside
    # the batch (the inputs of a smaller m are a prefix of these).
    alone = _testing.kernel_outputs(dtype, n, k, 1, seed)["invariant"]
    assert alone.view(np.uint32).tolist() == inv[:n].view(np.uint32).tolist()
    m2 = int(np.random.default_rng(seed).integers(1, m + 1))
    prefix = _testing.kernel_outputs(dtype, n, k, m2, seed)["invariant"]
    assert prefix.view(np.uint32).tolist() == inv[:m2 * n].view(np.uint32).tolist()
    scale = max(float(np.abs(gemv).max()), 1e-3)
    assert float(np.abs(gemm - gemv).max()) <= 0.05 * scale + 0.05 * np.sqrt(k)
    # split_k_f16 is the dense product at half precision: within f16 rounding of gemm
    split = out["split_k_f16"]
    assert (split == split.astype(np.float16).astype(np.float32)).all()
    assert float(np.abs(split - gemm).max()) <= 2e-3 * float(np.abs(gemm).max()) + 1e-2 * np.sqrt(k)


@pytest.mark.parametrize("args,needle", [
    (("q9_9", 8, 32, 1, 0), "unknown GGML dtype"),
    (("q4_1", 8, 33, 1, 0), "block size"),
    (("q4_1", 8, 32, 0, 0), "zero rows"),
    (("bf16", 8, 32, 1, 0), "no CPU kernel"),
])
def test_kernel_bad_input_raises(args, needle):
    with pytest.raises(Exception) as e:
        _testing.kernel_outputs(*args)
    assert needle in str(e.value)


@pytest.mark.model
def test_profile_errors(tmp_path):
    import candle_gate
    from candle_gate import CandleGateError
    model = candle_gate.Model.load()
    with pytest.raises(CandleGateError, match="cannot read"):
        candle_gate.Engine(model, profile=str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{nope")
    with pytest.raises(CandleGateError, match="not a candle-gate profile"):
        candle_gate.Engine(model, profile=str(bad))
    other = tmp_path / "cuda.json"
    other.write_text('{"backend": "cuda", "created": "x", "dtypes": {"q4_1": {"row_split_max": 8, "crossover_rows": 9}}}')
    with pytest.raises(CandleGateError, match="measured on backend"):
        candle_gate.Engine(model, profile=str(other))
    ok = tmp_path / "cpu.json"
    ok.write_text('{"backend": "cpu", "created": "x", "dtypes": {"q4_1": {"row_split_max": 6, "crossover_rows": 7}}}')
    e = candle_gate.Engine(model, profile=str(ok), mode="row_split")
    assert "cpu:q4_1=6" in e._native.policy


def test_the_kernel_tier_is_named_and_capped_by_the_environment():
    """`--version` names the CPU kernels' tier; CANDLE_GATE_ISA caps it (never widens it)."""
    import os
    import subprocess
    import sys

    from candle_gate import _native

    def version(env):
        out = subprocess.run([sys.executable, "-m", "candle_gate", "--version"], env={**os.environ, **env},
                             capture_output=True, text=True, check=True).stdout
        return out.strip().rsplit("CPU kernels: ", 1)[1].rstrip(")")

    tiers = ["portable", "avx2", "avx512"]
    best = version({"CANDLE_GATE_ISA": "avx512"})
    assert best in tiers and _native.kernel_tier() in tiers
    assert version({"CANDLE_GATE_ISA": "portable"}) == "portable"
    assert version({"CANDLE_GATE_ISA": "avx2"}) == tiers[min(tiers.index(best), 1)]
