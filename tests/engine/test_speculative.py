"""Speculative decoding changes no bit: with n-gram drafts or a draft model's, verified in the
continuous batch, every request's tokens, per-step logits hashes, logprobs and fingerprints
equal plain decoding's, greedy and seeded, for any number of drafts, beside decoding and
prefilling neighbours, gated, under preemption; and a request's draft and acceptance counts are
its own."""
import json

import numpy as np
import pytest

import candle_gate
from candle_gate import Engine
from candle_gate.engine import speculative_options

from ..paths import BENCH_PROMPTS, DATA

pytestmark = pytest.mark.model  # loads a model, or serves one

QWEN = "qwen2.5-coder-0.5b-instruct-q4_k_m"
QWEN_15 = "qwen2.5-coder-1.5b-instruct-q4_k_m"
SAMPLED = dict(temperature=0.8, top_p=0.95, seed=11)


def _prompts(name, k):
    with open((DATA if name == "heldout_chats.json" else BENCH_PROMPTS) / name) as f:
        return json.load(f)[:k]


@pytest.fixture(scope="module")
def qwen():
    return candle_gate.Model.load(QWEN, quiet=True)


@pytest.fixture(scope="module")
def qwen15():
    return candle_gate.Model.load(QWEN_15, quiet=True)


def _bits(r):
    lp = np.asarray(r.logprobs, np.float32).view(np.uint32).tolist()
    return r.token_ids.tolist(), r.logit_hashes.tolist(), lp, r.fingerprint, r.finish_reason


def _run(model, prompts, spec=None, max_new=40, sampling=None, **engine):
    eng = Engine(model, record_logit_hashes=True, speculative=spec, **engine)
    ids = [eng.submit(p, max_new_tokens=max_new, logprobs=True, **(sampling or {})) for p in prompts]
    return eng, eng.run(ids)


@pytest.mark.parametrize("sampling", [None, SAMPLED], ids=["greedy", "seeded"])
def test_any_number_of_drafts_changes_no_bit(qwen, sampling):
    prompts = _prompts("code_edits.json", 2) + _prompts("heldout_chats.json", 2)
    _, plain = _run(qwen, prompts, sampling=sampling)
    # One draft, a few, and the most the default n-gram window proposes.
    for k in (1, 3, 8):
        eng, spec = _run(qwen, prompts, dict(method="ngram", num_speculative_tokens=k), sampling=sampling)
        for p, s in zip(plain, spec):
            assert _bits(s) == _bits(p), (k, s.text, p.text)
            assert (p.draft_tokens, p.accepted_tokens) == (0, 0)
        # the claim is exercised: drafts were verified and kept on the code edits
        assert all(s.accepted_tokens > 0 for s in spec[:2]), [(s.draft_tokens, s.accepted_tokens) for s in spec]
        stats = eng.spec_stats()
        assert stats["draft_tokens"] == sum(s.draft_tokens for s in spec)
        assert stats["accepted_tokens"] == sum(s.accepted_tokens for s in spec)


@pytest.mark.parametrize("sampling", [None, SAMPLED], ids=["greedy", "seeded"])
def test_a_draft_model_changes_no_bit(qwen, qwen15, sampling):
    # Qwen2.5-Coder 1.5B verifying 0.5B's drafts: rejections and corrections at every k; the
    # draft caches catch up on them, and the tokens are plain decoding's.
    target = qwen15
    prompts = _prompts("code_completion.json", 2) + _prompts("heldout_chats.json", 1)
    _, plain = _run(target, prompts, max_new=24, sampling=sampling)
    for k in (2, 5):
        spec = dict(method="draft", draft_model=qwen, num_speculative_tokens=k, disable_by_batch_size=4)
        eng, res = _run(target, prompts, spec, max_new=24, sampling=sampling)
        for p, s in zip(plain, res):
            assert _bits(s) == _bits(p), (k, s.text, p.text)
        drafted, kept = sum(s.draft_tokens for s in res), sum(s.accepted_tokens for s in res)
        assert 0 < kept < drafted, (k, drafted, kept)
        assert eng.spec_stats() == {"draft_tokens": drafted, "accepted_tokens": kept, "draft_failures": 0}
        assert eng.speculative == f"draft;k={k};max_batch=4;draft_model={QWEN}.gguf"


