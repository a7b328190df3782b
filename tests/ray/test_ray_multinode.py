"""A fleet across nodes (issue 53): a Ray cluster of several nodes on one host
(``ray.cluster_utils.Cluster``: a head with no CPUs, for Serve's controller and proxy, and three
worker nodes of one CPU each), and ``candle-gate serve --replicas 3 --ray-address`` over it: one
replica per node. Node C's model cache holds another file under the model's name (one byte of
its weights changed: another model file, another ``system_fingerprint``): its replica is refused,
and the two others answer every request alike, greedy and seeded, bit for bit, and pass
``verify``. Then node A is killed in the middle of a stream: that stream is cut, node B's
requests meanwhile get their usual answers."""
import concurrent.futures as cf
import json
import threading
import time

import pytest

pytest.importorskip("ray")
httpx = pytest.importorskip("httpx")

import candle_gate  # noqa: E402

from ..engine.test_gate import CHATS  # noqa: E402
from ..live_server import HANG_S, Server, wait_until  # noqa: E402
from .test_ray import REPLICA, chat_body, post  # noqa: E402

pytestmark = pytest.mark.model  # loads a model, or serves one

M = candle_gate.DEFAULT_MODEL
MB = 1 << 20


class FleetServer(Server):
    """``candle-gate serve --replicas 3 --ray-address ADDR``; stopped with SIGTERM."""

    def stop(self):
        self.terminate()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from ray.cluster_utils import Cluster
    odd = tmp_path_factory.mktemp("odd-cache")
    src = candle_gate.resolve(M)
    data = bytearray(src.read_bytes())
    data[-1] ^= 1  # the last byte of the last tensor: the same model, nearly; another file
    (odd / src.name).write_bytes(bytes(data))
    small = {"object_store_memory": 80 * MB}
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False, **small})
    nodes = {"a": c.add_node(num_cpus=1, **small), "b": c.add_node(num_cpus=1, **small),
             "c": c.add_node(num_cpus=1, env_vars={"CANDLE_GATE_CACHE": str(odd)}, **small)}
    c.wait_for_nodes()
    try:
        yield c, nodes
    finally:
        c.shutdown()


@pytest.fixture(scope="module")
def fleet(cluster):
    c, _ = cluster
    # The proxy on the head alone: with every node on one host, Ray's default (a proxy on every
    # node, all on the one port) let a connection land on node A's proxy, and killing node A cut
    # requests that were served by node B's replica.
    s = FleetServer("--replicas", "3", "--ray-address", c.address, "--threads", "1", "--num-cpus-per-replica", "1",
                    "--proxy-location", "HeadOnly")
    try:
        yield s
    finally:
        s.stop()


def node_of(replica):
    """The node id prefix a replica names (``id@host:node/pid``)."""
    return replica.rsplit("/", 1)[0].rsplit(":", 1)[1]


def test_replicas_on_other_nodes_give_the_same_answers_and_verify(cluster, fleet):
    _, nodes = cluster
    node_ids = {k: n.node_id[:8] for k, n in nodes.items()}
    answers = {}
    replicas = set()
    for seeded in (False, True):
        bodies = [chat_body(c, seeded) for c in CHATS[:4]]
        for i, body in enumerate(bodies):
            runs = []
            for s in (f"s{j}" for j in range(12)):  # sessions spread over the replicas
                runs.append(post(fleet, "/v1/chat/completions", body, session=s))
                if len({rep for rep, _ in runs}) == 2 and len(runs) >= 4:
                    break
            replicas |= {rep for rep, _ in runs}
            distinct = {json.dumps({k: r["choices"][0][k] for k in ("message", "logprobs", "token_ids", "fingerprint")})
                        for _, r in runs}
            assert len(distinct) == 1, f"chat {i} (seeded {seeded}): {len(distinct)} answers"
            answers[(seeded, i)] = runs[0][1]
            v = candle_gate.verify({"request": body, "response": runs[0][1]})
            assert v.match, v.summary()
    on = {node_of(r) for r in replicas}
    assert on == {node_ids["a"], node_ids["b"]}, (on, node_ids)  # two nodes, never node C's file
    assert len({a["system_fingerprint"] for a in answers.values()}) == 1
    # Node C's replica was refused for its fingerprint, and `serve` says why.
    wait_until(lambda: "is not its fleet's" in "".join(fleet.log), "serve reporting the refused replica")
    assert "FleetMismatch" in "".join(fleet.log)


