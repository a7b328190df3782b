"""The margin gate over a fast lane that is not batch invariant (split_k_f16: f16 operands, F32
accumulation split over k by the row count, f16 results; the CPU stand-in for a half-precision
GPU lane, whose bits follow the row count by construction and are the same on every host).
tau and deep_tau are
the packaged profile's (``candle_gate.PACKAGED_PROFILE``), calibrated by ``candle-gate calibrate
--gate`` on candle_gate.calibrate.CALIBRATION_PROMPTS; the chats here are not in that set."""
import json

import numpy as np
import pytest

import candle_gate
import candle_gate.calibrate
from candle_gate import Engine

pytestmark = pytest.mark.model  # loads a model, or serves one

# The profile shipped in the package: its SmolLM2 split_k_f16 calibration.
PROFILE = candle_gate.PACKAGED_PROFILE
#: the lane the gate is calibrated and tested on: its bits follow the batch
F16 = "split_k_f16"

# Eight chats decoded as one batch; without the gate two of them leave their batch-1 path (the
# same two on every host: the lane's bits are a function of the values and the row count).
TOPICS = ["the ocean", "a lost key", "quantum computers", "the Roman empire", "baking bread",
          "a robot learning to paint", "climate change", "the first day of school"]
CHATS = [[{"role": "user", "content": f"Explain {t} to a child."}] for t in TOPICS]
N = 64
with open(PROFILE) as f:
    [CALIBRATED] = [g for g in json.load(f)["gates"] if g["mode"] == "split_k_f16" and g["model"].startswith("SmolLM2")]
TAU = CALIBRATED["tau"]


@pytest.fixture(scope="module")
def f16_model():
    return candle_gate.Model.load(layout=candle_gate.layout_for(F16))


def run(model, gate):
    kw = {"profile": PROFILE} if gate == "gated" else {}
    alone = [Engine(model, mode=F16, gate=gate, **kw).generate([c], max_new_tokens=N)[0] for c in CHATS]
    eng = Engine(model, mode=F16, gate=gate, **kw)
    batched = eng.generate(CHATS, max_new_tokens=N)
    return alone, batched, eng.gate_stats()


def diverging(alone, batched):
    return [i for i, (a, b) in enumerate(zip(alone, batched)) if a.token_ids.tolist() != b.token_ids.tolist()]


def test_without_gate_the_fast_lane_flips(f16_model):
    alone, batched, stats = run(f16_model, "off")
    assert diverging(alone, batched), "split_k_f16 gave identical sequences batched and alone: the gate test would prove nothing"
    assert stats["rechecks"] == 0


def test_gated_restores_identical_sequences_with_few_rechecks(f16_model):
    alone, batched, stats = run(f16_model, "gated")
    assert diverging(alone, batched) == []
    steps = sum(len(r.token_ids) for r in alone + batched)
    rechecks = sum(int(r.rechecked.sum()) for r in alone + batched)
    assert rechecks <= 0.2 * steps, (rechecks, steps)
    assert stats["steps"] == sum(len(r.token_ids) for r in batched)
    for r in alone + batched:
        # every low-margin step was rechecked, no high-margin one was
        assert (r.rechecked.astype(bool) == (r.margins < TAU)).all()
        assert isinstance(r.rechecked, np.ndarray) and r.corrected.sum() <= r.rechecked.sum()


def test_engine_reads_tau_and_deep_tau_from_the_profile(f16_model):
    e = Engine(f16_model, mode=F16, gate="gated", profile=PROFILE)
    assert e.tau == pytest.approx(CALIBRATED["tau"]) and e.deep_tau == pytest.approx(CALIBRATED["deep_tau"])
    e = Engine(f16_model, mode=F16, gate="gated", profile=PROFILE, tau=0.5)
    assert e.tau == 0.5 and e.deep_tau == pytest.approx(0.25)


def test_shadow_records_the_recheck_and_changes_nothing(f16_model):
    chat = CHATS[1]
    off = Engine(f16_model, mode=F16, gate="off", record_logit_hashes=True).generate([chat], max_new_tokens=12)[0]
    shadow = Engine(f16_model, mode=F16, gate="shadow", record_logit_hashes=True).generate([chat], max_new_tokens=12)[0]
    always = Engine(f16_model, mode=F16, gate="always", deep_tau=0.0).generate([chat], max_new_tokens=12)[0]
    assert shadow.token_ids.tolist() == off.token_ids.tolist()
    assert shadow.logit_hashes.tolist() == off.logit_hashes.tolist()  # the fast lane's K/V were put back
    assert not shadow.rechecked.any() and np.isfinite(shadow.reference_margins).all()
    assert np.isnan(off.reference_margins).all() and len(off.reference_margins) == len(off.token_ids)
    # The first step's recheck sees the same cache (the prompt's prefill) in both runs.
    assert shadow.reference_margins[0] == always.reference_margins[0]
    assert shadow.corrected[0] == always.corrected[0]


