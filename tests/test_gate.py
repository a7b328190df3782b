"""The margin gate over a fast lane that is not batch invariant (gemm_f16: F16 dense GEMM, the
CPU stand-in for a half-precision GPU lane). These prompts were *not* used for calibration
(candle_gate.calibrate.CALIBRATION_PROMPTS is a separate set)."""
import numpy as np
import pytest

import candle_gate
from candle_gate import Engine

# Eight chats decoded as one batch; without the gate two of them leave their batch-1 path.
TOPICS = ["the ocean", "a lost key", "quantum computers", "the Roman empire", "baking bread",
          "a robot learning to paint", "climate change", "the first day of school"]
CHATS = [[{"role": "user", "content": f"Explain {t} to a child."}] for t in TOPICS]
N = 64
TAU = 0.1


@pytest.fixture(scope="module")
def f16_model():
    return candle_gate.Model.load(mode="gemm_f16")


def run(model, gate, tau=0.0):
    alone = [Engine(model, gate=gate, tau=tau).generate([c], max_new_tokens=N)[0] for c in CHATS]
    eng = Engine(model, gate=gate, tau=tau)
    batched = eng.generate(CHATS, max_new_tokens=N)
    return alone, batched, eng.gate_stats()


def diverging(alone, batched):
    return [i for i, (a, b) in enumerate(zip(alone, batched)) if a.token_ids.tolist() != b.token_ids.tolist()]


def test_without_gate_the_fast_lane_flips(f16_model):
    alone, batched, stats = run(f16_model, "off")
    assert diverging(alone, batched), "gemm_f16 gave identical sequences batched and alone: the gate test would prove nothing"
    assert stats["rechecks"] == 0


def test_gated_restores_identical_sequences_with_few_rechecks(f16_model):
    alone, batched, stats = run(f16_model, "gated", TAU)
    assert diverging(alone, batched) == []
    steps = sum(len(r.token_ids) for r in alone + batched)
    rechecks = sum(int(r.rechecked.sum()) for r in alone + batched)
    assert rechecks <= 0.2 * steps, (rechecks, steps)
    assert stats["steps"] == sum(len(r.token_ids) for r in batched)
    for r in alone + batched:
        # every low-margin step was rechecked, no high-margin one was
        assert (r.rechecked.astype(bool) == (r.margins < TAU)).all()
        assert isinstance(r.rechecked, np.ndarray) and r.corrected.sum() <= r.rechecked.sum()


def test_always_checks_every_step(f16_model):
    eng = Engine(f16_model, gate="always")
    [r] = eng.generate([CHATS[0]], max_new_tokens=8)
    assert r.rechecked.all() and eng.gate_stats()["rechecks"] == len(r.token_ids)


def test_gate_argument_errors(f16_model, tmp_path):
    with pytest.raises(ValueError, match="tau"):
        Engine(f16_model, gate="gated", tau=-0.5)
    with pytest.raises(ValueError, match="tau"):
        Engine(f16_model, gate="gated", tau=float("nan"))
    with pytest.raises(ValueError, match="needs tau"):
        Engine(f16_model, gate="gated")
    with pytest.raises(ValueError, match="unknown gate"):
        Engine(f16_model, gate="maybe")
    prof = tmp_path / "p.json"
    prof.write_text('{"backend": "cpu", "created": "x", "dtypes": {}}')
    with pytest.raises(candle_gate.CandleGateError, match="no gate tau"):
        Engine(f16_model, gate="gated", profile=str(prof))
    prof.write_text('{"backend": "cpu", "created": "x", "dtypes": {}, "gate": {"tau": 0.25}}')
    assert "tau=0.25" in Engine(f16_model, gate="gated", profile=str(prof))._native.gate
