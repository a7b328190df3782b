"""Replicas on Ray Serve (``candle-gate serve --replicas 2``, ``candle_gate.ray``): a local Ray
cluster on loopback, started and stopped by the module's fixture (a cluster of its own, though Ray's
temp dir names another, gone). Every request gets the same
completion and logprobs whichever replica serves it, and what an in-process engine gives (each
response verified by ``candle_gate.verify``); a session sticks to its replica; the endpoint probe
finds one completion per prompt at every load; a replica killed mid-stream cuts only its own
requests and comes back."""
import concurrent.futures as cf
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import pytest

pytest.importorskip("ray")
httpx = pytest.importorskip("httpx")

import candle_gate  # noqa: E402
from candle_gate.probe import endpoint as ep  # noqa: E402

from ..engine.test_gate import CHATS  # noqa: E402
from ..live_server import HANG_S, Server, free_port, wait_until  # noqa: E402

pytestmark = pytest.mark.model  # loads a model, or serves one

REPLICA = "x-candle-gate-replica"
M = candle_gate.DEFAULT_MODEL


class RayServer(Server):
    """``candle-gate serve --replicas 2`` on loopback; stopped with SIGTERM (the command drains its
    replicas and stops the Ray cluster it started), then ``ray stop --force`` for anything left."""

    def stop(self):
        self.terminate()
        ray_cli = shutil.which("ray", path=os.path.dirname(sys.executable)) or shutil.which("ray")
        if ray_cli:
            subprocess.run([ray_cli, "stop", "--force"], capture_output=True, timeout=120)


def stale_ray_tmpdir() -> str:
    """A Ray temp dir (``RAY_TMPDIR``, short: Ray's socket paths must fit in 107 bytes) whose
    ``ray_current_cluster`` names a cluster that is gone, as a ``ray.cluster_utils.Cluster`` killed
    before its shutdown leaves it. ``ray.init()`` with no address joins the cluster that file
    names: ``serve --replicas`` without ``--ray-address`` must start its own instead."""
    root = tempfile.mkdtemp(prefix="cg-ray-", dir="/tmp")
    os.makedirs(os.path.join(root, "ray"))
    with open(os.path.join(root, "ray", "ray_current_cluster"), "w") as f:
        f.write(f"127.0.0.1:{free_port()}")
    return root


@pytest.fixture(scope="module")
def fleet():
    ray_tmpdir = stale_ray_tmpdir()
    s = RayServer("--replicas", "2", "--threads", "1", "--num-cpus-per-replica", "1", env={"RAY_TMPDIR": ray_tmpdir})
    try:
        yield s
    finally:
        s.stop()
        shutil.rmtree(ray_tmpdir, ignore_errors=True)
        assert "shutting down (draining the replicas)" in "".join(s.log)


def post(fleet, path, body, session=None, timeout=HANG_S):
    headers = {"x-session-id": session} if session else {}
    r = httpx.post(fleet.url + path, json=body, headers=headers, timeout=timeout)
    assert r.status_code == 200, r.text
    return r.headers[REPLICA], r.json()


def replica_for(fleet, session):
    return post(fleet, "/v1/completions", {"prompt": "Hi", "max_tokens": 1}, session)[0]


def chat_body(chat, seeded):
    body = {"messages": chat, "max_tokens": 24, "logprobs": True, "top_logprobs": 2, "return_token_ids": True}
    body.update({"temperature": 0.8, "top_p": 0.95, "seed": 7} if seeded else {"temperature": 0})
    return body


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_every_request_gets_the_same_answer_from_either_replica(fleet, seeded):
    chats = CHATS[:6]
    bodies = [chat_body(c, seeded) for c in chats]
    seen = {i: [] for i in range(len(chats))}
    replicas = set()
    for _ in range(3):  # bursts: every chat at once, three times over
        with cf.ThreadPoolExecutor(len(chats)) as pool:
            for i, (rep, resp) in enumerate(pool.map(lambda b: post(fleet, "/v1/chat/completions", b), bodies)):
                replicas.add(rep)
                seen[i].append((rep, resp))
    assert len(replicas) == 2, replicas  # both replicas answered
    fps = set()
    for i, runs in seen.items():
        choices = [json.dumps({k: r["choices"][0][k] for k in ("message", "logprobs", "token_ids", "fingerprint")})
                   for _, r in runs]
        assert len(set(choices)) == 1, f"chat {i}: {len(set(choices))} distinct answers from {[x for x, _ in runs]}"
        fps |= {r["system_fingerprint"] for _, r in runs}
        # The same as an in-process engine on the same model file, bit for bit.
        v = candle_gate.verify({"request": bodies[i], "response": runs[0][1]})
        assert v.match, v.summary()
    assert len(fps) == 1  # every replica reports the same stack


