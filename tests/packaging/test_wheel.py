"""The wheel as a user gets it: ``maturin build``, installed into a fresh venv with no source tree,
then ``generate`` and ``serve`` run from an empty directory. Gated mode without ``--profile``
must find the calibration shipped inside the wheel, and the wheel's tokens must be the ones the
work tree's build gives."""
import json
import os
import shutil
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

import candle_gate
from ..live_server import free_port, wait_until
from ..paths import ROOT

pytestmark = pytest.mark.model  # loads a model, or serves one

PROMPT = "The capital of France is"


def _run(cmd, **kw):
    r = subprocess.run(cmd, capture_output=True, text=True, **kw)
    assert r.returncode == 0, f"{cmd} exited {r.returncode}:\n{r.stdout}\n{r.stderr}"
    return r


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    """A venv holding only the wheel (with its `serve` extra) and its dependencies from PyPI."""
    tmp = tmp_path_factory.mktemp("wheel")
    maturin = shutil.which("maturin") or pytest.fail("maturin is not installed (it is in the `test` extra)")
    _run([maturin, "build", "--release", "--out", str(tmp / "dist")], cwd=ROOT)
    [whl] = (tmp / "dist").glob("candle_gate-*.whl")
    env_dir = tmp / "venv"
    _run([sys.executable, "-m", "venv", str(env_dir)])
    py = env_dir / "bin" / "python"
    _run([str(py), "-m", "pip", "install", "-q", f"{whl}[serve]"])
    work = tmp / "empty"  # no source tree on the path: the installed package only
    work.mkdir()
    # An empty model cache keeps the user's own profile out; the model is given by path.
    env = {**os.environ, "CANDLE_GATE_CACHE": str(tmp / "cache"), "PYTHONPATH": ""}
    where = _run([str(py), "-c", "import candle_gate; print(candle_gate.__file__)"], cwd=work, env=env).stdout
    assert str(env_dir) in where and str(ROOT) not in where
    return {"bin": env_dir / "bin", "cwd": work, "env": env}


def _reference(mode, gate):
    model = candle_gate.Model.load(layout=candle_gate.layout_for(mode))
    [r] = candle_gate.Engine(model, mode=mode, gate=gate).generate([PROMPT], max_new_tokens=8)
    return r


def test_generate_from_the_wheel_uses_the_packaged_gate_profile(venv):
    path = candle_gate.resolve(candle_gate.DEFAULT_MODEL)
    r = _run([str(venv["bin"] / "candle-gate"), "generate", PROMPT, "--model", str(path), "--max-new-tokens", "8",
              "--mode", "split_k_f16", "--gate", "gated", "--json"], cwd=venv["cwd"], env=venv["env"])
    assert "site-packages/candle_gate/profiles/cpu.json (SmolLM2-135M-Instruct.Q4_1.gguf/split_k_f16)" in r.stderr
    out = json.loads(r.stdout)
    ref = _reference("split_k_f16", "gated")
    assert out["token_ids"] == ref.token_ids.tolist() and out["fingerprint"] == ref.fingerprint


def test_serve_from_the_wheel(venv):
    path = candle_gate.resolve(candle_gate.DEFAULT_MODEL)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([str(venv["bin"] / "candle-gate"), "serve", "--model", str(path), "--port", str(port)],
                            cwd=venv["cwd"], env=venv["env"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        def healthy() -> bool:
            assert proc.poll() is None, proc.stdout.read()
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as h:
                    return h.status == 200
            except (urllib.error.URLError, OSError):
                return False

        wait_until(healthy, "the wheel's server to answer /health")
        body = json.dumps({"model": Path(path).stem, "prompt": PROMPT, "max_tokens": 8,
                           "temperature": 0}).encode()
        req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as resp:
            out = json.loads(resp.read())
        assert out["choices"][0]["text"] == _reference("invariant", "off").text
        assert out["system_fingerprint"].startswith("fp_")
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=60)
    assert rc == 0
