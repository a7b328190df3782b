"""The endpoint probe (``candle-gate probe --endpoint``, ``candle_gate.probe.endpoint``): against
real ``candle-gate serve`` subprocesses on loopback (invariant and split_k_f16), non-streaming and
streaming, with string, chat and token-id prompts; the scoring on constructed completions; and
the retry loop against a small stub server (faults only; the waits it chooses are recorded, not
slept)."""
import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

import candle_gate  # noqa: E402
from candle_gate.probe import endpoint as ep  # noqa: E402
from candle_gate.probe import endpoint_client  # noqa: E402

from ..engine.test_gate import CHATS  # noqa: E402
from ..live_server import Server  # noqa: E402

M = candle_gate.DEFAULT_MODEL
PROMPTS = ["The capital of France is", "The three primary colors are",
           [{"role": "user", "content": "Name three colors."}],
           [{"role": "user", "content": "What is 2 + 2?"}]]
N = 48  # tokens per chat in the split_k_f16 test
FAST = ep.RetryPolicy(max_retries=3, backoff=0.05, max_backoff=0.2, max_retry_after=5)


@pytest.fixture(scope="module")
def invariant_server():
    s = Server("--mode", "invariant")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def token_ids(invariant_server):
    """PROMPTS[0] as the server's token ids (its /tokenize)."""
    r = httpx.post(invariant_server.url + "/tokenize", json={"prompt": PROMPTS[0]}, timeout=30)
    r.raise_for_status()
    return r.json()["tokens"]


@pytest.fixture(scope="module")
def invariant_reports(invariant_server, token_ids):
    """The same probe of the invariant server, non-streaming and streaming: PROMPTS and
    PROMPTS[0] again as token ids (sent to /v1/completions as ``prompt: [int, ...]``)."""
    prompts = PROMPTS + [token_ids]
    return {stream: ep.probe_endpoint(invariant_server.url + "/v1", M, prompts, repeats=3, concurrency=[1, 4],
                                      max_tokens=8, temperature=0, seed=0, stream=stream)
            for stream in (False, True)}


# ------------------------------------------------------------------------- real servers

@pytest.mark.model
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_invariant_server_gives_one_completion_per_prompt_at_every_load(invariant_reports, stream):
    r = invariant_reports[stream]
    n = len(PROMPTS) + 1
    assert r["stream"] is stream
    assert r["errors"] == 0 and r["completions"] == n * 3 * 4 and r["retries"] == {}
    assert r["all_identical"] is True and r["prompts_with_flips"] == 0 and r["prose_flips"] == 0
    assert len(r["fingerprints"]) == 1 and r["fingerprint_change"] is False
    assert r["fingerprints"][0].startswith("fp_")
    assert r["logprobs"] == {"requested": True, "used": True, "note": None}
    for e in r["prompts"]:
        assert e["distinct"] == 1 and e["k_of_n"] == [12, 12] and e["first_divergence"] is None
        assert set(e["by_concurrency"]) == {"1", "4"}
        assert all(v["distinct"] == 1 for v in e["by_concurrency"].values())
        assert set(e["by_order"]) == {"alone", "burst", "interleaved"}
    assert [e["kind"] for e in r["prompts"]] == ["completion", "completion", "chat", "chat", "token_ids"]
    # The token ids of PROMPTS[0] give its completion.
    assert r["prompts"][-1]["majority"] == r["prompts"][0]["majority"] and r["prompts"][0]["majority"]
    json.dumps(r)
    text = ep.format_report(r)
    assert "all identical: yes" in text and "<" in text and "token ids" in text
    assert ("streaming" in text.splitlines()[0]) is stream


@pytest.mark.model
def test_streaming_report_equals_the_non_streaming_one(invariant_reports):
    """Every field of the report but the elapsed time and the `stream` setting."""
    plain, streamed = (dict(invariant_reports[s]) for s in (False, True))
    for r in (plain, streamed):
        del r["elapsed_s"], r["stream"]
    assert streamed == plain