def test_a_node_killed_mid_stream_cuts_only_its_own_requests(cluster, fleet):
    """Runs last: it removes node A."""
    c, nodes = cluster
    by_node = {}
    for s in (f"k{i}" for i in range(64)):
        rep = post(fleet, "/v1/completions", {"prompt": "Hi", "max_tokens": 1}, session=s)[0]
        by_node.setdefault(node_of(rep), s)
        if len(by_node) == 2:
            break
    doomed, other = by_node[nodes["a"].node_id[:8]], by_node[nodes["b"].node_id[:8]]
    body = {"prompt": "Once upon a time", "max_tokens": 200, "temperature": 0}
    _, expected = post(fleet, "/v1/completions", body, session=other)
    outcome = {}

    def beside():
        time.sleep(0.3)
        try:
            with cf.ThreadPoolExecutor(2) as pool:
                outcome["beside"] = list(pool.map(lambda _: post(fleet, "/v1/completions", body, session=other),
                                                  range(2)))
        except Exception as e:  # reported below, with the fleet's log: a request beside was cut
            outcome["beside_error"] = repr(e)

    t = threading.Thread(target=beside)
    t.start()
    chunks, done = 0, False
    try:
        with httpx.stream("POST", fleet.url + "/v1/completions", json={**body, "stream": True},
                          headers={"x-session-id": doomed}, timeout=HANG_S) as r:
            assert node_of(r.headers[REPLICA]) == nodes["a"].node_id[:8]
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data:"):
                    chunks += 1
                    if chunks == 3:
                        c.remove_node(nodes["a"], allow_graceful=False)
    except httpx.HTTPError as e:
        outcome["stream_error"] = type(e).__name__
    t.join()
    assert not done and chunks >= 3, (chunks, outcome)
    assert "beside" in outcome, (outcome, "".join(fleet.log)[-4000:])
    for rep, resp in outcome["beside"]:
        assert node_of(rep) == nodes["b"].node_id[:8]
        assert resp["choices"][0]["text"] == expected["choices"][0]["text"]
    # Node C's replica is still refused, so the fleet never came up whole, and Ray calls it
    # DEPLOY_FAILED once it finds node A's replica dead: `serve` goes on serving on node B's.
    def said():
        return "".join(line for line in fleet.log if line.startswith("candle-gate serve"))[-4000:]

    def serve_said(text):
        assert fleet.proc.poll() is None, f"serve exited ({fleet.proc.returncode}); it said: {said()}"
        return text in said()

    wait_until(lambda: serve_said("serving on 1 replica(s)"), "serve going on with node B's replica")
    # the dead node's sessions go to the live replica; while Serve takes the lost node's replica
    # out of its routes its proxy can answer 404 (no route) for a moment, so a poll that is not
    # answered counts as "not yet", and only a fleet that never answers from B fails
    statuses = []

    def answered_from_b():
        serve_said("")
        try:
            r = httpx.post(fleet.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 1},
                           headers={"x-session-id": doomed}, timeout=HANG_S)
        except httpx.HTTPError as e:
            statuses.append(type(e).__name__)
            return False
        statuses.append(r.status_code)
        return r.status_code == 200 and node_of(r.headers[REPLICA]) == nodes["b"].node_id[:8]

    try:
        wait_until(answered_from_b, "the fleet answering the dead node's session")
    except AssertionError as e:
        raise AssertionError(f"{e}; answers: {sorted(set(map(str, statuses)))}; serve said: {said()}") from None


def test_the_fleet_fingerprint_is_told_where_it_can_be():
    """Without a model: a known model's, in a mode whose host signature is the build target's,
    gate off; else None (the first replica to load sets it)."""
    from candle_gate import _native
    from candle_gate.models import KNOWN_MODELS
    from candle_gate.ray import fleet_fingerprint
    from candle_gate.server import Settings
    sha = KNOWN_MODELS[M].sha256
    assert fleet_fingerprint(Settings()) == _native.system_fingerprint(sha, "invariant", "f16")
    assert fleet_fingerprint(Settings(mode="split_k_f16", kv_dtype="f32")) == \
        _native.system_fingerprint(sha, "split_k_f16", "f32")
    assert fleet_fingerprint(Settings(gate="gated")) is None
    assert fleet_fingerprint(Settings(mode="native")) is None  # Candle's run-time dispatch: the host's
    assert fleet_fingerprint(Settings(model="/nowhere/model.gguf")) is None