def test_a_session_sticks_to_its_replica_and_hits_its_prefix_cache(fleet):
    # Replica ids are random per run: 32 sessions all hashing to one of two replicas has
    # probability 2^-31 (with 8 it was 1 in 128, a flaky test).
    sessions = [f"conversation-{i}" for i in range(32)]
    picked = {s: {replica_for(fleet, s) for _ in range(3)} for s in sessions}
    assert all(len(v) == 1 for v in picked.values()), picked
    assert len({next(iter(v)) for v in picked.values()}) == 2, "rendezvous hashing put every session on one replica"
    turn1 = [{"role": "user", "content": "Tell me about the history of the printing press in Europe."}]
    rep1, r1 = post(fleet, "/v1/chat/completions", {"messages": turn1, "max_tokens": 40, "temperature": 0}, "chat-A")
    turn2 = turn1 + [r1["choices"][0]["message"], {"role": "user", "content": "And in Asia?"}]
    rep2, r2 = post(fleet, "/v1/chat/completions", {"messages": turn2, "max_tokens": 8, "temperature": 0}, "chat-A")
    assert rep1 == rep2
    assert r2["usage"]["prompt_tokens_details"]["cached_tokens"] >= 32


def test_metrics_name_the_replica(fleet):
    r = httpx.get(fleet.url + "/metrics", timeout=60)
    assert f'candle_gate:replica_info{{replica="{r.headers[REPLICA]}"}} 1.0' in r.text


def test_replicas_and_proxy_run_with_the_serve_settings(fleet, monkeypatch):
    """``candle_gate.ray.SERVE_ENV`` reaches the replica, the proxy and the controller processes
    (read from their environment: the replica names its pid), and the environment overrides it."""
    from candle_gate.ray import SERVE_ENV, serve_env

    def environ(pid):
        with open(f"/proc/{pid}/environ", "rb") as f:
            return dict(kv.split("=", 1) for kv in f.read().decode(errors="replace").split("\0") if "=" in kv)

    def cmdline(pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                return f.read()
        except OSError:  # a process that ended meanwhile
            return b""

    def actors(name):
        return [p for p in os.listdir("/proc") if p.isdigit() and name in cmdline(p)]

    pid = httpx.get(fleet.url + "/health", timeout=60).headers[REPLICA].rsplit("/", 1)[1]

    proxies, controllers = actors(b"ProxyActor"), actors(b"ServeController")
    assert proxies and controllers
    for p in [pid, *proxies, *controllers]:
        env = environ(p)
        assert {k: env.get(k) for k in SERVE_ENV} == SERVE_ENV, p
    monkeypatch.setenv("RAY_SERVE_USE_GRPC_BY_DEFAULT", "0")
    assert serve_env() == {**SERVE_ENV, "RAY_SERVE_USE_GRPC_BY_DEFAULT": "0"}


def test_endpoint_probe_finds_one_completion_per_prompt(fleet):
    prompts = ["The capital of France is", [{"role": "user", "content": "Name three colors."}]]
    r = ep.probe_endpoint(fleet.url + "/v1", M, prompts, repeats=2, concurrency=[1, 4], max_tokens=12,
                          temperature=0, seed=0)
    assert r["errors"] == 0 and r["all_identical"] is True and len(r["fingerprints"]) == 1
    assert all(e["distinct"] == 1 for e in r["prompts"])


def test_a_replica_killed_mid_stream_cuts_only_its_own_requests(fleet):
    """Runs last: it kills a replica. Its stream ends without [DONE] (Ray's proxy closes the
    connection: nothing is retried once tokens went out); the other replica's requests in the
    meantime succeed with their usual answer; Ray starts a new replica and both answer again."""
    doomed = "stream-session"
    victim = replica_for(fleet, doomed)
    other = next(s for s in (f"other-{i}" for i in range(64)) if replica_for(fleet, s) != victim)
    body = {"prompt": "Once upon a time", "max_tokens": 200, "temperature": 0}
    _, expected = post(fleet, "/v1/completions", body, other)
    outcome = {}

    def beside():
        time.sleep(0.3)
        outcome["beside"] = [post(fleet, "/v1/completions", body, other) for _ in range(3)]

    t = threading.Thread(target=beside)
    t.start()
    chunks, done = 0, False
    try:
        with httpx.stream("POST", fleet.url + "/v1/completions", json={**body, "stream": True},
                          headers={"x-session-id": doomed}, timeout=HANG_S) as r:
            assert r.headers[REPLICA] == victim
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data:"):
                    chunks += 1
                    if chunks == 3:
                        os.kill(int(victim.rsplit("/", 1)[1]), signal.SIGKILL)
    except httpx.HTTPError as e:
        outcome["stream_error"] = type(e).__name__
    t.join()
    assert not done and chunks >= 3, (chunks, outcome)
    for rep, resp in outcome["beside"]:
        assert rep != victim and resp["choices"][0]["text"] == expected["choices"][0]["text"]
    wait_until(lambda: replica_for(fleet, doomed) != victim, "the app answering the dead replica's session")
    wait_until(lambda: len({replica_for(fleet, s) for s in (f"s{i}" for i in range(32))}) == 2,
               "Ray replacing the killed replica")
