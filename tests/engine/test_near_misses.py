"""Near misses get a suggestion (issue 53): another API's keyword (OpenAI's ``max_tokens``) and a
misspelt model name."""
import subprocess
import sys

import pytest

import candle_gate
from candle_gate.engine import did_you_mean
from candle_gate.models import close_model_names


@pytest.mark.model
@pytest.mark.parametrize("call", ["Model.generate", "Engine.generate", "Engine.submit"])
def test_max_tokens_suggests_max_new_tokens(model, call):
    eng = candle_gate.Engine(model)
    f = {"Model.generate": lambda **kw: model.generate(["Hi"], **kw),
         "Engine.generate": lambda **kw: eng.generate(["Hi"], **kw),
         "Engine.submit": lambda **kw: eng.submit("Hi", **kw)}[call]
    with pytest.raises(TypeError, match="'?max_tokens'?; did you mean max_new_tokens?"):
        f(max_tokens=4)
    with pytest.raises(TypeError, match="did you mean temperature?"):
        f(temprature=0.5)
    assert eng.num_waiting == 0  # refused before anything was queued


def test_keyword_suggestions_without_a_model():
    assert did_you_mean("max_tokens", ["max_new_tokens", "n"]) == "; did you mean max_new_tokens?"
    assert did_you_mean("num_return_sequences", ["max_new_tokens", "n"]) == "; did you mean n?"
    assert did_you_mean("top_pp", ["top_p", "top_k"]) == "; did you mean top_p?"
    assert did_you_mean("colour", ["top_p", "top_k"]) == ""


@pytest.mark.parametrize("name,suggested", [
    ("smollm2", "smollm2-135m-instruct-q4_1"),
    ("smollm2-135m-instruct-q4_0", "smollm2-135m-instruct-q4_1"),
    ("SmolLM2-135M-Instruct.Q4_1", "smollm2-135m-instruct-q4_1"),  # the file's stem
    ("qwen2.5-coder-1.5b-instruct-q4-k-m", "qwen2.5-coder-1.5b-instruct-q4_k_m"),
    ("gemma", "gemma-3-270m-q4_k_m"),
])
def test_a_close_model_name_is_suggested(name, suggested):
    assert close_model_names(name).startswith(f" (did you mean {suggested}")
    with pytest.raises(FileNotFoundError, match=f"did you mean {suggested}"):
        candle_gate.resolve(name)
    with pytest.raises(ValueError, match=f"did you mean {suggested}"):
        candle_gate.fetch(name)


def test_no_suggestion_for_a_name_nothing_is_close_to():
    assert close_model_names("gpt-4") == ""


def test_the_command_line_suggests_too():
    r = subprocess.run([sys.executable, "-m", "candle_gate", "generate", "Hi", "--model", "smollm2"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "did you mean smollm2-135m-instruct-q4_1?" in r.stderr, r.stderr
