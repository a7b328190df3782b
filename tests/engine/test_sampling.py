"""Seeded sampling: the sampler's distribution and cuts, reproducibility whatever shares the
batch, n choices, logprobs, the gate over sampled steps, and bad parameters.

The sampler is tested on fixed logits through ``_native._testing`` (the engine's own
``sampling::decide``) against an independent numpy statement of the distribution it must draw
from; the rest runs the real model in the real engine."""
import json
import subprocess
import sys

import numpy as np
import pytest
from scipy import stats

import candle_gate
from candle_gate import Engine, SamplingParams
from candle_gate._native import _testing as T

# Significance of every goodness-of-fit test here. With 2 000 000 draws, a 1% relative error on a
# token of probability 0.25 moves its count by 5 000, 8 standard deviations
# (sqrt(2e6 * 0.25 * 0.75) = 612): test_the_fit_test_detects_a_one_percent_error checks that
# such an error is rejected at this level.
ALPHA = 1e-3
DRAWS = 2_000_000

LOGITS = np.array([2.0, 1.7, 1.5, 1.1, 0.9, 0.9, 0.3, -0.2, -0.8, -1.5, -3.0, -6.0], np.float32)


def expected(logits, temperature, top_k=0, top_p=1.0, min_p=0.0):
    """softmax(logits / T) after top-k, then top-p over the survivors, then min-p, renormalized
    (the order vLLM applies them in). Ties go to the lower id."""
    z = logits.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    keep = np.ones(len(p), bool)
    order = sorted(range(len(p)), key=lambda j: (-logits[j], j))
    if 0 < top_k < len(p):
        keep[:] = False
        keep[order[:top_k]] = True
    if top_p < 1.0:
        kept = [j for j in order if keep[j]]
        total = p[kept].sum()
        before = 0.0
        for j in kept:
            if before >= top_p * total:
                keep[j] = False
            before += p[j]
    if min_p > 0:
        keep &= p >= min_p * p.max()
    q = np.where(keep, p, 0.0)
    return q / q.sum()


def fit(counts, q):
    """p-value of the chi-square test of ``counts`` against ``q`` over the tokens q allows."""
    allowed = q > 0
    return stats.chisquare(counts[allowed], q[allowed] * counts.sum()).pvalue


