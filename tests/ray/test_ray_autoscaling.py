"""``candle-gate serve --autoscaling-config JSON``: Ray Serve's autoscaling passed through. Bad
configs (and model names) are refused before any cluster starts; a real one starts at one
replica and Ray adds the second under load (a local Ray cluster on loopback, started and stopped
here, after ``test_ray.py``'s)."""
import concurrent.futures as cf
import json
import subprocess
import sys
import time

import pytest

pytest.importorskip("ray")
httpx = pytest.importorskip("httpx")

from .test_ray import REPLICA, RayServer  # noqa: E402

pytestmark = pytest.mark.model  # loads a model, or serves one


def serve_exits(*args):
    return subprocess.run([sys.executable, "-m", "candle_gate", "serve", *args], capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("config, message", [
    ("{min_replicas: 1}", "not JSON"),
    ("[1, 2]", "expected a JSON object"),
    ('{"min_replicas": 1, "max_replica": 2}', "unknown key(s) max_replica"),
    ('{"min_replicas": 3, "max_replicas": 2}', "must be greater than or equal to min_replicas"),
])
def test_a_bad_autoscaling_config_is_refused_before_ray_starts(config, message):
    r = serve_exits("--autoscaling-config", config)
    assert r.returncode == 2
    assert "--autoscaling-config: " in r.stderr and message in r.stderr, r.stderr


@pytest.mark.parametrize("args", [[], ["--replicas", "1"]])
@pytest.mark.parametrize("flag", ["--model", "--draft-model"])
def test_a_model_that_is_neither_known_nor_a_file_is_refused_before_serving(args, flag):
    """Not a server that answers 503 on /health, nor a Ray cluster whose replicas fail to deploy."""
    r = serve_exits(*args, flag, "no-such-model.gguf", "--port", "1")
    assert r.returncode == 2, r.stderr
    assert f"{flag}: 'no-such-model.gguf' is neither a file nor a known model name" in r.stderr, r.stderr
    assert "Ray" not in r.stdout + r.stderr


def test_replicas_and_autoscaling_are_exclusive():
    r = serve_exits("--replicas", "2", "--autoscaling-config", '{"max_replicas": 2}')
    assert r.returncode == 2 and "not both" in r.stderr, r.stderr


def test_autoscaling_starts_at_its_minimum_and_scales_up_under_load():
    config = {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 1, "upscale_delay_s": 0,
              "metrics_interval_s": 0.5, "look_back_period_s": 1}
    s = RayServer("--autoscaling-config", json.dumps(config), "--threads", "1", "--num-cpus-per-replica", "1",
                  "--routing", "pow2")
    try:
        assert "deploying 1 to 2 (autoscaling) replica(s)" in "".join(s.log)
        first = {httpx.get(s.url + "/health", timeout=60).headers[REPLICA] for _ in range(4)}
        assert len(first) == 1, first  # one replica to begin with
        seen = set(first)
        body = {"prompt": "Once upon a time", "max_tokens": 48, "temperature": 0}
        texts = set()
        deadline = time.monotonic() + 120
        with cf.ThreadPoolExecutor(6) as pool:
            while len(seen) < 2 and time.monotonic() < deadline:
                for r in pool.map(lambda _: httpx.post(s.url + "/v1/completions", json=body, timeout=300), range(6)):
                    assert r.status_code == 200, r.text
                    seen.add(r.headers[REPLICA])
                    texts.add(r.json()["choices"][0]["text"])
        assert len(seen) == 2, f"Ray added no replica under load: {seen}"
        assert len(texts) == 1, texts  # and both answer alike
    finally:
        s.stop()
    assert "shutting down (draining the replicas)" in "".join(s.log)
