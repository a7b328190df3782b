"""``candle-gate verify``: a response recorded from a real server is replayed in-process on the
same model file and found equal bit for bit; a tampered token or logprob is pinpointed; another
stack is named as such."""
import json
import math
import subprocess
import sys

import httpx
import pytest

import candle_gate
from ..live_server import Server

CHAT = {"messages": [{"role": "user", "content": "Name three colors."}], "max_tokens": 16,
        "temperature": 0, "logprobs": True, "top_logprobs": 3, "return_token_ids": True}
SAMPLED = {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0.9, "top_p": 0.95, "n": 2,
           "logprobs": 2, "return_token_ids": True}


@pytest.fixture(scope="module")
def records():
    s = Server()
    try:
        out = {}
        for name, path, body in [("chat", "/v1/chat/completions", CHAT), ("sampled", "/v1/completions", SAMPLED)]:
            r = httpx.post(s.url + path, json=body, timeout=120)
            assert r.status_code == 200, r.text
            out[name] = {"request": body, "response": r.json()}
        # Without return_token_ids: only text, logprobs and fingerprints can be compared.
        plain = {k: v for k, v in CHAT.items() if k != "return_token_ids"}
        out["plain"] = {"request": plain, "response": httpx.post(s.url + "/v1/chat/completions", json=plain,
                                                                 timeout=120).json()}
        return out
    finally:
        s.stop()


@pytest.mark.model
def test_the_server_returns_token_ids_on_request(records):
    resp = records["chat"]["response"]
    assert resp["prompt_token_ids"] and all(isinstance(t, int) for t in resp["prompt_token_ids"])
    ch = resp["choices"][0]
    assert len(ch["token_ids"]) == len(ch["logprobs"]["content"]) == resp["usage"]["completion_tokens"]
    assert "token_ids" not in records["plain"]["response"]["choices"][0]
    assert "prompt_token_ids" not in records["plain"]["response"]


@pytest.mark.model
@pytest.mark.parametrize("name", ["chat", "sampled", "plain"])
def test_a_recorded_response_verifies(records, name):
    v = candle_gate.verify(records[name])
    assert v.match, v.summary()
    assert v.system_fingerprint[0] == v.system_fingerprint[1]
    assert len(v.choices) == len(records[name]["response"]["choices"])
    if name == "plain":
        assert v.choices[0].token_ids is None and "not recorded" in v.summary()


@pytest.mark.model
def test_a_tampered_token_or_logprob_is_pinpointed(records):
    rec = json.loads(json.dumps(records["sampled"]))
    rec["response"]["choices"][1]["token_ids"][5] += 1
    v = candle_gate.verify(rec)
    assert not v.match
    assert v.choices[0].match and v.choices[1].first_token_difference == 5
    assert "first difference at output position 5" in v.summary()
    assert f"at output position 5: recorded token {rec['response']['choices'][1]['token_ids'][5]} " in v.summary()

    rec = json.loads(json.dumps(records["chat"]))
    entry = rec["response"]["choices"][0]["logprobs"]["content"][7]
    entry["logprob"] = math.nextafter(entry["logprob"], 0.0)  # one ulp of the double
    v = candle_gate.verify(rec)
    assert not v.match and v.choices[0].token_ids and v.choices[0].first_logprob_difference == 7


@pytest.mark.model
def test_another_stack_is_named(records):
    v = candle_gate.verify(records["chat"], mode="split_k_f16")
    assert not v.match
    assert v.system_fingerprint[0] != v.system_fingerprint[1]
    assert "the local stack differs" in v.summary()