CASES = [
    dict(temperature=1.0),
    dict(temperature=0.6),
    dict(temperature=1.3, top_k=4),
    dict(temperature=1.0, top_p=0.8),
    dict(temperature=0.8, min_p=0.2),
    dict(temperature=1.1, top_k=8, top_p=0.9, min_p=0.05),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_the_sampler_draws_from_the_filtered_softmax(case):
    toks = T.sample_tokens(LOGITS.tolist(), SamplingParams(**case), 1_000_003, DRAWS)
    counts = np.bincount(toks, minlength=len(LOGITS)).astype(np.float64)
    q = expected(LOGITS, **case)
    assert counts[q == 0].sum() == 0, "a token the filters remove was drawn"
    assert fit(counts, q) > ALPHA, (counts / DRAWS, q)


def test_the_fit_test_detects_a_one_percent_error():
    case = dict(temperature=1.0)
    toks = T.sample_tokens(LOGITS.tolist(), SamplingParams(**case), 5, DRAWS)
    counts = np.bincount(toks, minlength=len(LOGITS)).astype(np.float64)
    q = expected(LOGITS, **case)
    wrong = q.copy()
    wrong[0] *= 1.01  # 1% more of the most likely token, taken from the second
    wrong[1] -= wrong[0] - q[0]
    assert fit(counts, q) > ALPHA
    assert fit(counts, wrong) < ALPHA


def ln(p):
    return float(np.log(np.float64(p)))


def test_each_cut_is_exact_on_constructed_cases():
    c = lambda logits, **kw: T.candidates([float(x) for x in logits], SamplingParams(temperature=1.0, **kw))
    # top-k: exactly k, ties at the edge to the lower id
    assert c([1, 3, 2, 3, 2, 0], top_k=3) == [1, 2, 3]
    assert c([1, 3, 2, 3, 2, 0], top_k=1) == [1]
    assert c([1, 3, 2], top_k=0) == [0, 1, 2]
    # top-p over probabilities 0.5, 0.25, 0.125, 0.125: the smallest prefix reaching p
    l = [ln(0.5), ln(0.25), ln(0.125), ln(0.125)]
    assert c(l, top_p=0.4999) == [0]
    assert c(l, top_p=0.5001) == [0, 1]
    assert c(l, top_p=0.7501) == [0, 1, 2]
    assert c(l, top_p=1.0) == [0, 1, 2, 3]
    # min-p against the most likely (0.4): 0.2 / 0.4 = 0.5
    l = [ln(0.4), ln(0.2), ln(0.1), ln(0.3)]
    assert c(l, min_p=0.4999) == [0, 1, 3]
    assert c(l, min_p=0.5001) == [0, 3]
    # top-p works on what top-k left, renormalized: top-2 of the above is {0.4, 0.3} -> 4/7, 3/7
    assert c(l, top_k=2, top_p=0.5) == [0]
    assert c(l, top_k=2, top_p=0.58) == [0, 3]


def test_a_draw_depends_on_seed_choice_and_position_only():
    lg = LOGITS.tolist()
    p = SamplingParams(temperature=1.0)
    ref = T.decide(lg, p, 99, 1, 7)
    assert all(T.decide(lg, p, 99, 1, 7) == ref for _ in range(5))
    over = lambda f: {T.decide(lg, p, *f(k))[0] for k in range(200)}
    # each of the three coordinates moves the draw
    assert len(over(lambda k: (k, 1, 7))) > 5
    assert len(over(lambda k: (99, k, 7))) > 5
    assert len(over(lambda k: (99, 1, k))) > 5


def test_penalties_follow_openai_and_ctrl():
    # token 0 wins; after it appeared twice a frequency penalty of 1 gives token 1 the lead
    lg = [3.0, 1.5, 0.0]
    greedy = lambda **kw: T.decide(lg, SamplingParams(**kw), 0, 0, 0, [], [0, 0])[0]
    assert greedy() == 0
    assert greedy(frequency_penalty=0.7) == 0  # 3 - 1.4 = 1.6 > 1.5
    assert greedy(frequency_penalty=0.8) == 1  # 3 - 1.6 = 1.4 < 1.5
    assert greedy(presence_penalty=1.6) == 1  # once, whatever the count
    assert greedy(presence_penalty=1.4) == 0
    assert greedy(repetition_penalty=2.01) == 1  # 3 / 2.01 < 1.5
    assert greedy(repetition_penalty=1.99) == 0


# ----------------------------------------------------------------------------- the engine

PROMPTS = ["Once upon a time, in a small village by the sea,", "The three primary colors are",
           [{"role": "user", "content": "Write a short poem about a cat."}],
           "Here is a haiku about autumn:\n", "The best way to learn a new language is",
           [{"role": "user", "content": "Give me three ideas for a birthday party."}]]


@pytest.mark.model
def test_temperature_zero_is_todays_greedy_bit_for_bit(model):
    greedy = Engine(model, record_logit_hashes=True).generate(PROMPTS, max_new_tokens=24)
    eng = Engine(model, record_logit_hashes=True)
    params = SamplingParams(max_new_tokens=24, temperature=0.0, top_k=3, top_p=0.5, seed=5, logprobs=True)
    zero = eng.run([eng.submit(p, params=params) for p in PROMPTS])
    for g, z in zip(greedy, zero):
        assert g.token_ids.tolist() == z.token_ids.tolist()
        assert g.logit_hashes.tolist() == z.logit_hashes.tolist()
        assert g.margins.view(np.uint32).tolist() == z.margins.view(np.uint32).tolist()


@pytest.mark.model
def test_same_seed_same_tokens_in_every_composition_invariant(model):
    rep = candle_gate.run_probe(model, prompts=PROMPTS, max_new_tokens=16, mode="invariant",
                                sampling=dict(temperature=0.8, top_p=0.95, seed=11), progress=False)
    assert rep["sampling"] == {"temperature": 0.8, "top_p": 0.95, "seed": 11}
    assert rep["identical_sequences_share"] == 1.0, rep["distinct_outputs"]
    for c in rep["compositions"]:
        assert c["step_flip_rate"] == 0 and c["diverging_sequences"] == 0, c
        assert c["logit_bit_mismatches"] == 0, c


@pytest.mark.model
def test_different_seeds_give_different_texts(model):
    texts = {}
    for seed in (1, 2, 3):
        params = SamplingParams(max_new_tokens=24, temperature=1.0, seed=seed)
        texts[seed] = [r.text for r in Engine(model).generate(PROMPTS[:3], params=params)]
    for i in range(3):
        assert len({texts[s][i] for s in texts}) == 3, [texts[s][i] for s in texts]


@pytest.mark.model
def test_a_request_without_a_seed_reports_the_one_it_drew(model):
    eng = Engine(model)
    r = eng.run([eng.submit(PROMPTS[0], max_new_tokens=16, temperature=1.0)])[0]
    replay = Engine(model).generate([PROMPTS[0]], params=SamplingParams(max_new_tokens=16, temperature=1.0, seed=r.seed))[0]
    assert replay.token_ids.tolist() == r.token_ids.tolist()
    other = Engine(model)
    assert other.run([other.submit(PROMPTS[0], max_new_tokens=16, temperature=1.0)])[0].seed != r.seed


@pytest.mark.model
def test_n_choices_share_one_prefill_and_match_their_own_runs(model):
    kw = dict(max_new_tokens=20, temperature=0.9, top_p=0.95, seed=42)
    eng = Engine(model, max_num_seqs=8)
    rid = eng.submit(PROMPTS[0], params=SamplingParams(n=4, **kw))
    other = eng.submit(PROMPTS[1], params=SamplingParams(**kw))  # a neighbour, to share the batch
    r = eng.run([rid, other])[0]
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert all(c.seed == 42 and c.id == rid for c in r.choices)
    assert len({c.text for c in r.choices}) >= 3
    # choice 0 is the request with n=1; every choice is the same choice of a bigger n, alone
    one = Engine(model).generate([PROMPTS[0]], params=SamplingParams(**kw))[0]
    assert one.token_ids.tolist() == r.token_ids.tolist()
    six = Engine(model, max_num_seqs=8).generate([PROMPTS[0]], params=SamplingParams(n=6, **kw))[0]
    for a, b in zip(r.choices, six.choices):
        assert a.token_ids.tolist() == b.token_ids.tolist()


@pytest.mark.model
def test_n_choices_stream_and_cancel_together(model):
    eng = Engine(model, max_num_seqs=4)
    rid = eng.submit(PROMPTS[0], max_new_tokens=64, temperature=1.0, seed=3, n=3)
    for _ in range(4):
        eng.step()
    evs = eng._native.events()
    assert {e["index"] for e in evs if e["type"] == "token"} == {0, 1, 2}
    assert eng._native.num_running == 3
    eng.cancel(rid)
    assert eng._native.num_running == 0 and not eng.has_work
    r = eng.result(rid)
    assert [c.finish_reason for c in r.choices] == ["cancelled"] * 3
    # the freed room admits a full-size request at once
    rid2 = eng.submit(PROMPTS[1], max_new_tokens=4, n=4)
    assert len(eng.run([rid2])[0].choices) == 4


@pytest.mark.model
def test_logprobs_are_the_deciding_logits_log_softmax(model):
    eng = Engine(model)
    rid = eng.submit(PROMPTS[1], max_new_tokens=6, temperature=0.7, seed=8, logprobs=True, top_logprobs=5)
    evs = [e for e in eng.stream() if e["type"] == "token"]
    r = eng.result(rid)
    assert r.logprobs.dtype == np.float32 and r.logprobs.shape == (6,)
    assert r.top_logprob_ids.shape == (6, 5) and r.top_logprobs.shape == (6, 5)
    assert [e["logprob"] for e in evs] == r.logprobs.tolist()
    assert [e["top_logprob_ids"].tolist() for e in evs] == r.top_logprob_ids.tolist()
    ids = model.encode_prompt(PROMPTS[1])
    for step in range(6):
        lg = model._native.logits(ids + r.token_ids[:step].tolist()).astype(np.float64)
        ref = lg - lg.max() - np.log(np.exp(lg - lg.max()).sum())
        np.testing.assert_allclose(r.logprobs[step], ref[r.token_ids[step]], atol=1e-5)
        top = sorted(range(len(lg)), key=lambda j: (-lg[j], j))[:5]
        assert r.top_logprob_ids[step].tolist() == top
        np.testing.assert_allclose(r.top_logprobs[step], ref[top], atol=1e-5)
    plain = Engine(model).generate([PROMPTS[1]], max_new_tokens=6)[0]
    assert plain.logprobs.size == 0 and plain.top_logprobs.size == 0


@pytest.mark.model
@pytest.mark.parametrize("kw,match", [
    (dict(temperature=-0.5), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=float("inf")), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.01), "top_p"),
    (dict(top_k=-1), "top_k"), (dict(min_p=2.0), "min_p"), (dict(n=0), "n must"), (dict(n=-3), "n must"),
    (dict(n=10 ** 9), "n must"), (dict(top_logprobs=21), "top_logprobs"), (dict(seed=-1), "seed"),
    (dict(seed=2 ** 64), "seed"), (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=float("nan")), "frequency_penalty"), (dict(repetition_penalty=0), "repetition_penalty"),
])
def test_bad_sampling_parameters_are_clear_errors(model, kw, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kw)
    eng = Engine(model)
    with pytest.raises(ValueError, match=match):
        eng.submit("hi", max_new_tokens=4, **kw)
    assert not eng.has_work


