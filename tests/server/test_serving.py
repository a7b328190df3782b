"""The server's request-to-response shaping, in process and without a model: the real app
(``create_app``) with a fake tokenizer and a fake engine thread attached in place of the model,
spoken to with Starlette's TestClient. The fake worker implements what the serving code calls
(``submit`` delivering lists of events and then ``("done", Result)`` into the request's queue,
``cancel``, ``counts``); the Results are :class:`candle_gate.Result` objects built here. The
exception mapping is checked against exceptions carrying ``param`` as the native
``InvalidParameter`` does, and against the native class itself. Runs in a couple of seconds."""
import json
import math

import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")
pytest.importorskip("prometheus_client")

from fastapi.testclient import TestClient  # noqa: E402

from candle_gate import _native  # noqa: E402
from candle_gate.engine import Result, SamplingParams  # noqa: E402
from candle_gate.server import MAX_BODY_BYTES, Metrics, Settings, create_app, engine_error  # noqa: E402
from candle_gate.server.metrics import EngineCounts  # noqa: E402
from candle_gate.server.worker import QueueFull  # noqa: E402

CTX = 64
CHAT = [{"role": "user", "content": "hi"}]
REPLY = "abcdefgh"


class FakeModel:
    """A tokenizer over code points (token id i is ``chr(i)``), with a context of CTX."""
    path = "/models/fake-model.gguf"
    config = {"context_length": CTX, "vocab": 0x110000}

    def tokenize(self, text):
        return [ord(c) for c in text]

    def detokenize(self, ids):
        return "".join(chr(i) for i in ids)

    def encode_prompt(self, prompt):
        ids = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("empty prompt")
        return ids

    def encode_chat(self, messages, tools=None):
        return self.tokenize("".join(f"<{m['role']}>{m.get('content') or ''}" for m in messages))


class Invalid(ValueError):
    """What the native ``InvalidParameter`` is: a ValueError naming the parameter (Rust's name)."""

    def __init__(self, msg, param):
        super().__init__(msg)
        self.param = param


class FakeWorker:
    """The engine thread's interface. Choice i's step s is the token ``REPLY[(s + i) % 8]`` with
    logprob ``-(s + 1) / 4`` (alternatives: itself, then "z"); each step is delivered as one list,
    the last one with the finished events and the Result. ``hold_back`` tokens at the end come
    with empty texts (as a possible stop string's start), which only the Result's text has;
    ``fail`` is raised by submit, ``engine_failure`` is delivered instead of any event. Like the
    real one it hands each finished Result to ``on_done`` (the metrics' finish reasons)."""

    def __init__(self, loop, on_done):
        self.loop, self.on_done = loop, on_done
        self.submitted = []
        self.cancelled = []
        self.fail = None
        self.engine_failure = None
        self.hold_back = 0
        #: seconds after submit at which each step's list arrives (default: all at once)
        self.delays = None
        self.next_id = 1

    def submit(self, ids, params, queue, max_queue):
        if self.fail is not None:
            raise self.fail
        rid, self.next_id = self.next_id, self.next_id + 1
        self.submitted.append((ids, params))
        for s, items in enumerate(self.deliveries(rid, ids, params)):
            if self.delays is None:
                self.loop.call_soon_threadsafe(self.deliver, queue, items)
            else:
                self.loop.call_soon_threadsafe(self.loop.call_later, self.delays[s], self.deliver, queue, items)
        return rid

    def deliver(self, queue, items):
        queue.put_nowait(items)
        if isinstance(items[-1], tuple) and items[-1][0] == "done":
            self.on_done(items[-1][1])

    def deliveries(self, rid, ids, params):
        if self.engine_failure is not None:
            return [[("error", self.engine_failure)]]
        k, n = params.max_new_tokens, params.n
        out = []
        for s in range(k):
            step = []
            for i in range(n):
                tid, lp = ord(REPLY[(s + i) % len(REPLY)]), -(s + 1) / 4
                ev = {"type": "token", "id": rid, "index": i, "token": tid,
                      "text": "" if s >= k - self.hold_back else chr(tid)}
                if params.logprobs:
                    ev.update(logprob=lp, top_logprob_ids=np.array([tid, ord("z")][:params.top_logprobs], np.uint32),
                              top_logprobs=np.array([lp, lp - 1][:params.top_logprobs], np.float32))
                step.append(ev)
            out.append(step)
        out[-1] += [{"type": "finished", "id": rid, "index": i, "reason": "length"} for i in range(n)]
        out[-1].append(("done", self.result(rid, ids, params)))
        return out

    def result(self, rid, ids, params):
        k, top = params.max_new_tokens, params.top_logprobs
        choices = []
        for i in range(params.n):
            tids = [ord(REPLY[(s + i) % len(REPLY)]) for s in range(k)]
            lps = [-(s + 1) / 4 for s in range(k)]
            choices.append(Result(
                text="".join(map(chr, tids)), token_ids=np.array(tids, np.uint32),
                margins=np.array([math.nan] + [0.5] * (k - 1), np.float32), fingerprint=f"{i:032x}",
                finish_reason="length", rechecked=np.array([1] + [0] * (k - 1), np.uint8),
                corrected=np.zeros(k, np.uint8), gate={}, prompt_tokens=len(ids), id=rid, index=i,
                seed=params.seed if params.seed is not None else 7, cached_tokens=2,
                logprobs=np.array(lps if params.logprobs else [], np.float32),
                top_logprob_ids=np.array([[t, ord("z")][:top] for t in tids] if top else np.zeros((k, 0)), np.uint32),
                top_logprobs=np.array([[lp, lp - 1][:top] for lp in lps] if top else np.zeros((k, 0)), np.float32)))
        for c in choices:
            c.choices = choices
        return choices[0]

    def cancel(self, rid):
        self.cancelled.append(rid)

    def counts(self):
        return EngineCounts(running=0, waiting=0)

    def reset_prefix_cache(self):
        pass

    def shutdown(self):
        pass


