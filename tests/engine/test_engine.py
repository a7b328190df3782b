"""The continuous-batching engine: scheduling, streaming, cancellation, KV budget, threads, and
bad input that must not harm requests in flight."""
import threading

import pytest

from candle_gate import Engine, EngineShutDown

pytestmark = pytest.mark.model  # loads a model, or serves one

PROMPTS = ["The capital of France is", "Once upon a time, in a small village,", "def fibonacci(n):",
           "The three primary colors are"]


def alone(model, prompt, n=10, **kw):
    eng = Engine(model, **kw)
    return eng.generate([prompt], max_new_tokens=n)[0]


def test_generate_keeps_input_order_and_matches_alone(model):
    together = Engine(model).generate(PROMPTS, max_new_tokens=10)
    for p, r in zip(PROMPTS, together):
        a = alone(model, p)
        assert r.token_ids.tolist() == a.token_ids.tolist()
        assert r.fingerprint == a.fingerprint


def test_staggered_arrivals_and_chunked_prefill_do_not_change_output(model):
    long_prompt = "In the beginning of the twentieth century the city grew quickly. " * 8
    want = {p: alone(model, p, 12).token_ids.tolist() for p in PROMPTS[:3]}
    eng = Engine(model, prefill_chunk=16, max_tokens_per_step=24, max_num_seqs=3)
    ids = {}
    ids[eng.submit(PROMPTS[0], max_new_tokens=12)] = PROMPTS[0]
    for _ in range(3):
        eng.step()
    filler = eng.submit(long_prompt, max_new_tokens=4)     # prefilled in chunks beside decodes
    ids[eng.submit(PROMPTS[1], max_new_tokens=12)] = PROMPTS[1]
    eng.step()
    ids[eng.submit(PROMPTS[2], max_new_tokens=12)] = PROMPTS[2]  # waits: max_num_seqs=3
    outs = eng.run(list(ids) + [filler])
    for (_, p), r in zip(ids.items(), outs):
        assert r.token_ids.tolist() == want[p], p


def test_stream_events_and_text_deltas(model):
    eng = Engine(model)
    a = eng.submit(PROMPTS[0], max_new_tokens=6)
    b = eng.submit(PROMPTS[1], max_new_tokens=4)
    text = {a: "", b: ""}
    finished = {}
    for ev in eng.stream():
        if ev["type"] == "token":
            text[ev["id"]] += ev["text"]
        else:
            finished[ev["id"]] = ev["reason"]
    assert finished == {a: "length", b: "length"}
    assert text[a] == eng.result(a).text and text[b] == eng.result(b).text


def test_cancel(model):
    eng = Engine(model)
    a = eng.submit(PROMPTS[0], max_new_tokens=50)
    b = eng.submit(PROMPTS[1], max_new_tokens=8)
    eng.step()
    eng.step()
    eng.cancel(a)
    [rb] = eng.run([b])
    ra = eng.result(a)
    assert ra.finish_reason == "cancelled" and len(ra.token_ids) < 50
    assert rb.token_ids.tolist() == alone(model, PROMPTS[1], 8).token_ids.tolist()
    with pytest.raises(ValueError, match="unknown request id"):
        eng.cancel(987654)


def test_bad_requests_are_refused_and_in_flight_requests_are_unchanged(model):
    want = [alone(model, p, 10).token_ids.tolist() for p in PROMPTS[:2]]
    eng = Engine(model, kv_budget_tokens=4096)
    ids = [eng.submit(p, max_new_tokens=10) for p in PROMPTS[:2]]
    eng.step()
    eng.step()
    ctx = model.config["context_length"]
    bad = [
        (lambda: eng.submit("", max_new_tokens=4), ValueError, "empty prompt", "prompt"),
        (lambda: eng.submit([5] * ctx, max_new_tokens=4), ValueError, "context", "prompt"),
        (lambda: eng.submit("hi", max_new_tokens=0), ValueError, "max_new_tokens", "max_new_tokens"),
        (lambda: eng.submit("hi", max_new_tokens=-3), ValueError, "max_new_tokens", "max_new_tokens"),
        (lambda: eng.submit("hi", max_new_tokens=10**12), ValueError, "max_new_tokens", "max_new_tokens"),
        (lambda: eng.submit("hi", max_new_tokens="4"), TypeError, "max_new_tokens", None),
        (lambda: eng.submit(42, max_new_tokens=4), TypeError, "prompt", None),
        (lambda: eng.submit("hi", max_new_tokens=4, stop=[""]), ValueError, "stop", "stop"),
        (lambda: eng.submit("hi", max_new_tokens=4, stop=[3]), TypeError, "stop", None),
        (lambda: eng.submit([{"role": "user"}], max_new_tokens=4), TypeError, "chat", None),
        (lambda: eng.submit("hi", max_new_tokens=5000), ValueError, "KV cache", "max_new_tokens"),  # can never fit 4096
        (lambda: eng.cancel(424242), ValueError, "unknown request id", "request_id"),
    ]
    for call, exc, needle, param in bad:
        with pytest.raises(exc, match=needle) as e:
            call()
        # the parameter is data on the error, so the server maps it without reading the message
        assert getattr(e.value, "param", None) == param, (needle, e.value)
        eng.step()
    outs = eng.run(ids)
    assert [o.token_ids.tolist() for o in outs] == want
    eng.shutdown()
    with pytest.raises(EngineShutDown, match="shut down"):
        eng.submit("hi", max_new_tokens=2)