@pytest.mark.model
def test_cli_exit_codes_and_bad_records(records, tmp_path):
    good, bad = tmp_path / "good.json", tmp_path / "bad.json"
    good.write_text(json.dumps(records["chat"]))
    rec = json.loads(json.dumps(records["chat"]))
    rec["response"]["choices"][0]["token_ids"][0] += 1
    bad.write_text(json.dumps(rec))
    run = lambda *a: subprocess.run([sys.executable, "-m", "candle_gate", "verify", *a],  # noqa: E731
                                    capture_output=True, text=True, timeout=600)
    r = run(str(good), "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)[0]["match"] is True
    r = run(str(bad))
    assert r.returncode == 1 and "MISMATCH" in r.stdout and "position 0" in r.stdout
    junk = tmp_path / "junk.json"
    junk.write_text(json.dumps({"response": {}}))
    r = run(str(junk))
    assert r.returncode == 2 and "a record is" in r.stderr


# --- the model comes from the record (issue 53) ------------------------------------------------

QWEN = "qwen2.5-coder-0.5b-instruct-q4_k_m"


@pytest.fixture(scope="module")
def qwen_record():
    """A record served on another model than the default, as the README runs it."""
    s = Server("--model", QWEN)
    try:
        body = {"messages": [{"role": "user", "content": "Name three colors."}], "max_tokens": 8, "temperature": 0,
                "return_token_ids": True}
        r = httpx.post(s.url + "/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return {"request": body, "response": r.json()}
    finally:
        s.stop()


def _verify_cli(tmp_path, record, *args):
    path = tmp_path / "record.json"
    path.write_text(json.dumps(record))
    return subprocess.run([sys.executable, "-m", "candle_gate", "verify", str(path), *args],
                          capture_output=True, text=True, timeout=600)


@pytest.mark.model
def test_verify_replays_on_the_records_model_without_a_banner(qwen_record, tmp_path):
    assert qwen_record["response"]["model"] == QWEN
    r = _verify_cli(tmp_path, qwen_record)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "MATCH" in r.stdout and f"replayed on {QWEN} (mode invariant, kv f16; from the record's model name)" \
        in r.stdout
    assert "http://" not in r.stdout + r.stderr and "recorded with" not in r.stdout + r.stderr


@pytest.mark.model
def test_a_renamed_model_is_found_by_its_fingerprint(qwen_record):
    rec = json.loads(json.dumps(qwen_record))
    rec["response"]["model"] = "my-assistant"  # --served-model-name
    v = candle_gate.verify(rec)
    assert v.match, v.summary()
    assert (v.origin.model, v.origin.found_by, v.origin.note) == (QWEN, "system_fingerprint", None)


@pytest.mark.model
def test_a_model_the_record_does_not_name_is_said_and_the_difference_shown(qwen_record, tmp_path):
    rec = json.loads(json.dumps(qwen_record))
    rec["response"]["model"] = "my-assistant"
    rec["response"]["system_fingerprint"] = "fp_0000000000000000"  # another build
    r = _verify_cli(tmp_path, rec)
    assert r.returncode == 1
    note = f"recorded with my-assistant, replaying with {candle_gate.DEFAULT_MODEL}"
    assert note in r.stderr and note in r.stdout
    # the first differing token, recorded and replayed, with text around it
    recorded = rec["response"]["choices"][0]["token_ids"]
    assert f"at output position 0: recorded token {recorded[0]} " in r.stdout
    assert ", replayed " in r.stdout and "  after '': recorded '" in r.stdout


@pytest.mark.model
def test_verify_with_another_model_given_says_so(qwen_record):
    v = candle_gate.verify(qwen_record, model=candle_gate.DEFAULT_MODEL)
    assert not v.match
    assert v.origin.note == f"recorded with {QWEN}, replaying with {candle_gate.DEFAULT_MODEL} " \
                            f"(the record's model name names {QWEN})"


@pytest.mark.model
def test_the_fingerprint_of_a_stack_is_the_engines(model):
    from candle_gate import _native
    eng = candle_gate.Engine(model, kv_dtype="f32", mode="gemm")
    assert _native.system_fingerprint(model.sha256(), "gemm", "f32", eng.gate) == eng.system_fingerprint


def test_records_name_their_model_without_loading_one():
    from candle_gate import _native
    from candle_gate.audit import model_by_fingerprint, model_by_name
    from candle_gate.models import KNOWN_MODELS
    k = KNOWN_MODELS[QWEN]
    assert model_by_name(QWEN) == QWEN
    assert model_by_name(k.file_name) == QWEN and model_by_name(k.file_name[:-len(".gguf")]) == QWEN
    assert model_by_name("gpt-4") is None
    assert model_by_fingerprint(_native.system_fingerprint(k.sha256, "split_k_f16", "f32")) == (QWEN, "split_k_f16",
                                                                                                "f32")
    assert model_by_fingerprint("fp_0000000000000000") is None
