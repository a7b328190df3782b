"""The server's state (``app.state.server``): the model, the engine thread, the served name and
``system_fingerprint``, readiness, the metrics.

The model is loaded in a thread started by the app's lifespan (:meth:`ServerState.load`), so the
server answers ``/health`` (503 ``loading``) at once; :meth:`ServerState.attach` is the one place
that makes it ready, also for a test that attaches a fake model and worker.
"""
from __future__ import annotations

import asyncio
import sys
import threading
import time
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

from ..engine import Engine, Model, layout_for, speculative_options
from .errors import APIError
from .metrics import EngineCounts, Metrics
from .protocol import finish_reason
from .settings import Settings
from .worker import EngineWorker

class ServerState:
    def __init__(self, settings: Settings):
        self.settings = settings
        #: the tokenizer the serving code uses (a :class:`~candle_gate.Model`)
        self.model: Any = None
        #: the engine thread (an :class:`EngineWorker`): ``submit``, ``cancel``, ``counts``, ...
        self.worker: Any = None
        self.model_name = ""
        self.model_aliases: set = set()
        self.system_fingerprint = ""
        self.ready = False
        self.draining = False
        #: HTTP requests being answered now (``app.Door`` counts them; a SIGTERM drain waits for them)
        self.active_requests = 0
        self.load_error: Optional[str] = None
        #: set when loading is over, whether it worked or not
        self.loaded = threading.Event()
        self.metrics = Metrics(self.engine_counts)
        self.created = int(time.time())
        #: the context a request may use (prompt + new tokens): the model's, or less with
        #: ``settings.max_model_len``
        self.max_model_len = 0
        #: the KV pool, ``(blocks, positions per block)``, where known (a fake engine may not say)
        self.kv_pool: Optional[Tuple[int, int]] = None
        self._tok_str: Dict[int, str] = {}

    # -- loading --------------------------------------------------------------------------------

    def load(self, loop: asyncio.AbstractEventLoop) -> None:
        """Loads the model and starts the engine thread (in a thread of its own: it takes seconds)."""
        s = self.settings
        try:
            model = Model.load(s.model, layout=layout_for(s.mode))
            eng = Engine(model, mode=s.mode, gate=s.gate, tau=s.tau, deep_tau=s.deep_tau, profile=s.profile,
                         max_num_seqs=s.max_num_seqs, threads=s.threads, kv_dtype=s.kv_dtype,
                         prefill_chunk=s.prefill_chunk, max_tokens_per_step=s.max_tokens_per_step,
                         kv_budget_tokens=s.kv_budget_tokens, enable_prefix_caching=s.enable_prefix_caching,
                         speculative=speculative_options(s.speculative_method, s.num_speculative_tokens,
                                                         s.speculative_disable_by_batch_size, s.draft_model))
        except Exception as e:
            self.load_error = str(e)
            print(f"candle-gate serve: error: could not load the model: {e}", file=sys.stderr, flush=True)
            self.loaded.set()
            return
        worker = EngineWorker(eng, loop, self.count_finished)
        worker.start()
        self.attach(model, worker, system_fingerprint(model, eng, s.mode),
                    kv_pool=(eng.kv_stats()["total"], eng.kv_block_size))
        print(f"candle-gate serve: model {self.model_name} ({model.path}, mode {s.mode}, gate {s.gate}) "
              f"at http://{s.host}:{s.port}/v1 (system_fingerprint {self.system_fingerprint})", flush=True)
        if eng.gate_source:
            print(f"candle-gate serve: gate tau {eng.tau:.4g}, deep_tau {eng.deep_tau:.4g} "
                  f"from {eng.gate_source}", flush=True)

    def attach(self, model: Any, worker: Any, fingerprint: str, kv_pool: Optional[Tuple[int, int]] = None) -> None:
        """Serves ``model`` through ``worker`` from now on (``kv_pool``: the engine's KV pool,
        ``(blocks, positions per block)``)."""
        from ..models import KNOWN_MODELS
        s = self.settings
        ctx = int(model.config.get("context_length", 0) or 0)
        cap = s.max_model_len
        self.max_model_len = min(ctx, int(cap)) if cap and ctx else int(cap or ctx)
        path = model.path
        stem = Path(path).stem
        self.model_name = s.served_model_name or (s.model if s.model in KNOWN_MODELS else stem)
        self.model_aliases = {self.model_name, stem, Path(path).name, path, str(s.model)}
        self.system_fingerprint = fingerprint
        self.kv_pool = kv_pool
        self.model, self.worker = model, worker
        self.metrics.bind(self.model_name)
        self.ready = True
        self.loaded.set()

    # -- what the handlers ask ------------------------------------------------------------------

    def check_ready(self) -> None:
        if self.draining:
            raise APIError(503, "the server is shutting down", code="shutting_down")
        if not self.ready:
            msg = "the model is loading" if self.load_error is None else f"the model failed to load: {self.load_error}"
            raise APIError(503, msg, code="model_not_ready")

    def check_model(self, name: Optional[str]) -> None:
        if name is not None and name not in self.model_aliases:
            raise APIError(404, f"the model `{name}` does not exist; this server serves `{self.model_name}`",
                           param="model", code="model_not_found")

    def kv_fit(self, n_prompt: int, n: int) -> Optional[int]:
        """The most new tokens each of ``n`` choices of an ``n_prompt``-token prompt can have
        with all of them in the KV pool at once, in whole blocks: the engine's admission rule
        (``Engine::validate``: a request must be able to finish alone), which refuses anything
        more. None where the pool is not known or cannot hold the prompt."""
        if self.kv_pool is None:
            return None
        blocks, block = self.kv_pool
        fit = blocks // max(n, 1) * block - n_prompt
        return fit if fit > 0 else None

    def token_str(self, tid: int) -> str:
        """One token's text (cached)."""
        s = self._tok_str.get(tid)
        if s is None:
            s = self.model.detokenize([tid])
            self._tok_str[tid] = s
        return s

    def engine_counts(self) -> EngineCounts:
        return self.worker.counts() if self.ready else EngineCounts()

    def count_finished(self, res: Any) -> None:
        for c in res.choices:
            self.metrics.finished(finish_reason(c.finish_reason))


def system_fingerprint(model: Model, eng: Engine, mode: str) -> str:
    """The engine's (Rust's ``model::system_fingerprint``): ``fp_`` + 16 hex of SHA-256 over the
    stack, the model file, the version, the kernel policy, the gate and the host (docs/SERVER.md,
    "system_fingerprint")."""
    return eng.system_fingerprint
