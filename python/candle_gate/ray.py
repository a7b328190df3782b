"""Replicas on Ray Serve: ``candle-gate serve --replicas N [--ray-address ADDR]`` (docs/RAY.md).

Each replica is the same FastAPI app as ``candle-gate serve`` (``server.app.create_app``), served
through ``serve.ingress``, with one engine of its own. A replica names itself on every response
(``X-Candle-Gate-Replica``) and in ``/metrics`` (``candle_gate:replica_info``); its lifespan
startup returns once the model is loaded, so Ray routes to it only when it can answer, and its
shutdown drains the engine (``graceful_shutdown_timeout_s`` is ``--drain-timeout``).

Routing: :class:`SessionAffinityRouter` sends every request that carries Ray Serve's session
header (``x-session-id``) to the replica that rendezvous hashing picks for that session among
the live replicas (the next one if it is full), so a conversation's next turn reaches the replica
that holds its prefix cache; requests without the header are routed as Ray's default router
does (power of two choices). ``--routing pow2`` uses Ray's default for everything.

Ray Serve's settings: :data:`SERVE_ENV` (Ray's own ``RAY_SERVE_THROUGHPUT_OPTIMIZED`` set, less
direct ingress), unless the environment sets them otherwise.

Requires the ``ray`` extra: ``pip install 'candle-gate[ray]'``.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import signal
import socket
import sys
import threading
import uuid
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from ray import serve
from ray.serve.request_router import PendingRequest, RunningReplica
from ray.serve._private.request_router import PowerOfTwoChoicesRequestRouter

from .engine import ENGINE_DEFAULTS
from .server.app import REPLICA_HEADER
from .server.settings import Settings

#: the Serve application's and deployment's name
APP_NAME = "candle-gate"
#: the request header that keys session affinity: Ray Serve's own (``RAY_SERVE_SESSION_ID_HEADER_KEY``)
SESSION_HEADER = "x-session-id"
ROUTINGS = ("session", "pow2")
#: Ray Serve's settings for a streaming server on few cores: what Ray's own
#: ``RAY_SERVE_THROUGHPUT_OPTIMIZED=1`` sets, less direct ingress (which would bypass the proxy and
#: so the router). The proxy calls the replica over gRPC rather than through the object store,
#: the app runs on the replica's main event loop (no thread hop per message), the proxy's router
#: on the proxy's loop, and the request log is buffered: fewer wake-ups per streamed token, each
#: of which takes CPU from the engine's threads. On the 2-core host Ray kept 0.84x/0.89x of
#: ``candle-gate serve``'s throughput at 1/8 clients with these, 0.73x/0.81x without
#: (docs/BENCHMARKS.md). Beyond those, Serve's controller runs its control loop every 0.5 s
#: rather than 0.1 s: an idle app then took 7.3% of one core rather than 9.4%, CPU that a busy
#: replica's engine would otherwise lose; replica health, autoscaling and deployments are
#: reconciled up to 0.4 s later. A variable the environment sets wins.
SERVE_ENV = {
    "RAY_SERVE_USE_GRPC_BY_DEFAULT": "1",
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
    "RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE": "1000",
    "RAY_SERVE_LOG_TO_STDERR": "0",
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5",
}

#: a replica's ``stream_interval_ms`` unless set: a stream's events that arrive within 50 ms of
#: its last write go out as one message through the proxy (the first token at once). Each message
#: wakes the replica's loop, the proxy and the client's connection; on the 2-core host one client
#: streamed 0.89x of ``candle-gate serve``'s tok/s with it, 0.81x without (docs/BENCHMARKS.md).
#: Ray Serve LLM's ``stream_batching_interval_ms`` defaults to 50 ms too.
REPLICA_STREAM_INTERVAL_MS = 50

__all__ = ["APP_NAME", "FLEET_NAMESPACE", "FleetMismatch", "REPLICA_HEADER", "REPLICA_STREAM_INTERVAL_MS", "ROUTINGS",
           "SERVE_ENV", "SESSION_HEADER", "SessionAffinityRouter", "application", "fleet_fingerprint", "join_fleet",
           "serve_env", "serve_replicas"]


def serve_env() -> Dict[str, str]:
    """:data:`SERVE_ENV`, each value overridden by the environment's own."""
    return {k: os.environ.get(k, v) for k, v in SERVE_ENV.items()}