def test_a_small_kv_pool_queues_and_preempts_without_changing_a_token(model):
    # a request comes in when its prompt's blocks plus one step fit beside what the running
    # ones need for their next token: both prompts fit in one block each, so both start; the
    # pool holds two blocks, so when they grow into a second one the later is preempted and
    # recomputed after the other finishes
    block = Engine(model).kv_block_size
    assert all(len(model.encode_prompt(p)) + 40 in range(block + 1, 2 * block + 1) for p in PROMPTS[:2])
    eng = Engine(model, kv_budget_tokens=2 * block)
    a = eng.submit(PROMPTS[0], max_new_tokens=40)
    b = eng.submit(PROMPTS[1], max_new_tokens=40)
    eng.step()
    assert eng._native.num_running == 2 and eng.kv_stats()["used"] == 2
    while eng._native.num_running == 2:
        eng.step()
    assert eng._native.num_waiting == 1 and eng.kv_stats()["preemptions"] == 1
    outs = eng.run([a, b])
    for p, o in zip(PROMPTS[:2], outs):
        assert o.token_ids.tolist() == alone(model, p, 40).token_ids.tolist()
    st = eng.kv_stats()
    assert st["used"] == 0 and st["used"] + st["cached"] + st["free"] == st["total"] == 2


def test_submit_from_another_thread_while_stepping(model):
    eng = Engine(model)
    first = eng.submit(PROMPTS[0], max_new_tokens=24)
    ids, errors = [], []

    def submitter():
        try:
            for p in PROMPTS[1:]:
                ids.append(eng.submit(p, max_new_tokens=8))
        except Exception as e:  # pragma: no cover - the assertion below reports it
            errors.append(e)

    t = threading.Thread(target=submitter)
    t.start()
    while eng.has_work or t.is_alive():
        eng.step()
    t.join()
    assert not errors
    outs = [eng.result(i) for i in [first] + ids]
    assert all(o is not None for o in outs)
    for p, o in zip(PROMPTS[1:], outs[1:]):
        assert o.token_ids.tolist() == alone(model, p, 8).token_ids.tolist()


def test_engine_argument_errors(model):
    with pytest.raises(ValueError, match="unknown gate"):
        Engine(model, gate="sometimes")
    with pytest.raises(ValueError, match="tau"):
        Engine(model, gate="gated", tau=-1.0)
    with pytest.raises(ValueError, match="tau"):
        Engine(model, gate="gated", tau=float("nan"))
    with pytest.raises(ValueError, match="max_num_seqs"):
        Engine(model, max_num_seqs=0)
    with pytest.raises(ValueError, match="prefill_chunk"):
        Engine(model, prefill_chunk=512, max_tokens_per_step=256)
    with pytest.raises(ValueError, match="unknown mode"):
        Engine(model, mode="warp")


def test_generate_takes_the_same_sampling_keywords_as_submit(model):
    [a] = model.generate(["Once upon a time"], max_new_tokens=6, temperature=0.8, seed=7, logprobs=True)
    [b] = Engine(model).generate(["Once upon a time"], max_new_tokens=6, temperature=0.8, seed=7, logprobs=True)
    assert a.token_ids.tolist() == b.token_ids.tolist() and a.seed == b.seed == 7 and len(a.logprobs) == 6
    # engine keywords and sampling keywords mix; an unknown one names both sets and params=
    [c] = model.generate(["Once upon a time"], max_new_tokens=6, temperature=0.8, seed=7, kv_dtype="f16")
    assert c.token_ids.tolist() == a.token_ids.tolist()
    with pytest.raises(TypeError, match="params="):
        model.generate(["Once upon a time"], temprature=0.8)


def test_system_fingerprint_names_the_stack_not_the_request(model):
    # Rust's alone (model::system_fingerprint): the server reports it as it is
    a, b = Engine(model), Engine(model)
    assert a.system_fingerprint == b.system_fingerprint and a.system_fingerprint.startswith("fp_")
    assert len(a.system_fingerprint) == 3 + 16
    for other in (Engine(model, kv_dtype="f32"), Engine(model, mode="row_split"), Engine(model, gate="always")):
        assert other.system_fingerprint != a.system_fingerprint