def _app(kv_pool=None, **settings):
    workers = []

    def load(st, loop):
        workers.append(FakeWorker(loop, st.count_finished))
        st.attach(FakeModel(), workers[0], "fp_fake", kv_pool=kv_pool)

    app = create_app(Settings(served_model_name="fake", **settings), load=load)
    return app, workers


@pytest.fixture
def api():
    """(client, fake worker, server state) of an app that has attached the fakes."""
    app, workers = _app()
    with TestClient(app, raise_server_exceptions=False) as client:
        st = app.state.server
        assert st.loaded.wait(10) and st.ready
        yield client, workers[0], st


def _error(r, status, param=None, code=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert (err["param"], err["code"]) == (param, code), err
    return err


def _events(r):
    """The SSE events' data: JSON chunks, and the last one "[DONE]"."""
    assert r.headers["content-type"].startswith("text/event-stream")
    blocks = r.text.split("\n\n")
    assert blocks[-1] == "" and all(b.startswith("data: ") for b in blocks[:-1]), r.text
    data = [b[len("data: "):] for b in blocks[:-1]]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


# --- the engine's exceptions ------------------------------------------------------------------

def test_engine_errors_map_by_class_and_param_never_by_message():
    e = engine_error(Invalid("max_new_tokens must be between 1 and 1048576, got 0", "max_new_tokens"))
    assert (e.status, e.param, e.code) == (400, "max_tokens", None)
    assert e.message == "max_new_tokens must be between 1 and 1048576, got 0"  # passed on as it is
    assert engine_error(Invalid("too long", "prompt"), "chat").param == "messages"
    assert engine_error(Invalid("too long", "prompt"), "completion").param == "prompt"
    assert engine_error(Invalid("x", "top_logprobs"), "completion").param == "logprobs"
    assert engine_error(Invalid("x", "top_logprobs"), "chat").param == "top_logprobs"
    assert engine_error(Invalid("x", "temperature"), "chat").param == "temperature"
    # A message that starts with a parameter's name names nothing: only `param` does.
    assert engine_error(ValueError("temperature must be finite")).param is None
    assert engine_error(ValueError("bad"), fallback="messages").param == "messages"
    assert engine_error(Invalid("bad", "prompt"), "chat", fallback="tools").param == "messages"
    assert engine_error(OverflowError("Python int too large to convert to C long")).param is None
    e = engine_error(_native.CandleGateError("the engine is shut down"))
    assert (e.status, e.param, e.code) == (400, None, None)  # the class, not the words, decides
    assert engine_error(RuntimeError("?")).status == 500


def test_a_shut_down_engine_is_503_shutting_down():
    e = engine_error(_native.EngineShutDown("gone"))
    assert (e.status, e.code, e.message) == (503, "shutting_down", "gone")


@pytest.mark.parametrize("kw,field", [({"max_new_tokens": 0}, "max_tokens"), ({"top_p": 0.0}, "top_p"),
                                      ({"temperature": -1.0}, "temperature"), ({"n": 0}, "n")])
def test_the_native_invalid_parameter_names_the_request_field(kw, field):
    with pytest.raises(_native.InvalidParameter) as exc:
        SamplingParams(**kw)
    assert engine_error(exc.value, "chat").param == field


# --- refusals through the app -----------------------------------------------------------------

@pytest.mark.parametrize("body,param,start", [
    (b'{"prompt": "x"', None, "the request body is not valid JSON"),
    (b"  ", None, "the request body is empty"),
    ({"prompt": "x", "max_tokens": "8"}, "max_tokens", "max_tokens: Input should be a valid integer"),
    ({"prompt": "x", "temperature": -1}, "temperature", "temperature: Input should be greater than or equal to 0"),
    ({"max_tokens": 2}, "prompt", "prompt: Field required"),
    ({"prompt": "x", "seed": 2 ** 64}, "seed", "seed: Input should be less than or equal to"),
    ([1, 2], None, "Input should be an object"),
])
def test_validation_messages_name_the_field(api, body, param, start):
    client, worker, _ = api
    content = body if isinstance(body, bytes) else json.dumps(body)
    err = _error(client.post("/v1/completions", content=content), 400, param)
    assert err["message"].startswith(start) and err["type"] == "invalid_request_error"
    assert worker.submitted == []


def test_a_union_error_lists_each_alternative(api):
    err = _error(api[0].post("/v1/completions", json={"prompt": 5}), 400, "prompt")
    # (the two list alternatives, token ids and one string, give the same reason: said once)
    assert err["message"] == "prompt: Input should be a valid string; or prompt: Input should be a valid array"


@pytest.mark.parametrize("path,body,param,message", [
    # one clear reason, not every alternative of the prompt's union
    ("/v1/completions", b'{"prompt": ""}', "prompt", "prompt: must not be empty"),
    ("/v1/completions", b'{"prompt": []}', "prompt", "prompt: must not be empty"),
    ("/v1/completions", b'{"prompt": [""]}', "prompt", "prompt.0: must not be empty"),
    # non-finite numbers are named as sent, not compared with a bound
    ("/v1/completions", b'{"prompt": "x", "top_p": NaN}', "top_p", "top_p: must be a finite number, got NaN"),
    ("/v1/completions", b'{"prompt": "x", "min_p": NaN}', "min_p", "min_p: must be a finite number, got NaN"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "presence_penalty": -Infinity}',
     "presence_penalty", "presence_penalty: must be a finite number, got -Infinity"),
    ("/v1/completions", b'{"prompt": "x", "repetition_penalty": NaN}', "repetition_penalty",
     "repetition_penalty: must be a finite number, got NaN"),
    # a finite number the engine's f32 cannot hold is not "inf"
    ("/v1/completions", b'{"prompt": "x", "temperature": 1e308}', "temperature",
     "temperature is 1e308, beyond the engine's 32-bit floats (at most 3.4028235e38 in magnitude)"),
])
def test_misleading_messages_are_clear(api, path, body, param, message):
    client, worker, _ = api
    err = _error(client.post(path, content=body), 400, param)
    assert err["message"] == message
    assert worker.submitted == []