def _score(session: str, replica: RunningReplica) -> bytes:
    return hashlib.sha256(f"{session}\n{replica.replica_id.unique_id}".encode()).digest()


class SessionAffinityRouter(PowerOfTwoChoicesRequestRouter):
    """Rendezvous hashing on the session header, with bounded load: a session's replica changes
    only when that replica leaves (or another joins and outranks it for that session), and every
    router in the cluster picks the same one without sharing state; but when the session's
    replica has more than ``max_imbalance`` requests in flight beyond the least busy replica,
    this request goes to the least busy one (its history is prefilled there, this once). Without
    a session: Ray's power of two choices."""

    def initialize_state(self, max_imbalance: int = 4, **kwargs: Any) -> None:
        self._max_imbalance = max_imbalance

    async def _queue_lens(self, replicas: List[RunningReplica]) -> Dict[Any, int]:
        """Requests in flight per replica: Ray's cached counts, probed where there are none."""
        lens: Dict[Any, int] = {}
        missing = []
        for r in replicas:
            q = self._replica_queue_len_cache.get(r.replica_id) if self._use_replica_queue_len_cache else None
            if q is None:
                missing.append(r)
            else:
                lens[r.replica_id] = q
        if missing:
            for r, q in await self._probe_queue_lens(missing, 0):
                if q is not None:
                    lens[r.replica_id] = q
        return lens

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> List[List[RunningReplica]]:
        session = pending_request.metadata.session_id if pending_request is not None else ""
        if not session or not candidate_replicas:
            return await super().choose_replicas(candidate_replicas, pending_request)
        ranked = sorted(candidate_replicas, key=lambda r: _score(session, r), reverse=True)
        if len(ranked) > 1:
            lens = await self._queue_lens(ranked)
            home = lens.get(ranked[0].replica_id)
            if lens and home is not None and home - min(lens.values()) > getattr(self, "_max_imbalance", 4):
                ranked.sort(key=lambda r: lens.get(r.replica_id, 1 << 30))
        return [[r] for r in ranked]


#: Ray's internal key-value namespace where a fleet keeps its ``system_fingerprint``
FLEET_NAMESPACE = "candle-gate-fleet"


class FleetMismatch(RuntimeError):
    """A replica whose ``system_fingerprint`` is not its fleet's (another build, model file,
    mode, K/V dtype, gate or host class): it would answer differently, so it does not serve."""


def fleet_fingerprint(settings: Settings) -> Optional[str]:
    """The ``system_fingerprint`` every replica of a fleet over ``settings`` must report, where
    the deploying process can tell it without loading the model: a known model (the registry's
    SHA-256) or a file here, no profile, the gate off, and a mode whose host signature is the
    build target's alone (``host_signature(mode) == host_signature(DEFAULT_MODE)``: the same on
    every x86-64 host of this build). None otherwise: the first replica to load sets it."""
    from . import _native
    from .models import KNOWN_MODELS, _sha256

    if settings.gate != "off" or settings.profile is not None:
        return None
    if _native.host_signature(settings.mode) != _native.host_signature(_native.DEFAULT_MODE):
        return None
    if settings.model in KNOWN_MODELS:
        sha = KNOWN_MODELS[settings.model].sha256
    elif os.path.isfile(settings.model):
        sha = _sha256(Path(settings.model))
    else:
        return None
    return _native.system_fingerprint(sha, settings.mode, settings.kv_dtype or ENGINE_DEFAULTS["kv_dtype"])