@pytest.mark.model
def test_bad_requests_harm_nothing_in_flight(model):
    eng = Engine(model, max_num_seqs=4, kv_budget_tokens=512)
    good = eng.submit(PROMPTS[0], max_new_tokens=8, temperature=0.8, seed=1)
    eng.step()
    with pytest.raises(ValueError, match="max_num_seqs"):
        eng.submit("hi", max_new_tokens=4, n=5)
    with pytest.raises(ValueError, match="KV cache"):
        eng.submit("hi", max_new_tokens=200, n=4)
    with pytest.raises(TypeError):
        eng.submit("hi", max_new_tokens=4, temprature=0.5)
    with pytest.raises(TypeError, match="params"):
        eng.submit("hi", params=SamplingParams(), temperature=0.5)
    r = eng.run([good])[0]
    alone = Engine(model).generate([PROMPTS[0]], params=SamplingParams(max_new_tokens=8, temperature=0.8, seed=1))[0]
    assert r.token_ids.tolist() == alone.token_ids.tolist()


@pytest.mark.model
def test_cli_generate_samples_with_a_seed():
    def run(*extra):
        out = subprocess.run([sys.executable, "-m", "candle_gate", "generate", "Once upon a time",
                              "--max-new-tokens", "12", "--temperature", "0.9", "--json", *extra],
                             capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)
    a, b = run("--seed", "5"), run("--seed", "5")
    assert a["text"] == b["text"] and a["seed"] == 5
    two = run("--seed", "5", "--n", "2")
    assert [c["index"] for c in two] == [0, 1] and two[0]["text"] == a["text"]
    bad = subprocess.run([sys.executable, "-m", "candle_gate", "generate", "x", "--top-p", "0"],
                         capture_output=True, text=True, timeout=600)
    assert bad.returncode == 2 and "top_p" in bad.stderr