@pytest.mark.parametrize("path,body,param,where", [
    ("/v1/completions", b'{"prompt": "a\\ud800"}', "prompt", "prompt"),
    ("/v1/completions", b'{"prompt": "\\udc00b"}', "prompt", "prompt"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud83d"}]}', "messages",
     "messages.0.content"),
])
def test_a_lone_surrogate_is_named_as_such(api, path, body, param, where):
    err = _error(api[0].post(path, content=body), 400, param)
    assert err["message"].startswith(f"{where}: the string holds a lone UTF-16 surrogate"), err["message"]
    assert "hex escape" not in err["message"]
    # a pair is a character
    ok = api[0].post("/v1/completions", content=b'{"prompt": "\\ud83d\\ude00", "max_tokens": 1}')
    assert ok.status_code == 200, ok.text


def test_a_body_over_the_limit_is_413_from_its_length(api):
    r = api[0].post("/v1/completions", content=b"{}", headers={"Content-Length": str(MAX_BODY_BYTES + 1)})
    _error(r, 413)


def test_unknown_model_path_and_method(api):
    client = api[0]
    _error(client.post("/v1/chat/completions", json={"messages": CHAT, "model": "gpt-4"}), 404, "model",
           "model_not_found")
    assert client.post("/v1/completions", json={"prompt": "x", "model": "fake-model"}).status_code == 200  # the stem
    _error(client.get("/nope"), 404)
    _error(client.put("/v1/completions"), 405)


@pytest.mark.parametrize("path,body,fail,status,param,code", [
    ("/v1/completions", {"prompt": "x"}, Invalid("n is above max_num_seqs", "n"), 400, "n", None),
    ("/v1/completions", {"prompt": [0x10FFFF + 1]}, Invalid("token id out of the vocabulary", "prompt"), 400,
     "prompt", None),
    ("/v1/chat/completions", {"messages": CHAT}, Invalid("the prompt is too long", "prompt"), 400, "messages", None),
    ("/v1/chat/completions", {"messages": CHAT}, ValueError("prompt is too long"), 400, None, None),
    ("/v1/completions", {"prompt": "x"}, QueueFull(), 429, None, "queue_full"),
])
def test_refusals_at_submit(api, path, body, fail, status, param, code):
    client, worker, _ = api
    worker.fail = fail
    r = client.post(path, json=body)
    _error(r, status, param, code)
    if status == 429:
        assert r.headers["Retry-After"] == "1" and r.json()["error"]["type"] == "rate_limit_error"


def test_submit_to_a_shut_down_engine_is_503(api):
    client, worker, _ = api
    worker.fail = _native.EngineShutDown("the engine has been shut down")
    err = _error(client.post("/v1/completions", json={"prompt": "x"}), 503, None, "shutting_down")
    assert err["type"] == "service_unavailable"


def test_the_key_comes_before_readiness_and_the_body():
    app, _ = _app(api_key="k")
    with TestClient(app) as client:
        assert app.state.server.loaded.wait(10)
        _error(client.post("/v1/completions", content=b"{"), 401, None, "invalid_api_key")
        _error(client.get("/v1/models", headers={"Authorization": "Bearer nope"}), 401, None, "invalid_api_key")
        ok = {"Authorization": "Bearer k"}
        assert client.get("/v1/models", headers=ok).json()["data"][0]["id"] == "fake"
        assert client.get("/health").json() == {"status": "ok", "model": "fake"}  # no key needed
        app.state.server.draining = True
        _error(client.get("/v1/models", headers=ok), 503, None, "shutting_down")
        r = client.get("/health")
        assert (r.status_code, r.json()) == (503, {"status": "draining"})