def join_fleet(fleet: str, fingerprint: str) -> None:
    """Claims ``fleet``'s fingerprint for ``fingerprint`` (the first to claim, or the deploying
    process, sets it) and raises :class:`FleetMismatch` when it is another."""
    from ray.experimental import internal_kv
    internal_kv._internal_kv_put(fleet, fingerprint, overwrite=False, namespace=FLEET_NAMESPACE)
    got = internal_kv._internal_kv_get(fleet, namespace=FLEET_NAMESPACE)
    fleet_fp = got.decode() if isinstance(got, bytes) else got
    if fleet_fp != fingerprint:
        raise FleetMismatch(f"this replica's system_fingerprint {fingerprint} is not its fleet's {fleet_fp} (another "
                            f"build, model file, mode, K/V dtype, gate or host class): it would answer "
                            f"differently, so it does not serve")


@serve.ingress()
class CandleGateReplica:
    """One replica: the server app over its own engine, in a fleet whose replicas all report one
    ``system_fingerprint`` (``fleet``: the key of the fleet's, :func:`join_fleet`)."""

    def __init__(self, settings: Dict[str, Any], fleet: Optional[str] = None):
        self.settings = Settings(**settings)
        self.fleet = fleet
        self._server: Any = None

    async def __serve_build_asgi_app__(self) -> Any:
        """The app, its model loaded here rather than in its lifespan: a failure to load, or a
        fingerprint that is not the fleet's (:class:`FleetMismatch`), fails the replica's start
        with its reason, which Ray shows in the deployment's status (an ASGI lifespan's failure
        reaches it only as "ASGI lifespan startup failed")."""
        import asyncio
        import ray
        from .server.app import create_app
        from .server.state import ServerState
        ctx = serve.get_replica_context()
        node = ray.get_runtime_context().get_node_id()[:8]
        name = f"{ctx.replica_id.unique_id}@{socket.gethostname()}:{node}/{os.getpid()}"
        app = create_app(dataclasses.replace(self.settings, replica=name, ready_before_serving=True),
                         load=lambda st, loop: None)  # (loaded below: the lifespan finds it ready)
        st = app.state.server
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, ServerState.load, st, loop)
        if st.load_error is not None:
            raise RuntimeError(f"could not load the model: {st.load_error}")
        if self.fleet is not None:
            try:
                join_fleet(self.fleet, st.system_fingerprint)
            except FleetMismatch:
                st.worker.shutdown()
                raise
        self._server = app
        return app

    def check_health(self) -> None:
        """Ray's health check: failed when the engine thread has died, or the replica's stack is
        not its fleet's (Ray then replaces the replica)."""
        st = self._server.state.server if self._server is not None else None
        if st is not None and st.worker is not None and not st.worker.thread.is_alive():
            raise RuntimeError("the engine thread has stopped")
        if st is not None and st.ready and self.fleet is not None:
            join_fleet(self.fleet, st.system_fingerprint)