@pytest.mark.model
def test_streamed_completions_logprobs_and_fingerprint_equal_the_non_streamed(invariant_server, token_ids):
    """One request of each kind, non-streaming and streaming: the assembled text, token strings,
    top logprobs (so every divergence position and gap), fingerprint and finish reason are the
    same. The last chat asks for characters that take several byte-level tokens, whose text the
    server's stream holds back until they are complete."""
    import openai as oa
    client = oa.OpenAI(base_url=invariant_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    prompts = [PROMPTS[0], token_ids, PROMPTS[2],
               [{"role": "user", "content": "Write the word cat in Japanese, Greek and Russian."}]]
    got = {}
    for stream in (False, True):
        sender = ep.Sender(client, M, 24, 0.0, None, 3, FAST, "", stream=stream)
        got[stream] = [sender.send(p) for p in prompts]
    for p, a, b in zip(prompts, got[False], got[True]):
        assert a["ok"] and b["ok"], (a, b)
        assert a == b, p
        assert a["text"] and len(a["tokens"]) == len(a["top"]) == 24 and a["finish_reason"] == "length"
        assert all(len(t) == 3 for t in a["top"]) and a["fingerprint"].startswith("fp_")
    assert got[False][0]["text"] == got[False][1]["text"]  # token ids = the string


@pytest.mark.model
def test_split_k_f16_divergences_match_the_in_process_engine():
    """Ungated split_k_f16: the eight chats alone and in one burst of 8, whose requests share the
    server's steps (the lane's bits follow the row count), so some chat leaves its batch-1 path
    (in-process, batched together, two do: at tokens 33 and 39, hence 48 tokens). Without the
    prefix cache: in this lane a cached prefix carries the bits of the composition that computed
    it, and every "alone" run here must be the chat's own batch-1 path."""
    s = Server("--mode", "split_k_f16", "--max-num-seqs", "16", "--no-prefix-cache")
    try:
        reports = {stream: ep.probe_endpoint(s.url, M, CHATS, repeats=1, concurrency=8, max_tokens=N,
                                             temperature=0, orders="alone,burst", top_logprobs=2, stream=stream)
                   for stream in (False, True)}
    finally:
        s.stop()
    found = {}
    for stream, r in reports.items():
        assert r["errors"] == 0 and r["all_identical"] is False, stream
        diverging = {e["index"]: e for e in r["prompts"] if e["distinct"] > 1}
        assert diverging, stream
        for e in diverging.values():
            assert e["divergence_unit"] == "tokens" and e["k_of_n"] == [1, 2]
            assert e["by_order"]["alone"]["flips"] == 0 and e["by_order"]["burst"]["flips"] == 1
            assert e["gap_at_divergence"] is not None and 0 <= e["gap_at_divergence"] < 0.5
            assert not e["fingerprint_change"] and e["flip_under_one_fingerprint"]
            found[(stream, e["index"])] = e
    # Streaming: the same alone completions, and where a chat diverges at the same position in
    # both runs, the same gap (the bursts' arrivals decide which chats diverge).
    alone = {s_: [next(c["text"] for c in e["completions"] if "alone@1" in c["loads"]) for e in r["prompts"]]
             for s_, r in reports.items()}
    assert alone[True] == alone[False]
    for (stream, i), e in found.items():
        other = found.get((not stream, i))
        if other is not None and other["first_divergence"] == e["first_divergence"]:
            assert other["gap_at_divergence"] == e["gap_at_divergence"], i

    # The endpoint's alone run is the engine's batch-1 run, and the gap the probe reports at the
    # divergence is that run's own top1-top2 margin there: the near-tie the engine's probe sees.
    # (Which chats diverge, and where, depends on how the burst's arrivals share the server's
    # steps, so positions are not compared with an in-process batch of 8.)
    model = candle_gate.Model.load(layout=candle_gate.layout_for("split_k_f16"))
    runs = {}
    for (stream, i), e in found.items():
        if i not in runs:
            [runs[i]] = candle_gate.Engine(model, mode="split_k_f16").generate([CHATS[i]], max_new_tokens=N)
        alone = runs[i]
        assert alone.text == e["majority"]
        p = e["first_divergence"]
        assert 0 <= p < len(alone.token_ids)
        assert abs(e["gap_at_divergence"] - float(alone.margins[p])) < 1e-3, (stream, i, p)


@pytest.mark.model
def test_cli_writes_json_and_plot(invariant_server, tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("The capital of France is\nOnce upon a time\n")
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    env = {**os.environ, "CG_TEST_KEY": "sk-cli-secret-93af"}
    proc = subprocess.run(
        [sys.executable, "-m", "candle_gate", "probe", "--endpoint", invariant_server.url + "/v1",
         "--model", M, "--prompts", str(prompts), "--repeats", "1", "--concurrency", "2",
         "--max-tokens", "4", "--temperature", "0", "--api-key-env", "CG_TEST_KEY",
         "--extract", r"(\w+)", "--json", str(out), "--plot", str(png)],
        capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    r = json.loads(out.read_text())
    assert r["format"] == ep.FORMAT and r["completions"] == 2 * 3 and r["all_identical"] is True
    assert r["answer_flips"] == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "all identical: yes" in proc.stdout
    assert "sk-cli-secret-93af" not in proc.stdout + proc.stderr + out.read_text()


def _cli(argv, capsys):
    """``candle-gate probe ARGV`` in-process: (exit code, stderr)."""
    from candle_gate.cli import main
    try:
        rc = main(["probe", *argv])
    except SystemExit as e:  # argparse's usage errors
        rc = e.code
    return rc, capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--repeats", "0"], "--repeats must be at least 1"),
    (["--concurrency", "1,x"], "--concurrency"),
    (["--concurrency", "0"], "--concurrency"),
    (["--max-tokens", "0"], "--max-tokens must be at least 1"),
    (["--extract", "("], "bad regular expression"),
    (["--orders", "sideways"], "--orders"),
    (["--api-key-env", "CG_SURELY_UNSET_VAR"], "CG_SURELY_UNSET_VAR is not set"),
    (["--repeats", "two"], "invalid int value"),
    (["--extract", "a", "--json-field", "b"], "not allowed with"),
])
def test_cli_bad_arguments_exit_2(tmp_path, capsys, monkeypatch, argv, message):
    monkeypatch.delenv("CG_SURELY_UNSET_VAR", raising=False)
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello\n")
    rc, err = _cli(["--endpoint", "http://127.0.0.1:9/v1", "--prompts", str(prompts), *argv], capsys)
    assert rc == 2 and message in err, (rc, err)


@pytest.mark.model
def test_cli_stream_with_token_id_prompts_file(invariant_server, token_ids, tmp_path):
    """--stream, and a JSON prompts file holding a token-id prompt (a list of ints)."""
    prompts = tmp_path / "p.json"
    prompts.write_text(json.dumps([token_ids, PROMPTS[0], PROMPTS[3]]))
    out = tmp_path / "r.json"
    proc = subprocess.run(
        [sys.executable, "-m", "candle_gate", "probe", "--endpoint", invariant_server.url, "--model", M,
         "--prompts", str(prompts), "--repeats", "1", "--concurrency", "2", "--max-tokens", "6",
         "--temperature", "0", "--stream", "--json", str(out)],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    r = json.loads(out.read_text())
    assert r["stream"] is True and r["completions"] == 3 * 3 and r["errors"] == 0 and r["all_identical"] is True
    assert [e["kind"] for e in r["prompts"]] == ["token_ids", "completion", "chat"]
    assert r["prompts"][0]["prompt"] == token_ids
    assert r["prompts"][0]["majority"] == r["prompts"][1]["majority"]
    assert "streaming" in proc.stdout


def test_token_id_prompts_are_loaded_and_checked(tmp_path):
    from candle_gate.probe import load_prompts
    f = tmp_path / "p.json"
    f.write_text('[[1, 2, 3], "text", [{"role": "user", "content": "hi"}]]')
    assert load_prompts(str(f)) == [[1, 2, 3], "text", [{"role": "user", "content": "hi"}]]
    assert [ep.prompt_kind(p) for p in load_prompts(str(f))] == ["token_ids", "completion", "chat"]
    for bad in ([[-1, 2]], [[1.5]], [[]], [[True]]):
        with pytest.raises(ValueError):
            ep.probe_endpoint("http://127.0.0.1:9/v1", "m", bad)


def test_the_endpoint_probe_shares_the_probe_package_helpers():
    """One probe package: the endpoint probe checks prompts and concurrency levels and compares
    outputs with candle_gate.probe.common, as the in-process probe does."""
    import numpy as np

    import candle_gate.probe as probe
    from candle_gate.probe import common, endpoint_report
    assert ep.check_prompts is probe.check_prompts is common.check_prompts
    assert probe.load_prompts is common.load_prompts
    assert ep.check_concurrency is probe.check_concurrency is common.check_concurrency
    assert endpoint_report.first_difference is probe.report.first_difference is common.first_difference
    fd = common.first_difference
    assert fd(["A", " B"], ["A", " D"]) == 1 and fd("abc", "abcdef") == 3 and fd("abc", "abc") is None
    assert fd(np.array([1, 2, 3]), np.array([1, 2, 4])) == 2 and fd(np.array([1, 2]), np.array([1, 2])) is None


def test_cli_usage_errors_exit_2(tmp_path, capsys):
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello\n")
    for argv, message in ((["--repeats", "2"], "--repeats needs --endpoint"),
                          (["--stream"], "--stream needs --endpoint"),
                          (["--endpoint", "http://127.0.0.1:9/v1"], "--endpoint needs --prompts"),
                          (["--endpoint", "localhost:1", "--prompts", str(prompts)], "expected an http(s) URL"),
                          (["--endpoint", "http://127.0.0.1:9/v1", "--prompts", str(tmp_path / "nope")],
                           "does not exist")):
        rc, err = _cli(argv, capsys)
        assert rc == 2 and message in err, (argv, rc, err)


# ----------------------------------------------------------------- scoring (constructed)

def _c(text, fp="fp_a", order="alone", conc=1, tokens=None, top=None):
    return {"text": text, "fingerprint": fp, "order": order, "concurrency": conc, "repeat": 0,
            "tokens": tokens, "top": top}


def test_extract_separates_answer_flips_from_prose_flips():
    ex = ep.make_extractor(extract=r"Label:\s*(\w+)")
    same_label = [_c("The review is glowing. Label: positive"),
                  _c("The review is glowing. Label: positive", order="burst", conc=4),
                  _c("This review sounds happy. Label: positive", order="burst", conc=4)]
    s = ep.score_completions(same_label, ex)
    assert s["distinct"] == 2 and s["flips"] == 1 and s["k_of_n"] == [2, 3]
    assert s["first_divergence"] == 2 and s["divergence_unit"] == "chars"  # "The" vs "This"
    assert s["answer"]["flips"] == 0 and s["answer"]["distinct"] == 1 and s["answer"]["majority"] == "positive"
    flipped = same_label + [_c("Hard to say. Label: negative", order="interleaved", conc=4)]
    s = ep.score_completions(flipped, ex)
    assert s["answer"]["flips"] == 1 and s["answer"]["values"] == {"positive": 3, "negative": 1}
    report = ep.summarize(["a", "b"], [ep.score_completions(same_label, ex), s], {})
    assert report["prose_flips"] == 1 + 2 and report["answer_flips"] == 1 and report["prompts_with_answer_flips"] == 1
    # No group: the whole match; no match: counted as unparsed.
    whole = ep.score_completions([_c("x 42"), _c("y 42"), _c("none")], ep.make_extractor(extract=r"\d+"))
    assert whole["answer"]["values"] == {"42": 2, "null": 1} and whole["answer"]["unparsed"] == 1


def test_json_field_answer():
    ex = ep.make_extractor(json_field="result.labels.0")
    cs = [_c('{"result": {"labels": ["spam", "x"]}, "why": "links"}'),
          _c('Sure: {"result": {"labels": ["spam"]}, "why": "many links"}'),
          _c('{"result": {"labels": ["ham"]}}')]
    s = ep.score_completions(cs, ex)
    assert s["flips"] == 2 and s["answer"]["flips"] == 1 and s["answer"]["majority"] == '"spam"'
    assert ex("not json") is None and ex('{"result": {}}') is None
    with pytest.raises(ValueError):
        ep.make_extractor(extract="a", json_field="b")


def test_token_divergence_gap_and_fingerprint_grouping():
    maj = _c("A B C", tokens=["A", " B", " C"], top=[[-0.1, -3.0], [-0.6, -0.8], [-0.2, -2.0]])
    other = _c("A D C", tokens=["A", " D", " C"], top=[[-0.1, -3.0], [-0.8, -0.6], [-0.2, -2.0]],
               order="burst", conc=8)
    s = ep.score_completions([maj, dict(maj, order="burst", concurrency=8), other])
    assert s["first_divergence"] == 1 and s["divergence_unit"] == "tokens"
    assert s["gap_at_divergence"] == pytest.approx(0.2)
    assert s["by_concurrency"] == {"1": {"n": 1, "distinct": 1, "flips": 0}, "8": {"n": 2, "distinct": 2, "flips": 1}}
    assert s["flip_under_one_fingerprint"] and not s["fingerprint_change"]
    # A fingerprint change with a different output, each fingerprint stable: not a flip under one.
    s = ep.score_completions([maj, maj, dict(other, fingerprint="fp_b"), dict(other, fingerprint="fp_b")])
    assert s["fingerprint_change"] and s["outputs_differ_across_fingerprints"]
    assert not s["flip_under_one_fingerprint"] and s["fingerprints"] == ["fp_a", "fp_b"]
    assert s["by_fingerprint"]["fp_b"] == {"n": 2, "distinct": 1, "k_of_n": [2, 2]}
    # A tie goes to the first completion (the alone run); a prefix diverges at its end.
    s = ep.score_completions([_c("abc"), _c("abcdef", order="burst")])
    assert s["majority"] == "abc" and s["first_divergence"] == 3


# --------------------------------------------------------------------- faults (stub server)

class _Stub:
    """Answers /v1/completions and /v1/chat/completions; the prompt (or last message) picks a fault:
    "rate": 429 with Retry-After: 1 once; "drop": the connection closed once; "err": 500 once;
    "dead": always 500; anything else: 200. ``reject_logprobs``: 400 on any request with logprobs.
    ``"stream": true`` gets SSE (chunked), a chunk per word, and three more faults: "sdrop...": the
    connection closed after the first chunk once; "serr": an error event once; "scut": a stream
    that ends ([DONE]) without a finish_reason once."""

    def __init__(self, reject_logprobs=False):
        self.seen = {}
        self.keys = set()
        stub = self

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def _send(self, status, body, headers=()):
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for k, v in headers:
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data)

            def _stream(self, body, chat, p, n, text):
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                head = {"id": "x", "object": "chat.completion.chunk" if chat else "text_completion",
                        "created": 0, "model": body.get("model"), "system_fingerprint": "fp_stub"}
                words = text.split(" ")
                pieces = [w if i == 0 else " " + w for i, w in enumerate(words)]
                if chat:
                    events = [{**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                    "finish_reason": None}]}]
                    events += [{**head, "choices": [{"index": 0, "delta": {"content": w}, "finish_reason": None}]}
                               for w in pieces]
                    events.append({**head, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
                else:
                    events = [{**head, "choices": [{"index": 0, "text": w, "finish_reason": None}]} for w in pieces]
                    events.append({**head, "choices": [{"index": 0, "text": "", "finish_reason": "stop"}]})
                if p == "scut" and n == 1:
                    events.pop()
                if p == "serr" and n == 1:
                    events.insert(1, {"error": {"message": "engine error: boom", "type": "internal_error",
                                                "param": None, "code": "engine_error"}})
                for k, ev in enumerate(events + ["[DONE]"]):
                    if p.startswith("sdrop") and n == 1 and k == 1:
                        self.wfile.flush()
                        self.close_connection = True
                        self.connection.shutdown(2)
                        return
                    data = ("data: " + (ev if isinstance(ev, str) else json.dumps(ev)) + "\n\n").encode()
                    self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                self.wfile.write(b"0\r\n\r\n")

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                stub.keys.add(self.headers.get("Authorization"))
                chat = "messages" in body
                p = body["messages"][-1]["content"] if chat else body["prompt"]
                n = stub.seen[p] = stub.seen.get(p, 0) + 1
                err = {"error": {"message": "boom", "type": "x", "param": None, "code": None}}
                if reject_logprobs and body.get("logprobs"):
                    return self._send(400, {"error": {"message": "logprobs are not supported", "type":
                                                      "invalid_request_error", "param": "logprobs", "code": None}})
                if p == "rate" and n == 1:
                    return self._send(429, err, [("Retry-After", "1")])
                if p == "drop" and n == 1:
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                if (p == "err" and n == 1) or p == "dead":
                    return self._send(500, err)
                text = f"answer to {p}"
                if body.get("stream"):
                    return self._stream(body, chat, p, n, text)
                if chat:
                    choice = {"index": 0, "message": {"role": "assistant", "content": text},
                              "finish_reason": "stop", "logprobs": None}
                    obj = "chat.completion"
                else:
                    choice = {"index": 0, "text": text, "finish_reason": "stop", "logprobs": None}
                    obj = "text_completion"
                self._send(200, {"id": "x", "object": obj, "created": 0, "model": body.get("model"),
                                 "system_fingerprint": "fp_stub", "choices": [choice]})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def stub():
    s = _Stub()
    yield s
    s.close()


@pytest.fixture
def waits(monkeypatch):
    """The retry loop's waits in seconds, in order, recorded instead of slept: the claims about
    Retry-After and the backoff are about what the loop waits, not how long a run took."""
    w = []
    monkeypatch.setattr(endpoint_client, "_sleep", w.append)
    return w


def test_faults_are_retried_and_persistent_errors_are_reported(stub, waits, monkeypatch, capsys):
    key = "sk-stub-secret-4411"
    monkeypatch.setenv("CG_STUB_KEY", key)
    prompts = ["rate", "drop", "err", "dead", [{"role": "user", "content": "ok"}]]
    r = ep.probe_endpoint(stub.url, "m", prompts, repeats=1, concurrency=1, orders="alone", max_tokens=4,
                          api_key_env="CG_STUB_KEY", retry=FAST)
    by = {e["index"]: e for e in r["prompts"]}
    for i in (0, 1, 2, 4):
        assert by[i]["n"] == 1 and by[i]["errors"] == 0, by[i]
        assert by[i]["majority"].startswith("answer to")
    assert stub.seen["rate"] == 2 and stub.seen["drop"] == 2 and stub.seen["err"] == 2
    dead = by[3]
    assert dead["n"] == 0 and dead["errors"] == 1 and dead["distinct"] == 0 and dead["majority"] is None
    assert dead["error_list"][0]["status"] == 500 and dead["error_list"][0]["attempts"] == 4
    assert stub.seen["dead"] == 4
    assert r["completions"] == 4 and r["errors"] == 1 and r["all_identical"] is False
    assert r["retries"] == {"429": 1, "transport": 1, "5xx": 4}
    # The 429's Retry-After: 1 (under FAST's cap of 5), then FAST's backoff 0.05 * 2**k (capped at
    # 0.2): once each for the dropped connection and the 500, three times for the dead prompt.
    assert waits == pytest.approx([1.0, 0.05, 0.05, 0.05, 0.1, 0.2])
    assert stub.keys == {f"Bearer {key}"}
    text = ep.format_report(r)
    print(text)
    out = capsys.readouterr()
    assert key not in json.dumps(r) + text + out.out + out.err
    assert "error: prompt 3" in text


def test_streaming_faults_are_retried(stub, waits):
    prompts = ["sdrop", "serr", [{"role": "user", "content": "scut"}], "rate", "drop",
               [{"role": "user", "content": "sdrop chat"}], "fine words here"]
    r = ep.probe_endpoint(stub.url, "m", prompts, repeats=1, concurrency=1, orders="alone", max_tokens=4,
                          retry=FAST, stream=True)
    assert r["errors"] == 0 and r["completions"] == len(prompts), [e["error_list"] for e in r["prompts"]]
    for p, e in zip(prompts, r["prompts"]):
        name = p[-1]["content"] if isinstance(p, list) else p
        assert e["majority"] == f"answer to {name}" and e["fingerprints"] == ["fp_stub"], e
    assert stub.seen["sdrop"] == stub.seen["sdrop chat"] == stub.seen["serr"] == stub.seen["scut"] == 2
    assert r["retries"] == {"transport": 4, "stream_error": 1, "429": 1}
    assert len(waits) == 6
    # A stream that always fails is an error of its prompt, never a (partial) completion.
    r = ep.probe_endpoint(stub.url, "m", ["dead"], repeats=1, concurrency=1, orders="alone", retry=FAST,
                          stream=True)
    assert r["completions"] == 0 and r["prompts"][0]["errors"] == 1 and r["prompts"][0]["error_list"][0]["status"] == 500


def test_retry_after_is_bounded(stub, waits):
    """The stub's Retry-After: 1 is waited only up to max_retry_after (0.1): the one wait is the
    cap, neither the header's second nor the backoff (0.01); then the retry gets the completion."""
    policy = ep.RetryPolicy(max_retries=1, backoff=0.01, max_retry_after=0.1)
    r = ep.probe_endpoint(stub.url, "m", ["rate"], repeats=1, concurrency=1, orders="alone", retry=policy)
    assert stub.seen["rate"] == 2 and r["retries"] == {"429": 1}
    assert r["completions"] == 1 and r["errors"] == 0
    assert waits == [0.1]


def test_logprobs_rejected_falls_back_without():
    s = _Stub(reject_logprobs=True)
    try:
        r = ep.probe_endpoint(s.url, "m", ["a", [{"role": "user", "content": "b"}]], repeats=2, concurrency=[1, 2],
                              retry=FAST)
    finally:
        s.close()
    assert r["errors"] == 0 and r["all_identical"] is True
    assert r["logprobs"]["used"] is False and "rejected logprobs" in r["logprobs"]["note"]