def _beside(model, method):
    # Speculation's drafts: a prompt lookup, or the model drafting for itself.
    if method == "ngram":
        return dict(method="ngram", num_speculative_tokens=5, disable_by_batch_size=8)
    return dict(method="draft", draft_model=model, num_speculative_tokens=4, disable_by_batch_size=8)


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculating_beside_decoding_prefilling_and_preempted_requests(qwen, method):
    # A code edit speculates while a chat with nothing to look up decodes and long prompts
    # arrive and prefill in chunks; the pool is small enough that someone is preempted. The
    # model drafting for itself keeps every greedy draft and finishes too fast to be preempted:
    # there, the requests sample (and reject drafts) with two drafts a step.
    edits, chats = _prompts("code_edits.json", 2), _prompts("heldout_chats.json", 2)
    sampling = {} if method == "ngram" else SAMPLED
    alone = {i: _run(qwen, [p], max_new=48, sampling=sampling)[1][0] for i, p in enumerate(edits + chats)}
    spec = _beside(qwen, method)
    if method == "draft":
        spec["num_speculative_tokens"] = 2
    # room for every prompt and a block more: growing by 48 tokens each, someone must go
    block = Engine(qwen).kv_block_size
    blocks = sum(-(-len(qwen.encode_prompt(p)) // block) for p in edits + chats) + 1
    eng = Engine(qwen, record_logit_hashes=True, speculative=spec, kv_budget_tokens=blocks * block,
                 prefill_chunk=32)
    submit = lambda p: eng.submit(p, max_new_tokens=48, logprobs=True, **sampling)  # noqa: E731
    ids = {0: submit(edits[0]), 2: submit(chats[0])}
    for _ in range(3):
        eng.step()
    ids[1] = submit(edits[1])
    eng.step()
    ids[3] = submit(chats[1])
    res = dict(zip(ids, eng.run(list(ids.values()))))
    for i, r in res.items():
        assert _bits(r) == _bits(alone[i]), i
    assert res[0].accepted_tokens > 0
    assert eng.kv_stats()["preemptions"] > 0, "the pool was meant to preempt"


def test_acceptance_is_a_function_of_the_request(qwen):
    edit = _prompts("code_edits.json", 3)[2]
    spec = dict(method="ngram", num_speculative_tokens=5, disable_by_batch_size=16)
    _, [alone] = _run(qwen, [edit], spec, max_new=32)
    neighbours = _prompts("heldout_chats.json", 4) + _prompts("code_edits.json", 4)
    _, crowd = _run(qwen, [edit] + neighbours, spec, max_new=32)
    assert (crowd[0].draft_tokens, crowd[0].accepted_tokens) == (alone.draft_tokens, alone.accepted_tokens)
    assert alone.accepted_tokens > 0
    assert _bits(crowd[0]) == _bits(alone)


def test_when_and_how_far_it_speculates_changes_no_bit(qwen):
    # Adaptivity: a tight step budget shortens the runs, a batch-size limit switches
    # speculation off while the batch is large; neither moves a bit, only the counts.
    prompts = _prompts("code_edits.json", 3)
    _, plain = _run(qwen, prompts, max_new=40)
    counts = set()
    for spec, engine in [(dict(method="ngram", num_speculative_tokens=8), dict(max_tokens_per_step=6, prefill_chunk=6)),
                         (dict(method="ngram", num_speculative_tokens=8, disable_by_batch_size=1), {}),
                         (dict(method="ngram", num_speculative_tokens=8, disable_by_batch_size=8), {})]:
        _, res = _run(qwen, prompts, spec, max_new=40, **engine)
        assert [_bits(r) for r in res] == [_bits(p) for p in plain], (spec, engine)
        counts.add(tuple(r.draft_tokens for r in res))
    assert len(counts) == 3, "the three settings were meant to speculate differently"


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_the_gate_ends_a_run_at_a_recheck_and_decides_as_without(model, method):
    # Gated with a tau high enough to recheck often: a rechecked row's repaired K/V is what
    # the next row must read, so the run stops there; tokens and gate counters equal plain's.
    prompts = _prompts("code_edits.json", 2)
    _, plain = _run(model, prompts, gate="gated", tau=1.0, max_new=40)
    _, spec = _run(model, prompts, _beside(model, method), gate="gated", tau=1.0, max_new=40)
    for s, p in zip(spec, plain):
        assert _bits(s) == _bits(p)
        assert s.gate == p.gate and s.rechecked.tolist() == p.rechecked.tolist()
    assert sum(p.gate["rechecks"] for p in plain) > 0 and sum(s.accepted_tokens for s in spec) > 0
    # a gate that rechecks every step leaves nothing to verify: speculation stays off
    eng = Engine(model, gate="always", speculative=dict(method="ngram"))
    [r] = eng.generate(prompts[:1], max_new_tokens=8)
    assert r.draft_tokens == 0


@pytest.mark.parametrize("spec, param", [
    (dict(method="medusa"), "speculative_method"),
    (dict(num_speculative_tokens=3), "speculative"),
    (dict(method="ngram", num_speculative_tokens=0), "num_speculative_tokens"),
    (dict(method="ngram", num_speculative_tokens=99), "num_speculative_tokens"),
    (dict(method="ngram", prompt_lookup_min=3, prompt_lookup_max=2), "prompt_lookup_min"),
    (dict(method="ngram", k=3), "speculative"),
    (dict(method="ngram", num_speculative_tokens=-1), "num_speculative_tokens"),
])
def test_bad_speculative_settings_name_the_setting(model, spec, param):
    with pytest.raises(candle_gate.InvalidParameter) as e:
        Engine(model, speculative=spec)
    assert e.value.param == param


def test_draft_models_are_checked(qwen, model):
    for spec, says in [(dict(method="draft"), "needs a draft model"),
                       (dict(method="draft", draft_model=model), "does not share the vocabulary"),
                       (dict(method="draft", draft_model=3), "must be a loaded model"),
                       (dict(method="ngram", draft_model=qwen), "used only by speculative method")]:
        with pytest.raises(candle_gate.InvalidParameter, match=says) as e:
            Engine(qwen, speculative=spec)
        assert e.value.param == "draft_model"
    # by name, as the CLI and the server give it
    eng = Engine(qwen, speculative=speculative_options("draft", draft_model=QWEN))
    assert eng.speculative == f"draft;k=3;max_batch=1;draft_model={QWEN}.gguf"


def test_model_generate_takes_speculative_too(model):
    [a] = model.generate(_prompts("code_edits.json", 1), max_new_tokens=24)
    [b] = model.generate(_prompts("code_edits.json", 1), max_new_tokens=24, speculative=dict(method="ngram"))
    assert a.token_ids.tolist() == b.token_ids.tolist() and b.draft_tokens > 0


def test_finished_events_carry_the_counts(model):
    eng = Engine(model, speculative=dict(method="ngram"))
    rid = eng.submit(_prompts("code_edits.json", 1)[0], max_new_tokens=24)
    done = [ev for ev in eng.stream() if ev["type"] == "finished"]
    r = eng.result(rid)
    assert [(ev["draft_tokens"], ev["accepted_tokens"]) for ev in done] == [(r.draft_tokens, r.accepted_tokens)]
    assert r.accepted_tokens > 0


def test_the_server_speculates_with_the_same_answers_and_counts_drafts():
    pytest.importorskip("openai")
    from ..live_server import Server
    edit = _prompts("code_edits.json", 1)[0]
    want = Engine(candle_gate.Model.load(quiet=True)).generate([edit], max_new_tokens=32, logprobs=True)[0]
    srv = Server("--speculative-method", "ngram", "--num-speculative-tokens", "4")
    try:
        r = srv.client().chat.completions.create(model=candle_gate.DEFAULT_MODEL, messages=edit, max_tokens=32,
                                                 temperature=0, logprobs=True)
        got = [t.logprob for t in r.choices[0].logprobs.content]
        assert r.choices[0].message.content == want.text
        assert np.array_equal(np.asarray(got, np.float32), want.logprobs)
        drafted = srv.metric("candle_gate:spec_decode_num_draft_tokens_total")
        accepted = srv.metric("candle_gate:spec_decode_num_accepted_tokens_total")
        assert 0 < accepted <= drafted
    finally:
        srv.stop()
