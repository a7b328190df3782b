"""``GET /metrics``: Prometheus metrics with ``prometheus_client``, one registry per app.

Two kinds of series (docs/SERVER.md lists them all, every one labelled ``model_name``):

- what the server counts itself, as prometheus_client ``Counter`` and ``Histogram`` objects:
  prompt and generation tokens, finished choices by reason, refused requests by status, and the
  latency histograms (time to first token, inter-token latency, end to end);
- what the engine counts, read at scrape time by :class:`EngineCollector` from the engine
  thread's copies (:class:`EngineCounts`): running and waiting sequences, the KV pool, the prefix
  cache, preemptions, speculative decoding's drafts, the margin gate.

The exposition is prometheus_client's text format 0.0.4 without the ``_created`` series (the
names are the ones the server has always exposed).
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Tuple

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from .. import _native
from .protocol import FINISH_REASONS

#: the exposition's media type (PlainTextResponse adds ``; charset=utf-8``)
MEDIA_TYPE = "text/plain; version=0.0.4"
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                   7.5, 10.0, 20.0, 40.0, 80.0)
#: statuses whose refusal counter is exposed (at 0) before any such refusal
ERROR_STATUSES = ("400", "401", "404", "429", "503")
GATE_COUNTERS = tuple(_native.GATE_COUNTERS)


def samples(text: str) -> List[Tuple[str, Dict[str, str], float]]:
    """Every sample of a /metrics exposition as ``(name, labels, value)``, read by
    prometheus_client's own parser: what tests and benchmarks read a server's counters with."""
    return [(x.name, dict(x.labels), x.value)
            for fam in text_string_to_metric_families(text) for x in fam.samples]


@dataclass
class EngineCounts:
    """The engine's counts as of its last step (zeros before the model is loaded)."""
    running: int = 0
    waiting: int = 0
    kv: Dict[str, int] = field(default_factory=lambda: {
        "used": 0, "cached": 0, "free": 0, "total": 1, "prefix_queries": 0, "prefix_hits": 0, "preemptions": 0})
    gate: Dict[str, int] = field(default_factory=lambda: dict.fromkeys(GATE_COUNTERS, 0))
    spec: Dict[str, int] = field(default_factory=lambda: {"draft_tokens": 0, "accepted_tokens": 0})


class EngineCollector(Collector):
    """The engine's series, built at each scrape from ``counts()``."""

    def __init__(self, counts: Callable[[], EngineCounts], model_name: Callable[[], str]):
        self.counts, self.model_name = counts, model_name

    def collect(self) -> Iterator[Metric]:
        c, lbl = self.counts(), [self.model_name()]
        kv = c.kv
        yield self._one(GaugeMetricFamily, "num_requests_running", "Sequences in the running batch.", lbl, c.running)
        yield self._one(GaugeMetricFamily, "num_requests_waiting", "Sequences waiting to be scheduled.", lbl,
                        c.waiting)
        yield self._one(GaugeMetricFamily, "kv_cache_usage_perc",
                        "KV blocks held by running requests over the pool (1 = full).", lbl,
                        kv["used"] / max(kv["total"], 1))
        for k, help_ in (("used", "held by running requests"), ("cached", "kept for prefix hits, held by none"),
                         ("free", "free")):
            yield self._one(GaugeMetricFamily, f"kv_cache_{k}_blocks", f"KV blocks {help_}.", lbl, kv[k])
        for name, k, help_ in (("prefix_cache_queries", "prefix_queries", "Prompt tokens looked up in the prefix cache."),
                               ("prefix_cache_hits", "prefix_hits", "Prompt tokens found in the prefix cache."),
                               ("num_preemptions", "preemptions", "Requests preempted to free KV blocks.")):
            yield self._one(CounterMetricFamily, name, help_, lbl, kv[k])
        # vLLM's names: drafts proposed and kept by speculative decoding
        for k, help_ in (("draft_tokens", "Draft tokens proposed by speculative decoding."),
                         ("accepted_tokens", "Draft tokens kept: each equalled the token decided before it.")):
            yield self._one(CounterMetricFamily, f"spec_decode_num_{k}", help_, lbl, int(c.spec.get(k, 0)))
        for k in GATE_COUNTERS:
            yield self._one(CounterMetricFamily, f"gate_{k}", f"The margin gate's {k.replace('_', ' ')}.", lbl,
                            int(c.gate.get(k, 0)))

    @staticmethod
    def _one(family: Any, name: str, help_: str, labels: list, value: float) -> Metric:
        m = family(f"candle_gate:{name}", help_, labels=["model_name"])
        m.add_metric(labels, value)
        return m