def application(settings: Settings, num_replicas: Optional[int] = 1, *, num_cpus: float = 1.0,
                autoscaling_config: Optional[Dict[str, Any]] = None, routing: str = "session",
                max_imbalance: int = 4, fleet: Optional[str] = None) -> Any:
    """The Serve application: ``num_replicas`` (or Ray's ``autoscaling_config``) replicas of the
    server app built from ``settings``, ``num_cpus`` each, routed by ``routing`` (``session``:
    :class:`SessionAffinityRouter` with ``max_imbalance``); with ``fleet`` (a key of
    :func:`join_fleet`), a replica whose ``system_fingerprint`` is not the fleet's is refused."""
    from ray.serve.config import RequestRouterConfig
    if routing not in ROUTINGS:
        raise ValueError(f"routing must be one of {', '.join(ROUTINGS)}, got {routing!r}")
    options: Dict[str, Any] = dict(
        # The replica reads its Ray Serve settings at start: carried here for a cluster that was
        # started elsewhere (`--ray-address`); the proxy's are the cluster's environment.
        name=APP_NAME, ray_actor_options={"num_cpus": num_cpus, "runtime_env": {"env_vars": serve_env()}},
        graceful_shutdown_timeout_s=settings.drain_timeout,
        # Each replica batches on its own: let it take what its engine admits and queue the rest.
        max_ongoing_requests=max(8, (settings.max_num_seqs or ENGINE_DEFAULTS["max_num_seqs"]) + settings.max_queue))
    if autoscaling_config is not None:
        options["autoscaling_config"] = autoscaling_config
    else:
        options["num_replicas"] = num_replicas
    if routing == "session":
        options["request_router_config"] = RequestRouterConfig(
            request_router_class=SessionAffinityRouter, request_router_kwargs={"max_imbalance": max_imbalance})
    if settings.stream_interval_ms is None:
        settings = dataclasses.replace(settings, stream_interval_ms=REPLICA_STREAM_INTERVAL_MS)
    fields = {f.name: getattr(settings, f.name) for f in dataclasses.fields(settings)}
    return serve.deployment(CandleGateReplica).options(**options).bind(fields, fleet)


def parse_autoscaling_config(text: str) -> Dict[str, Any]:
    """``--autoscaling-config``'s JSON as Ray Serve's ``autoscaling_config``, checked by Ray's own
    model; ``ValueError`` naming what is wrong."""
    import json
    from ray.serve.config import AutoscalingConfig
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"expected a JSON object (min_replicas, max_replicas, ...), got {text!r}")
    known = set(getattr(AutoscalingConfig, "model_fields", None) or AutoscalingConfig.__fields__)
    unknown = sorted(set(config) - known)
    if unknown:
        raise ValueError(f"unknown key(s) {', '.join(unknown)}; Ray Serve's are {', '.join(sorted(known))}")
    try:
        AutoscalingConfig(**config)
    except Exception as e:  # pydantic's ValidationError, or a TypeError for a key of another type
        raise ValueError(" ".join(str(e).split())) from None
    return config