def test_a_failed_load_is_503_model_not_ready():
    def load(st, loop):
        st.load_error = "no such file"
        st.loaded.set()
    app = create_app(Settings(), load=load)
    with TestClient(app) as client:
        assert app.state.server.loaded.wait(10)
        err = _error(client.post("/v1/completions", json={"prompt": "x"}), 503, None, "model_not_ready")
        assert "no such file" in err["message"]
        assert client.get("/health").json() == {"status": "error", "error": "no such file"}


# --- sampling parameters from a request -------------------------------------------------------

def test_sampling_parameters(api):
    client, worker, _ = api
    client.post("/v1/completions", json={"prompt": "abcd"})
    client.post("/v1/chat/completions", json={"messages": CHAT})  # "<user>hi": 8 tokens
    client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 3, "max_completion_tokens": 5,
                                              "temperature": 0, "top_k": 4, "stop": "x", "seed": 9, "n": 2})
    client.post("/v1/completions", json={"prompt": "abcd", "max_tokens": 1000})
    p = [params for _, params in worker.submitted]
    assert p[0].max_new_tokens == 16 and p[0].temperature == 1.0 and p[0].n == 1  # OpenAI's defaults
    assert worker.submitted[1][0] == [ord(c) for c in "<user>hi"] and p[1].max_new_tokens == CTX - 8
    assert (p[2].max_new_tokens, p[2].temperature, p[2].top_k, p[2].stop, p[2].seed, p[2].n) == (5, 0.0, 4, ["x"], 9, 2)
    assert p[3].max_new_tokens == CTX - 4  # fitted to the context


def test_prompts_that_fill_the_context_and_logprob_options(api):
    client, worker, _ = api
    err = _error(client.post("/v1/completions", json={"prompt": "x" * CTX}), 400, "prompt")
    assert f"the context holds {CTX}" in err["message"]
    _error(client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x" * CTX}]}), 400,
           "messages")
    _error(client.post("/v1/chat/completions", json={"messages": CHAT, "top_logprobs": 2}), 400, "top_logprobs")
    _error(client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": [{"type": "image"}]}]}),
           400, "messages")
    assert worker.submitted == []


# --- responses --------------------------------------------------------------------------------

def test_completion_response(api):
    client, _, _ = api
    r = client.post("/v1/completions", json={"prompt": "abcd", "max_tokens": 3, "logprobs": 2, "return_margins": True,
                                             "seed": 5})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
    assert (body["model"], body["system_fingerprint"]) == ("fake", "fp_fake")
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7,
                             "prompt_tokens_details": {"cached_tokens": 2}}
    [c] = body["choices"]
    assert list(c) == ["index", "text", "logprobs", "finish_reason", "fingerprint", "seed", "margins", "rechecked"]
    assert (c["index"], c["text"], c["finish_reason"], c["seed"]) == (0, "abc", "length", 5)
    assert c["fingerprint"] == "0" * 32
    assert c["margins"] == [None, 0.5, 0.5] and c["rechecked"] == [1, 0, 0]  # NaN is null
    assert c["logprobs"] == {"tokens": ["a", "b", "c"], "token_logprobs": [-0.25, -0.5, -0.75],
                             "top_logprobs": [{"a": -0.25, "z": -1.25}, {"b": -0.5, "z": -1.5},
                                              {"c": -0.75, "z": -1.75}],
                             "text_offset": [0, 1, 2]}


def test_chat_response_with_n_and_logprobs(api):
    client, _, _ = api
    body = client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2, "n": 2, "logprobs": True,
                                                     "top_logprobs": 1}).json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert [c["message"] for c in body["choices"]] == [{"role": "assistant", "content": "ab"},
                                                       {"role": "assistant", "content": "bc"}]
    assert "margins" not in body["choices"][0]
    assert body["usage"]["completion_tokens"] == 4
    assert body["choices"][1]["logprobs"]["content"][0] == {
        "token": "b", "logprob": -0.25, "bytes": [98], "top_logprobs": [{"token": "b", "logprob": -0.25, "bytes": [98]}]}


def test_logprobs_without_alternatives(api):
    client, _, _ = api
    c = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "logprobs": 0}).json()["choices"][0]
    assert c["logprobs"]["top_logprobs"] == [{}, {}] and c["logprobs"]["token_logprobs"] == [-0.25, -0.5]
    c = client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1, "logprobs": True}).json()
    assert c["choices"][0]["logprobs"]["content"][0]["top_logprobs"] == []


# --- streams ----------------------------------------------------------------------------------

