"""The server's settings: one typed object built from ``candle-gate serve``'s flags.

Everything below :func:`~candle_gate.server.app.create_app` reads these fields, never argparse's
namespace. The defaults are these fields' (``cli.py`` builds ``candle-gate serve``'s flags with
them; the engine's own are ``ENGINE_DEFAULTS``); the table in docs/SERVER.md says what each
one does. This module imports neither FastAPI nor uvicorn: the command line reads it without
the ``serve`` extra.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ..models import DEFAULT_MODEL

#: what ``--api-key`` guards: ``api`` the API (/v1/*, /tokenize, /detokenize,
#: /reset_prefix_cache), ``all`` also /metrics, /docs, /redoc and /openapi.json
API_KEY_SCOPES = ("api", "all")


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
    #: with ``api_key``: ``api`` (the above) or ``all`` (also /metrics, /docs, /redoc,
    #: /openapi.json; /health stays open for health checks)
    api_key_scope: str = "api"
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
    #: seconds a request's head (request line and headers) may take to arrive, and then its body
    #: (a slow trickle gets 408 and its connection closed)
    read_timeout: float = 30.0
    log_level: str = "info"
    access_log: bool = False
    # -- behind a router (candle_gate.ray) --------------------------------------------------------
    #: this replica's name: sent as ``X-Candle-Gate-Replica`` on every response and as
    #: ``candle_gate:replica_info{replica=...}`` in /metrics; None: not a replica
    replica: Optional[str] = None
    #: the lifespan's startup returns only once the model is loaded (and fails if it cannot be):
    #: a router then sends a replica no request before it can answer
    ready_before_serving: bool = False

    def __post_init__(self) -> None:
        if self.api_key_scope not in API_KEY_SCOPES:
            raise ValueError(f"api_key_scope must be one of {', '.join(API_KEY_SCOPES)}, got {self.api_key_scope!r}")
        if not self.read_timeout > 0:
            raise ValueError(f"read_timeout must be a number of seconds above 0, got {self.read_timeout}")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "Settings":
        """From ``candle-gate serve``'s parsed flags (``--no-prefix-cache`` turns caching off;
        ``--api-key-env`` and ``--api-key-file`` are read here, :func:`api_key_from`)."""
        given = vars(args)
        kw = {f.name: given[f.name] for f in dataclasses.fields(cls) if f.name in given}
        if "no_prefix_cache" in given:
            kw["enable_prefix_caching"] = not given["no_prefix_cache"]
        if given.get("api_key_env") or given.get("api_key_file"):
            kw["api_key"] = api_key_from(env=given.get("api_key_env"), file=given.get("api_key_file"))
        return cls(**kw)


def api_key_from(env: Optional[str] = None, file: Optional[str] = None) -> str:
    """The API key from the environment variable ``env`` or the file ``file`` (its first line,
    without the line end): off the command line, where ``ps`` and /proc/PID/cmdline show it.
    An unset or empty source is an error (a server meant to be guarded must not start open)."""
    if env:
        key = os.environ.get(env, "")
        if not key:
            raise ValueError(f"--api-key-env: the environment variable {env} is not set or empty")
        return key
    if file:
        try:
            lines = Path(file).read_text().splitlines()
        except OSError as e:
            raise ValueError(f"--api-key-file: cannot read {file}: {e.strerror}") from None
        key = lines[0].strip() if lines else ""
        if not key:
            raise ValueError(f"--api-key-file: {file} holds no key")
        return key
    raise ValueError("api_key_from needs env or file")