def test_deep_rechecks_are_the_reference_lane_bit_for_bit(f16_model):
    """With deep_tau above every margin, each step rebuilds the cache in the reference lane
    (incrementally, from where the last rebuild stopped): the tokens and margins must be those of
    greedy decoding in the reference lane alone, recomputed here from scratch for every prefix."""
    prompt = "The three primary colors are"
    n = 6
    r = Engine(f16_model, mode=F16, gate="always", deep_tau=1e9).generate([prompt], max_new_tokens=n)[0]
    assert r.gate["deep_rechecks"] == n
    ids = f16_model.tokenize(prompt)
    for i in range(n):
        ref = f16_model._native.logits(ids, "reference")
        top2 = np.sort(ref)[-2:]
        assert int(np.argmax(ref)) == int(r.token_ids[i])
        assert np.float32(top2[1] - top2[0]) == r.reference_margins[i]
        ids = ids + [int(r.token_ids[i])]


def test_gated_without_tau_uses_the_users_calibration_then_the_packaged_one(f16_model, tmp_path, monkeypatch):
    monkeypatch.setenv("CANDLE_GATE_CACHE", str(tmp_path))  # an empty user cache (the model is loaded)
    e = Engine(f16_model, mode=F16, gate="gated")
    assert e.gate_source == f"{PROFILE} ({CALIBRATED['model']}/split_k_f16)"
    assert (e.tau, e.deep_tau) == (pytest.approx(TAU), pytest.approx(CALIBRATED["deep_tau"]))
    # a lane nobody calibrated is refused, naming what the profiles have
    with pytest.raises(candle_gate.CandleGateError, match=r"in mode gemm: .*cpu\.json has .*SmolLM2.*/split_k_f16"):
        Engine(f16_model, mode="gemm", gate="gated")
    # what `candle-gate calibrate` writes to the user cache wins over the package's
    user = candle_gate.engine.user_profile_path()
    assert user == str(tmp_path / "profile-cpu.json")
    candle_gate.calibrate.merge_gate(user, {**CALIBRATED, "tau": 0.125, "deep_tau": 0.0625})
    e = Engine(f16_model, mode=F16, gate="gated")
    assert (e.tau, e.deep_tau, e.gate_source) == (0.125, 0.0625, f"{user} ({CALIBRATED['model']}/split_k_f16)")
    assert Engine(f16_model, mode=F16, gate="gated", tau=0.5).gate_source is None
    # ... but only for the lanes it has: another one still comes from the package
    candle_gate.calibrate.merge_gate(user, {**CALIBRATED, "mode": "gemm", "tau": 0.25})
    assert Engine(f16_model, mode="gemm", gate="gated").tau == 0.25


def test_always_checks_every_step(f16_model):
    eng = Engine(f16_model, mode=F16, gate="always")
    [r] = eng.generate([CHATS[0]], max_new_tokens=8)
    assert r.rechecked.all() and eng.gate_stats()["rechecks"] == len(r.token_ids)


def test_gate_argument_errors(f16_model, tmp_path):
    with pytest.raises(ValueError, match="tau"):
        Engine(f16_model, mode=F16, gate="gated", tau=-0.5)
    with pytest.raises(ValueError, match="tau"):
        Engine(f16_model, mode=F16, gate="gated", tau=float("nan"))
    with pytest.raises(ValueError, match="unknown gate"):
        Engine(f16_model, mode=F16, gate="maybe")
    prof = tmp_path / "p.json"
    prof.write_text('{"backend": "cpu", "created": "x", "dtypes": {}}')
    with pytest.raises(candle_gate.CandleGateError, match=r"no gate calibration for this model .*p\.json has none"):
        Engine(f16_model, mode=F16, gate="gated", profile=str(prof))
    prof.write_text('{"backend": "cpu", "created": "x", "dtypes": {}, "gate": {"tau": 0.25}}')
    assert "tau=0.25" in Engine(f16_model, mode=F16, gate="gated", profile=str(prof))._native.gate
