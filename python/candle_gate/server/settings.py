"""The server's settings: one typed object built from ``candle-gate serve``'s flags.

Everything below :func:`~candle_gate.server.app.create_app` reads these fields, never argparse's
namespace. The flags and their defaults are ``cli.py``'s (``candle-gate serve --help``); the
table in docs/SERVER.md says what each one does.
"""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Optional

from ..models import DEFAULT_MODEL


@dataclass(frozen=True)
class Settings:
    # -- the model and the engine --------------------------------------------------------------
    model: str = DEFAULT_MODEL
    mode: str = "invariant"
    profile: Optional[str] = None
    gate: str = "off"
    tau: Optional[float] = None
    deep_tau: Optional[float] = None
    #: engine options left at None take the engine's defaults (``ENGINE_DEFAULTS``)
    max_num_seqs: Optional[int] = None
    max_num_batched_tokens: Optional[int] = None
    prefill_chunk: Optional[int] = None
    kv_budget_tokens: Optional[int] = None
    kv_dtype: Optional[str] = None
    enable_prefix_caching: bool = True
    threads: Optional[int] = None
    #: speculative decoding (None: off); it changes no token, only how many a step emits
    speculative_method: Optional[str] = None
    num_speculative_tokens: Optional[int] = None
    speculative_disable_by_batch_size: Optional[int] = None
    #: the draft model of speculative method ``draft`` (a known name or a path)
    draft_model: Optional[str] = None
    # -- the API ---------------------------------------------------------------------------------
    #: the context a request may use (prompt + new tokens); None: the model's
    max_model_len: Optional[int] = None
    #: waiting requests beyond which new ones get 429
    max_queue: int = 64
    #: require ``Authorization: Bearer KEY`` on /v1, /tokenize, /detokenize, /reset_prefix_cache
    api_key: Optional[str] = None
    #: the model's id in the API; None: the known-model name, else the file stem
    served_model_name: Optional[str] = None
    #: a stream's events arriving within this many ms of its last write go out in one write (the
    #: first token at once); None: 0 for ``serve``, ``candle_gate.ray.REPLICA_STREAM_INTERVAL_MS``
    #: for a replica, whose every write is a message through Ray's proxy
    stream_interval_ms: Optional[int] = None
    # -- the HTTP server -------------------------------------------------------------------------
    host: str = "127.0.0.1"
    port: int = 8000
    #: seconds SIGTERM waits for the requests in flight
    drain_timeout: int = 30
    log_level: str = "info"
    access_log: bool = False
    # -- behind a router (candle_gate.ray) --------------------------------------------------------
    #: this replica's name: sent as ``X-Candle-Gate-Replica`` on every response and as
    #: ``candle_gate:replica_info{replica=...}`` in /metrics; None: not a replica
    replica: Optional[str] = None
    #: the lifespan's startup returns only once the model is loaded (and fails if it cannot be):
    #: a router then sends a replica no request before it can answer
    ready_before_serving: bool = False

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "Settings":
        """From ``candle-gate serve``'s parsed flags (``--no-prefix-cache`` turns caching off)."""
        given = vars(args)
        kw = {f.name: given[f.name] for f in dataclasses.fields(cls) if f.name in given}
        if "no_prefix_cache" in given:
            kw["enable_prefix_caching"] = not given["no_prefix_cache"]
        return cls(**kw)