def test_completion_stream_chunks(api):
    client, worker, _ = api
    req = {"prompt": "abcd", "max_tokens": 3, "logprobs": 1, "stream": True, "stream_options": {"include_usage": True}}
    chunks = _events(client.post("/v1/completions", json=req))
    assert all(ch["object"] == "text_completion" and ch["system_fingerprint"] == "fp_fake" for ch in chunks)
    assert len({ch["id"] for ch in chunks}) == 1
    *tokens, finish, last = chunks
    assert [ch["choices"][0]["text"] for ch in tokens] == ["a", "b", "c"]
    assert all(ch["usage"] is None for ch in tokens + [finish])
    # each streamed token's logprobs, its text offset counted over the stream
    assert [ch["choices"][0]["logprobs"] for ch in tokens] == [
        {"tokens": [t], "token_logprobs": [lp], "top_logprobs": [{t: lp}], "text_offset": [i]}
        for i, (t, lp) in enumerate([("a", -0.25), ("b", -0.5), ("c", -0.75)])]
    assert finish["choices"] == [{"index": 0, "text": "", "logprobs": None, "finish_reason": "length",
                                  "fingerprint": "0" * 32, "seed": 7}]
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 3
    assert worker.cancelled == []  # it finished: nothing to cancel


def test_chat_stream_opens_with_the_role_and_ends_with_the_held_back_text(api):
    client, worker, _ = api
    worker.hold_back = 2  # the last two tokens' text is held back (a stop string could start there)
    chunks = _events(client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 4, "n": 2,
                                                               "stream": True}))
    assert all(ch["object"] == "chat.completion.chunk" and "usage" not in ch for ch in chunks)
    assert chunks[0]["choices"] == [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                     "finish_reason": None} for i in range(2)]
    texts = {0: "", 1: ""}
    for ch in chunks[1:-1]:
        for c in ch["choices"]:
            assert c["finish_reason"] is None and set(c["delta"]) == {"content"}
            texts[c["index"]] += c["delta"]["content"]
    assert texts == {0: "ab", 1: "bc"}  # two steps sent, the empty deltas not
    last = chunks[-1]["choices"]
    assert [c["delta"] for c in last] == [{"content": "cd"}, {}, {"content": "de"}, {}]
    assert [c["finish_reason"] for c in last] == [None, "length", None, "length"]
    assert [c.get("seed") for c in last] == [None, 7, None, 7]


def _writes(client, path, req):
    """A stream's writes, each as its list of SSE events (JSON, less the per-request id and time)."""
    with client.stream("POST", path, json=req) as r:
        writes = [w.decode() for w in r.iter_raw()]
    strip = lambda e: "[DONE]" if e == "[DONE]" else {k: v for k, v in json.loads(e).items()
                                                      if k not in ("id", "created")}
    return [[strip(b[6:]) for b in w.split("\n\n") if b] for w in writes]


@pytest.mark.parametrize("path,req", [
    ("/v1/completions", {"prompt": "abcd", "max_tokens": 6, "logprobs": 1, "stream": True,
                         "stream_options": {"include_usage": True}}),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 6, "n": 2, "stream": True})])
def test_a_stream_interval_merges_writes_not_events(path, req):
    """``stream_interval_ms``: the same events, fewer writes; the first token is never held."""
    writes = {}
    for ms in (0, 300, 60_000):
        app, workers = _app(stream_interval_ms=ms)
        with TestClient(app) as client:
            assert app.state.server.loaded.wait(10)
            if ms == 300:
                # steps at 0, 10 ms, then 1 s: the first is written at once, the second waits for
                # its due write (300 ms), alone; the third, after a quiet spell, goes at once and
                # the others that come with it wait for the end
                workers[0].delays = [0, 0.01, 1.0, 1.0, 1.0, 1.0]
            writes[ms] = _writes(client, path, req)
    events = [e for w in writes[0] for e in w]
    opening = 1 if "messages" in req else 0
    assert len(writes[0]) == opening + 6  # one write per step (the last one carries the finish)
    for ms in (300, 60_000):
        assert [e for w in writes[ms] for e in w] == events
    sizes = lambda ws: [len(w) for w in ws][opening:]
    assert sizes(writes[300]) == [1, 1, 1, len(events) - opening - 3]
    assert sizes(writes[60_000]) == [1, len(events) - opening - 1]


def test_an_engine_failure(api):
    client, worker, _ = api
    worker.engine_failure = "engine error: boom"
    _error(client.post("/v1/completions", json={"prompt": "x"}), 500, None, "engine_error")
    r = client.post("/v1/chat/completions", json={"messages": CHAT, "stream": True})
    blocks = r.text.split("\n\n")
    assert json.loads(blocks[0][6:])["choices"][0]["delta"]["role"] == "assistant"
    assert json.loads(blocks[1][6:]) == {"error": {"message": "engine error: boom", "type": "internal_error",
                                                   "param": None, "code": "engine_error"}}
    assert blocks[2:] == ["data: [DONE]", ""]


# --- tokenizer endpoints ----------------------------------------------------------------------