def serve_replicas(settings: Settings, replicas: Optional[int], ray_address: Optional[str] = None,
                   num_cpus: float = 1.0, routing: str = "session",
                   autoscaling_config: Optional[Dict[str, Any]] = None, proxy_location: str = "EveryNode") -> int:
    """``candle-gate serve --replicas N`` (or ``--autoscaling-config``, Ray Serve's autoscaling
    between its ``min_replicas`` and ``max_replicas``): starts (or joins, ``ray_address``) a Ray
    cluster, deploys the app on ``settings.host:settings.port`` and serves until SIGTERM or
    Ctrl-C, then tears the deployment down (draining each replica) and leaves the cluster; 0 once
    done. ``proxy_location``: Ray Serve's, where its HTTP proxies run (``EveryNode``, ``HeadOnly``)."""
    import ray
    # Ray's processes (controller, proxy, replicas) inherit these from the cluster this starts.
    os.environ.update(serve_env())
    if ray_address:
        ray.init(address=ray_address, namespace="serve", log_to_driver=False)
    else:
        # "local", never None: given none, Ray joins RAY_ADDRESS's cluster or the one its temp dir
        # last recorded (ray_current_cluster, left behind by a cluster killed before its
        # shutdown), and would hang on one that is gone or serve on one that is not ours.
        ray.init(address="local", include_dashboard=False, namespace="serve", log_to_driver=False)
    stop = threading.Event()
    failed = 0
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(proxy_location=proxy_location, http_options={"host": settings.host, "port": settings.port})
        count = (f"{replicas}" if autoscaling_config is None else
                 f"{autoscaling_config.get('min_replicas', 1)} to {autoscaling_config.get('max_replicas', 1)} "
                 f"(autoscaling)")
        print(f"candle-gate serve: deploying {count} replica(s) of {settings.model} on Ray "
              f"({ray.get_runtime_context().gcs_address}), routing {routing}", flush=True)
        # One fleet, one answer: the fingerprint every replica must report, set here where it
        # can be told without the model (else by the first replica to load).
        from ray.experimental import internal_kv
        fleet = f"{APP_NAME}-{uuid.uuid4().hex}"
        expected = fleet_fingerprint(settings)
        if expected is not None:
            internal_kv._internal_kv_put(fleet, expected, namespace=FLEET_NAMESPACE)
        app = application(settings, replicas, num_cpus=num_cpus, routing=routing,
                          autoscaling_config=autoscaling_config, fleet=fleet)
        # serve.run waits until every replica runs: in a thread, so that a replica refused (not
        # the fleet's fingerprint) or failing to start is reported while the others serve, and a
        # signal is acted on meanwhile.
        deployed: List[Optional[BaseException]] = []

        def deploy() -> None:
            try:
                serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
                deployed.append(None)
            except Exception as e:  # DEPLOY_FAILED: no replica could start
                deployed.append(e)

        threading.Thread(target=deploy, name="candle-gate-deploy", daemon=True).start()
        said: Dict[str, str] = {}
        ready = partial = False
        while not stop.is_set():
            if deployed and not ready:
                if deployed[0] is None:
                    ready = True
                    print(f"candle-gate serve: {count} replica(s) ready at http://{settings.host}:{settings.port}/v1",
                          flush=True)
                else:
                    # serve.run gives up when the application is DEPLOY_FAILED, which Ray also says of
                    # a fleet still coming up that loses a running replica (a node gone) while
                    # another is refused: Ray goes on replacing replicas, and the running ones
                    # serve. Only a fleet with no replica running or starting has failed.
                    replicas = _replica_counts()
                    if replicas is not None and not any(replicas):
                        print(f"candle-gate serve: error: {deployed[0]}", file=sys.stderr, flush=True)
                        failed = 1
                        break
                    if replicas is not None and replicas[0] and not partial:
                        partial = True
                        print(f"candle-gate serve: serving on {replicas[0]} replica(s) at "
                              f"http://{settings.host}:{settings.port}/v1 while Ray replaces the others",
                              flush=True)
            _say_deployment_status(said)
            stop.wait(2.0)
        if not failed:
            print("candle-gate serve: shutting down (draining the replicas)", flush=True)
        serve.delete(APP_NAME)
        serve.shutdown()
        internal_kv._internal_kv_del(fleet, namespace=FLEET_NAMESPACE)
    finally:
        ray.shutdown()
    return failed


def _deployments() -> Optional[Dict[str, Any]]:
    """The application's deployments' statuses by name (none before it is deployed), or None when
    the controller does not answer (busy or going away: asked again next time)."""
    try:
        app = serve.status().applications.get(APP_NAME)
    except Exception:
        return None
    return dict(app.deployments) if app is not None else {}


def _replica_counts() -> Optional[Tuple[int, int]]:
    """The application's replicas (running; starting, updating or recovering), or None when the
    controller does not answer."""
    deployments = _deployments()
    if deployments is None:
        return None
    running = starting = 0
    for d in deployments.values():
        running += d.replica_states.get("RUNNING", 0)
        starting += sum(d.replica_states.get(s, 0) for s in ("STARTING", "UPDATING", "RECOVERING"))
    return running, starting


def _say_deployment_status(said: Dict[str, str]) -> None:
    """Prints each deployment's status message when it changes (a replica failing to start, with
    the reason: a fleet mismatch, a model that cannot load)."""
    for name, d in (_deployments() or {}).items():
        lines = [x.strip() for x in (d.message or "").splitlines() if x.strip()]
        # (a start failure's message is a traceback: its first line and the exception, its last)
        line = f"{d.status}: {lines[0]}{' ... ' + lines[-1] if len(lines) > 1 else ''}" if lines else str(d.status)
        if said.get(name) != line:
            said[name] = line
            if lines:
                print(f"candle-gate serve: deployment {name}: {line}", flush=True)