# ----------------------------------------------------------------------------- the gate

@pytest.fixture(scope="module")
def f16_model():
    return candle_gate.Model.load(layout=candle_gate.layout_for("split_k_f16"))


@pytest.mark.model
def test_the_gate_holds_sampled_decoding_over_a_lane_that_is_not_invariant(f16_model):
    """Seeded sampling (T 0.8, top-p 0.95) over split_k_f16: without the gate a chat leaves its
    batch-1 path; with the greedy-calibrated tau every chat keeps it (docs/DESIGN.md: the
    sampled margin is in logit units, like the greedy one, so the same tau bounds it)."""
    from .test_gate import CHATS, F16, PROFILE, TAU
    params = [SamplingParams(max_new_tokens=64, temperature=0.8, top_p=0.95, seed=1000 + i) for i in range(len(CHATS))]

    def run(gate):
        kw = {"profile": PROFILE} if gate == "gated" else {}
        alone = [Engine(f16_model, mode=F16, gate=gate, **kw).generate([c], params=p)[0] for c, p in zip(CHATS, params)]
        eng = Engine(f16_model, mode=F16, gate=gate, **kw)
        batched = eng.run([eng.submit(c, params=p) for c, p in zip(CHATS, params)])
        return alone, batched, eng.gate_stats()

    def diverging(alone, batched):
        return [i for i, (a, b) in enumerate(zip(alone, batched)) if a.token_ids.tolist() != b.token_ids.tolist()]

    alone, batched, stats = run("off")
    assert diverging(alone, batched), "sampling over split_k_f16 did not diverge: the gated half would prove nothing"
    alone, batched, stats = run("gated")
    assert diverging(alone, batched) == []
    assert 0 < stats["rechecks"] <= 0.2 * stats["steps"], stats
    for r in alone + batched:
        assert (r.rechecked.astype(bool) == (r.margins < TAU)).all()