def test_tokenize_and_detokenize(api):
    client = api[0]
    assert client.post("/tokenize", json={"prompt": "hé"}).json() == {"tokens": [104, 233], "count": 2,
                                                                       "max_model_len": CTX}
    assert client.post("/tokenize", json={"messages": CHAT}).json()["count"] == 8
    _error(client.post("/tokenize", json={}), 400, "prompt")
    assert client.post("/detokenize", json={"tokens": [104, 233]}).json() == {"prompt": "hé"}
    err = _error(client.post("/detokenize", json={"tokens": [0x110000]}), 400, "tokens")
    assert err["message"] == f"token id {0x110000} is outside the vocabulary of {0x110000}"


# --- metrics ----------------------------------------------------------------------------------

def test_metrics_names_and_counts(api):
    client = api[0]
    client.post("/v1/completions", json={"prompt": "abcd", "max_tokens": 3})
    client.post("/v1/completions", json={"prompt": "abcd", "max_tokens": "3"})
    r = client.get("/metrics")
    assert r.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    text = r.text
    lbl = 'model_name="fake"'
    for line in (f"candle_gate:prompt_tokens_total{{{lbl}}} 4.0", f"candle_gate:generation_tokens_total{{{lbl}}} 3.0",
                 f'candle_gate:request_success_total{{finished_reason="length",{lbl}}} 1.0',
                 f'candle_gate:request_errors_total{{{lbl},status="400"}} 1.0',
                 f'candle_gate:request_errors_total{{{lbl},status="429"}} 0.0',
                 f"candle_gate:time_to_first_token_seconds_count{{{lbl}}} 1.0",
                 f"candle_gate:inter_token_latency_seconds_count{{{lbl}}} 2.0",
                 f"candle_gate:e2e_request_latency_seconds_count{{{lbl}}} 1.0",
                 f"candle_gate:num_requests_running{{{lbl}}} 0.0", f"candle_gate:kv_cache_usage_perc{{{lbl}}} 0.0",
                 f"candle_gate:gate_deep_rechecks_total{{{lbl}}} 0.0", f"candle_gate:num_preemptions_total{{{lbl}}} 0.0",
                 "# TYPE candle_gate:time_to_first_token_seconds histogram",
                 "# TYPE candle_gate:prefix_cache_hits_total counter"):
        assert line in text.splitlines(), line
    assert "_created" not in text


def test_refusals_before_the_model_loaded_move_to_its_name():
    m = Metrics()
    m.refused(503)
    m.refused(503)
    assert 'candle_gate:request_errors_total{model_name="",status="503"} 2.0' in m.exposition().decode()
    m.bind("smol")
    text = m.exposition().decode()
    assert 'candle_gate:request_errors_total{model_name="smol",status="503"} 2.0' in text
    assert 'model_name=""' not in text


def test_the_openapi_document_shows_the_engines_bounds():
    """The request fields carry Rust's sampling bounds (``_native.SAMPLING_BOUNDS``), not a copy."""
    app, _ = _app()
    with TestClient(app) as client:
        schemas = client.get("/openapi.json").json()["components"]["schemas"]
    bounds = _native.SAMPLING_BOUNDS

    def field(model, name):
        return next(x for x in schemas[model]["properties"][name]["anyOf"] if x.get("type") != "null")

    names = {"gt": "exclusiveMinimum", "ge": "minimum", "lt": "exclusiveMaximum", "le": "maximum"}
    for model, name, engine_name in (("CompletionRequest", "max_tokens", "max_new_tokens"),
                                     ("ChatCompletionRequest", "max_completion_tokens", "max_new_tokens"),
                                     ("CompletionRequest", "n", "n"), ("CompletionRequest", "top_p", "top_p"),
                                     ("CompletionRequest", "temperature", "temperature"),
                                     ("CompletionRequest", "repetition_penalty", "repetition_penalty"),
                                     ("CompletionRequest", "logprobs", "top_logprobs"),
                                     ("ChatCompletionRequest", "top_logprobs", "top_logprobs")):
        got = field(model, name)
        assert {names[k]: v for k, v in bounds[engine_name].items()} == {k: got[k] for k in names.values() if k in got}
    assert bounds["max_new_tokens"]["le"] == _native.MAX_NEW_TOKENS_LIMIT and bounds["n"]["le"] == _native.MAX_N
    assert bounds["top_logprobs"]["le"] == _native.MAX_TOP_LOGPROBS
    stop_list = next(x for x in schemas["CompletionRequest"]["properties"]["stop"]["anyOf"] if x.get("type") == "array")
    assert stop_list["maxItems"] == _native.MAX_STOP


def test_every_engine_finish_reason_has_an_openai_name():
    from candle_gate.server.protocol import FINISH_REASON, FINISH_REASONS
    assert set(FINISH_REASON) == set(_native.FINISH_REASONS)
    assert set(FINISH_REASON.values()) == set(FINISH_REASONS)


def test_settings_from_the_cli_flags():
    from candle_gate.cli import build_parser
    a = build_parser().parse_args(["serve", "--port", "9", "--api-key", "k", "--no-prefix-cache",
                                   "--max-model-len", "40", "--max-queue", "3"])
    s = Settings.from_args(a)
    assert (s.port, s.api_key, s.enable_prefix_caching, s.max_model_len, s.max_queue) == (9, "k", False, 40, 3)
    assert Settings.from_args(build_parser().parse_args(["serve"])).enable_prefix_caching
    assert Settings.from_args(build_parser().parse_args(["serve", "--stream-interval-ms", "20"])).stream_interval_ms == 20


