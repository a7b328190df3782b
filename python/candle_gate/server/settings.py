"""The server's settings: one typed object, and ``candle-gate serve``'s flags.

Everything below :func:`~candle_gate.server.app.create_app` reads these fields, never argparse's
namespace. Each field is one flag of ``candle-gate serve`` (:mod:`candle_gate.cli.serve` builds
them from the fields: the name, the type, the default and the help written here, once), named
``--`` and the field's name with dashes unless :data:`FLAG_NAMES` says otherwise; the engine's
own defaults are ``ENGINE_DEFAULTS``; the table in docs/SERVER.md says what each one does. This
module imports neither FastAPI nor uvicorn: the command line reads it without the ``serve``
extra.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import warnings
from dataclasses import InitVar, dataclass, field
from pathlib import Path
from typing import Any, Dict, Optional

from .. import _native
from ..engine import DEFAULT_MODE, GATES, MODES, SPECULATIVE_METHODS
from ..models import DEFAULT_MODEL

#: what ``--api-key`` guards: ``api`` the API (/v1/*, /tokenize, /detokenize,
#: /reset_prefix_cache), ``all`` also /metrics, /docs, /redoc and /openapi.json
API_KEY_SCOPES = ("api", "all")
KV_DTYPES = tuple(_native.KV_DTYPES)  # the Rust enum owns the names

#: The fields whose ``candle-gate serve`` flag is not ``--`` and the field's name with dashes;
#: None: no flag (set by :mod:`candle_gate.ray` for its replicas, not by a user).
FLAG_NAMES: Dict[str, Optional[str]] = {
    "enable_prefix_caching": "--no-prefix-cache",
    "replica": None,
    "ready_before_serving": None,
}
#: Old flag names that still work, with a warning: ``{old flag: the field it sets}`` (the old
#: keywords are :class:`Settings`' deprecated ``InitVar`` fields).
DEPRECATED_FLAGS: Dict[str, str] = {"--max-num-batched-tokens": "max_tokens_per_step"}


def setting(default: Any, help: str, **flag: Any) -> Any:
    """A field with its flag's ``help`` (and argparse's ``choices``, ``metavar``): the help says
    the default in words where it is None."""
    return field(default=default, metadata={"help": help, **flag})


@dataclass(frozen=True)
class Settings:
    # -- the model and the engine --------------------------------------------------------------
    model: str = setting(DEFAULT_MODEL, "a known model name or a path to a .gguf file")
    mode: str = setting(DEFAULT_MODE, "fast-lane kernel policy", choices=MODES)
    profile: Optional[str] = setting(
        None, "a crossover/gate profile (JSON) to load (default: none; a gated engine without --tau reads the "
              "user's profile, then the packaged one)")
    gate: str = setting("off", "the margin gate: gated rechecks steps whose top-1/top-2 margin is below --tau in "
                               "the FP32 reference lane; always rechecks every step; shadow measures without acting",
                        choices=GATES)
    tau: Optional[float] = setting(None, "the margin below which a gated engine rechecks a step (default: the "
                                         "profile's calibrated tau)")
    deep_tau: Optional[float] = setting(None, "a recheck whose own margin is below this rebuilds the cache in the "
                                              "reference lane (default: the profile's, else tau/2)")
    # Engine options left at None take the engine's defaults (``ENGINE_DEFAULTS``, which the
    # flags show).
    max_num_seqs: Optional[int] = setting(None, "sequences in the running batch")
    max_tokens_per_step: Optional[int] = setting(
        None, "rows in one step (decode rows first, then prefill chunks): bounds the inter-token latency a long "
              "prefill adds")
    prefill_chunk: Optional[int] = setting(None, "prompt positions per prefill chunk")
    kv_budget_tokens: Optional[int] = setting(
        None, "the KV pool's size in positions (allocated at start; cached prefixes live in it too); a chat "
              "without max_tokens generates at most what it can hold")
    kv_dtype: Optional[str] = setting(None, "how K/V values are stored", choices=KV_DTYPES)
    enable_prefix_caching: bool = setting(
        True, "never reuse the K/V of a prefix another request computed (default: reuse)")
    threads: Optional[int] = setting(None, "the engine's threads (default: rayon's, one per core)")
    # Speculative decoding changes no token, only how many a step emits.
    speculative_method: Optional[str] = setting(
        None, "speculative decoding (ngram: prompt lookup; draft: a smaller model of the same vocabulary, "
              "--draft-model); changes no token, only speed (default: off)", choices=SPECULATIVE_METHODS)
    num_speculative_tokens: Optional[int] = setting(None, "drafts per sequence and step (default: ngram 12, draft 3)")
    speculative_disable_by_batch_size: Optional[int] = setting(
        None, "no drafts in a step with more decoding sequences than this (default: ngram 8, draft 1)")
    draft_model: Optional[str] = setting(
        None, "the draft model of --speculative-method draft: a known model name or a .gguf path (default: none)")
    # -- the API ---------------------------------------------------------------------------------
    max_model_len: Optional[int] = setting(
        None, "context length served (default: the model's): longer prompts get 400, max_tokens is trimmed to fit")
    max_queue: int = setting(64, "waiting requests beyond which new ones get 429 with Retry-After")
    api_key: Optional[str] = setting(
        None, "require `Authorization: Bearer KEY` (visible to `ps`: prefer --api-key-env or --api-key-file; "
              "default: no key)", metavar="KEY")
    api_key_scope: str = setting(
        "api", "what the key guards: api = /v1/*, /tokenize, /detokenize, /reset_prefix_cache; all = also "
               "/metrics, /docs, /redoc, /openapi.json (/health is always open, for health checks)",
        choices=API_KEY_SCOPES)
    served_model_name: Optional[str] = setting(
        None, "the model's name in the API (default: the known-model name, else the file stem)")
    # None: 0 for ``serve``, ``candle_gate.ray.REPLICA_STREAM_INTERVAL_MS`` for a replica, whose
    # every write is a message through Ray's proxy.
    stream_interval_ms: Optional[int] = setting(
        None, "write a stream's events that arrive within MS of its last write together, the first token at once "
              "(default: 0; 50 with --replicas, where each write is a message through Ray's proxy)", metavar="MS")
    # -- the HTTP server -------------------------------------------------------------------------
    host: str = setting("127.0.0.1", "the address to listen on")
    port: int = setting(8000, "the port to listen on")
    drain_timeout: int = setting(30, "seconds SIGTERM waits for in-flight requests before cancelling them")
    read_timeout: float = setting(
        30.0, "seconds a request's head (request line and headers) may take to arrive, and then its body; a slower "
              "one gets 408 and its connection closed", metavar="SECONDS")
    log_level: str = setting("info", "uvicorn's log level")
    access_log: bool = setting(False, "log every request (uvicorn's access log; default: off)")
    # -- behind a router (candle_gate.ray) --------------------------------------------------------
    #: this replica's name: sent as ``X-Candle-Gate-Replica`` on every response and as
    #: ``candle_gate:replica_info{replica=...}`` in /metrics; None: not a replica
    replica: Optional[str] = None
    #: the lifespan's startup returns only once the model is loaded (and fails if it cannot be):
    #: a router then sends a replica no request before it can answer
    ready_before_serving: bool = False
    #: deprecated: ``max_tokens_per_step``'s old name (vLLM's), still taken with a warning
    max_num_batched_tokens: InitVar[Optional[int]] = None

    def __post_init__(self, max_num_batched_tokens: Optional[int]) -> None:
        if max_num_batched_tokens is not None:
            warnings.warn("Settings(max_num_batched_tokens=) is deprecated; use max_tokens_per_step=",
                          DeprecationWarning, stacklevel=3)
            if self.max_tokens_per_step is None:
                object.__setattr__(self, "max_tokens_per_step", max_num_batched_tokens)
        if self.api_key_scope not in API_KEY_SCOPES:
            raise ValueError(f"api_key_scope must be one of {', '.join(API_KEY_SCOPES)}, got {self.api_key_scope!r}")
        if not self.read_timeout > 0:
            raise ValueError(f"read_timeout must be a number of seconds above 0, got {self.read_timeout}")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "Settings":
        """From ``candle-gate serve``'s parsed flags (each stored under its field's name;
        ``--api-key-env`` and ``--api-key-file`` are read here, :func:`api_key_from`)."""
        given = vars(args)
        kw = {f.name: given[f.name] for f in dataclasses.fields(cls) if f.name in given}
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