class _WithoutCreated:
    """The registry as exposed: prometheus_client's ``_created`` series left out."""

    def __init__(self, registry: CollectorRegistry):
        self.registry = registry

    def collect(self) -> Iterator[Metric]:
        for m in self.registry.collect():
            m.samples = [s for s in m.samples if not s.name.endswith("_created")]
            yield m


class Metrics:
    """The app's registry and the server's own counters and histograms.

    The series carry the served model's name, known once the model is loaded: until then they are
    labelled ``model_name=""``, and :meth:`bind` moves them (with the refusals counted meanwhile)
    to the name."""

    def __init__(self, engine_counts: Callable[[], EngineCounts] = EngineCounts):
        self.registry = CollectorRegistry()
        self.model_name = ""
        self.registry.register(EngineCollector(engine_counts, lambda: self.model_name))
        r, by_model = self.registry, ["model_name"]
        self.prompt_tokens = Counter("candle_gate:prompt_tokens", "Prompt tokens submitted.", by_model, registry=r)
        self.generation_tokens = Counter("candle_gate:generation_tokens", "Tokens generated.", by_model, registry=r)
        self.request_success = Counter("candle_gate:request_success", "Finished choices by finish reason.",
                                       by_model + ["finished_reason"], registry=r)
        self.request_errors = Counter("candle_gate:request_errors", "Requests refused, by HTTP status.",
                                      by_model + ["status"], registry=r)
        hist = lambda name, help_: Histogram(f"candle_gate:{name}", help_, by_model,  # noqa: E731
                                             buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = hist("time_to_first_token_seconds", "Time to the first token.")
        self.itl = hist("inter_token_latency_seconds", "Time between tokens.")
        self.e2e = hist("e2e_request_latency_seconds", "Request latency, arrival to last token.")
        self._lock = threading.Lock()  # bind (the load thread) against refusals (the loop)
        self._refused: Dict[str, float] = {}
        self.bind("")

    def bind(self, model_name: str) -> None:
        """Labels every series with ``model_name`` from now on (the refusals counted so far move
        along)."""
        with self._lock:
            for m in (self.prompt_tokens, self.generation_tokens, self.request_success, self.request_errors,
                      self.ttft, self.itl, self.e2e):
                m.clear()
            self.model_name = model_name
            for m in (self.prompt_tokens, self.generation_tokens, self.ttft, self.itl, self.e2e):
                m.labels(model_name)
            for r in FINISH_REASONS:
                self.request_success.labels(model_name, r)
            for s in sorted(set(ERROR_STATUSES) | set(self._refused)):
                self.request_errors.labels(model_name, s).inc(self._refused.get(s, 0))

    # -- counting ----------------------------------------------------------------------------------

    def refused(self, status: int) -> None:
        with self._lock:
            s = str(status)
            self._refused[s] = self._refused.get(s, 0) + 1
            self.request_errors.labels(self.model_name, s).inc()

    def finished(self, reason: str) -> None:
        self.request_success.labels(self.model_name, reason).inc()

    def submitted(self, prompt_tokens: int) -> None:
        self.prompt_tokens.labels(self.model_name).inc(prompt_tokens)

    def name_replica(self, replica: str) -> None:
        """Adds ``candle_gate:replica_info{replica=...} 1``: which replica's series these are."""
        Gauge("candle_gate:replica_info", "The replica serving these series (behind a router).", ["replica"],
              registry=self.registry).labels(replica).set(1)

    def exposition(self) -> bytes:
        return generate_latest(_WithoutCreated(self.registry))  # type: ignore[arg-type]


class Timing:
    """One request's latencies, observed as its tokens are delivered (tokens that come in the
    same step count 0 s apart after the first)."""

    def __init__(self, metrics: Metrics, t0: float):
        self.m, self.t0, self.last = metrics, t0, None

    def tokens(self, k: int) -> None:
        if k <= 0:
            return
        now = time.perf_counter()
        name = self.m.model_name
        self.m.generation_tokens.labels(name).inc(k)
        first = self.m.ttft if self.last is None else self.m.itl
        first.labels(name).observe(now - (self.t0 if self.last is None else self.last))
        itl = self.m.itl.labels(name)
        for _ in range(k - 1):  # tokens delivered in the same step
            itl.observe(0.0)
        self.last = now

    def done(self) -> None:
        self.m.e2e.labels(self.m.model_name).observe(time.perf_counter() - self.t0)