def test_the_serve_flags_are_the_settings_fields():
    """One owner: every Settings field but the replica's own is a serve flag, stored under the
    field's name, with the field's help."""
    import dataclasses
    from candle_gate.cli import build_parser
    from candle_gate.server.settings import FLAG_NAMES
    parser = build_parser()
    [serve] = [p for p in parser._subparsers._group_actions[0].choices.values() if p.prog.endswith(" serve")]
    by_dest = {a.dest: a for a in serve._actions}
    for f in dataclasses.fields(Settings):
        if FLAG_NAMES.get(f.name, "") is None:
            assert f.name not in by_dest, f.name
            continue
        assert f.name in by_dest, f.name
        assert by_dest[f.name].help.startswith(f.metadata["help"]), f.name


def test_the_old_name_of_max_tokens_per_step_still_works_and_warns(capsys):
    from candle_gate.cli import build_parser
    a = build_parser().parse_args(["serve", "--max-num-batched-tokens", "64"])
    assert Settings.from_args(a).max_tokens_per_step == 64
    assert "--max-num-batched-tokens is deprecated, use --max-tokens-per-step" in capsys.readouterr().err
    assert Settings.from_args(build_parser().parse_args(["serve", "--max-tokens-per-step", "32"])).max_tokens_per_step == 32
    assert capsys.readouterr().err == ""
    with pytest.warns(DeprecationWarning, match="max_tokens_per_step"):
        assert Settings(max_num_batched_tokens=48).max_tokens_per_step == 48


# --- the API key off the command line, and what it guards (issue 53) ---------------------------

def test_the_api_key_from_an_environment_variable_or_a_file(tmp_path, monkeypatch):
    from candle_gate.cli import build_parser
    parse = lambda *a: Settings.from_args(build_parser().parse_args(["serve", *a]))  # noqa: E731
    monkeypatch.setenv("CG_TEST_KEY", "sk-env")
    assert parse("--api-key-env", "CG_TEST_KEY").api_key == "sk-env"
    f = tmp_path / "key"
    f.write_text("sk-file\n")
    assert parse("--api-key-file", str(f)).api_key == "sk-file"
    assert parse().api_key is None and parse().api_key_scope == "api"
    with pytest.raises(ValueError, match="CG_TEST_UNSET is not set"):
        parse("--api-key-env", "CG_TEST_UNSET")
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="holds no key"):
        parse("--api-key-file", str(tmp_path / "empty"))
    with pytest.raises(SystemExit):  # one source at a time
        build_parser().parse_args(["serve", "--api-key", "k", "--api-key-env", "CG_TEST_KEY"])


@pytest.mark.parametrize("scope", ["api", "all"])
def test_the_key_scope_guards_metrics_and_docs_only_when_asked(scope):
    app, _ = _app(api_key="k", api_key_scope=scope)
    ok = {"Authorization": "Bearer k"}
    with TestClient(app) as client:
        assert app.state.server.loaded.wait(10)
        for path in ("/metrics", "/docs", "/redoc", "/openapi.json"):
            r = client.get(path)
            if scope == "all":
                _error(r, 401, None, "invalid_api_key")
                assert client.get(path, headers=ok).status_code == 200
            else:
                assert r.status_code == 200, path
        assert client.get("/health").status_code == 200  # open either way
        _error(client.get("/v1/models"), 401, None, "invalid_api_key")
        doc = client.get("/openapi.json", headers=ok).json()  # the document says so
        assert ("security" in doc["paths"]["/metrics"]["get"]) == (scope == "all")


# --- the server's own bounds ------------------------------------------------------------------

def test_settings_are_the_serve_flags_defaults():
    """One owner: the flags' defaults are the Settings fields' (the engine's options are
    ENGINE_DEFAULTS, which Settings leaves to the engine as None)."""
    import dataclasses
    from candle_gate.cli import build_parser
    a = build_parser().parse_args(["serve"])
    for f in dataclasses.fields(Settings):
        if f.name in vars(a) and f.default is not None:
            assert getattr(a, f.name) == f.default, f.name


class _Uvicorn:
    """The app (with the fakes) under a real uvicorn on loopback, in a thread, configured as
    ``serve`` configures it (``uvicorn_config``)."""

    def __init__(self, **settings):
        import dataclasses
        import threading
        import uvicorn
        from candle_gate.server.app import uvicorn_config
        from ..live_server import free_port
        self.app, self.workers = _app(**settings)
        self.port = free_port()
        s = dataclasses.replace(self.app.state.server.settings, port=self.port, log_level="warning")
        self.server = uvicorn.Server(uvicorn_config(self.app, s))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        from ..live_server import wait_until
        wait_until(lambda: self.server.started, "uvicorn started", timeout=30)

    def close(self):
        self.server.should_exit = True
        self.thread.join(10)


def _http_response(sock):
    """Reads one HTTP response (head and Content-Length body) from a raw socket."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return data.decode("latin-1"), None
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = int([h.split(b":")[1] for h in head.split(b"\r\n") if h.lower().startswith(b"content-length:")][0])
    while len(body) < length:
        body += sock.recv(65536)
    return head.decode("latin-1"), json.loads(body)


def test_a_body_trickling_in_is_cut_at_the_read_timeout():
    import socket
    import time
    srv = _Uvicorn(read_timeout=1.0)
    try:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 20\r\n\r\n{")
            t0 = time.monotonic()
            s.settimeout(0.3)
            head = None
            for _ in range(100):  # one byte every 0.3 s: 20 bytes would take 6 s
                try:
                    head, body = _http_response(s)
                    break
                except socket.timeout:
                    s.sendall(b" ")
            waited = time.monotonic() - t0
            assert head is not None and head.startswith("HTTP/1.1 408"), head
            assert "connection: close" in head.lower()
            assert body["error"]["code"] == "read_timeout" and body["error"]["type"] == "invalid_request_error"
            assert waited < 6  # cut before the body was whole, not answered after it
        assert srv.workers[0].submitted == []
        # a body sent whole is served as before
        r = json.loads(_post_raw(srv.port, {"prompt": "ab", "max_tokens": 2}))
        assert r["choices"][0]["text"] == "ab"
    finally:
        srv.close()


@pytest.mark.parametrize("first", [False, True], ids=["new-connection", "kept-alive"])
def test_a_request_head_trickling_in_is_cut_at_the_read_timeout(first):
    """uvicorn itself never bounds the request line and headers: a client sending them a byte at
    a time held the connection for ever. Also on a kept-alive connection's next request."""
    import socket
    import time
    srv = _Uvicorn(read_timeout=1.0)
    try:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as s:
            if first:  # one whole request first: the connection is kept alive
                s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                head, body = _http_response(s)
                assert head.startswith("HTTP/1.1 200") and body["status"] == "ok"
            t0 = time.monotonic()
            s.settimeout(0.3)
            head = None
            for b in b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 40:  # 0.3 s a byte: 20 s
                try:
                    s.sendall(bytes([b]))
                    head, body = _http_response(s)
                    break
                except socket.timeout:
                    pass
                except (BrokenPipeError, ConnectionResetError):
                    break
            waited = time.monotonic() - t0
        assert head is not None and head.startswith("HTTP/1.1 408"), head
        assert body["error"]["code"] == "read_timeout" and "request head" in body["error"]["message"]
        assert waited < 10
    finally:
        srv.close()


def _post_raw(port, body):
    import httpx
    return httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=30).text


def test_a_server_whose_model_cannot_load_exits_non_zero(tmp_path):
    """Not a server answering 503 forever: the reason, and a status a supervisor sees."""
    import subprocess
    import sys
    from ..live_server import free_port
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF" + b"\xff" * 60)
    r = subprocess.run([sys.executable, "-m", "candle_gate", "serve", "--model", str(junk), "--port",
                        str(free_port())], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "could not load the model" in r.stderr and "GGUF" in r.stderr


# --- defaults that fit, and answers that repeat (issue 53) -------------------------------------

def test_a_chat_without_max_tokens_gets_what_the_kv_pool_holds():
    """With a pool smaller than the context, "the rest of the context" could never be admitted:
    the default becomes what the pool can hold for the request's choices (whole blocks)."""
    app, workers = _app(kv_pool=(3, 16))  # 48 positions, the context 64
    with TestClient(app) as client:
        assert app.state.server.loaded.wait(10)
        assert client.post("/v1/chat/completions", json={"messages": CHAT}).status_code == 200  # 8 tokens
        client.post("/v1/chat/completions", json={"messages": CHAT, "n": 2})  # a block each... of 16
        client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 50})  # asked for: as asked
        client.post("/v1/completions", json={"prompt": "abcd"})  # completions: 16, as OpenAI
    p = [params for _, params in workers[0].submitted]
    assert p[0].max_new_tokens == 48 - 8
    assert p[1].max_new_tokens == 16 - 8 and p[1].n == 2
    assert p[2].max_new_tokens == 50
    assert p[3].max_new_tokens == 16


def test_a_greedy_answer_reports_no_drawn_seed(api):
    """Greedy decoding draws nothing: no seed is reported unless the request gave one, so equal
    requests get equal choices; sampling reports the seed its draws were keyed by."""
    client = api[0]
    greedy = {"prompt": "abcd", "max_tokens": 2, "temperature": 0}
    for body in (greedy, {**greedy, "stream": True}):
        r = client.post("/v1/completions", json=body)
        choices = [c for ch in _events(r) for c in ch["choices"]] if body.get("stream") else r.json()["choices"]
        assert all("seed" not in c for c in choices), choices
    [c] = client.post("/v1/completions", json={**greedy, "seed": 3}).json()["choices"]
    assert c["seed"] == 3
    [c] = client.post("/v1/completions", json={"prompt": "abcd", "max_tokens": 2}).json()["choices"]  # 1.0
    assert c["seed"] == 7  # the fake engine's drawn seed
