"""An OpenAI-compatible HTTP server over one :class:`~candle_gate.Engine` (``candle-gate serve``).

docs/SERVER.md describes the endpoints, the fields, the errors, ``system_fingerprint`` and the
metrics. The modules, in the order a request meets them:

- ``settings.py``: :class:`Settings`, the typed flags of ``candle-gate serve``;
- ``app.py``: :func:`create_app` (the routes, auth and readiness as dependencies, the lifespan,
  the exception handlers) and :func:`serve` (uvicorn, SIGTERM drains);
- ``protocol.py``: the request and response models (OpenAI's shapes), reading a body;
- ``errors.py``: :class:`APIError`, the error body, pydantic's and the engine's errors as
  messages naming the request's field;
- ``serving.py``, ``serving_completion.py``, ``serving_chat.py``, ``serving_tokenization.py``: a
  request to the engine and back: sampling parameters, logprobs, usage, SSE chunks;
- ``worker.py``: :class:`EngineWorker`, the thread that steps the engine and delivers its
  events to each request's asyncio queue;
- ``state.py``: the model, the worker, readiness, ``system_fingerprint``;
- ``metrics.py``: ``/metrics`` with prometheus_client;
- ``openapi.py``: the OpenAPI document.
"""
from __future__ import annotations

import importlib
from typing import Any

# Imported when first used: ``settings.py`` (what the command line reads) needs neither FastAPI
# nor uvicorn, the rest do (the ``serve`` extra).
_EXPORTS = {"create_app": "app", "serve": "app", "APIError": "errors", "engine_error": "errors",
            "error_body": "errors", "Metrics": "metrics", "MAX_BODY_BYTES": "protocol", "Settings": "settings",
            "ServerState": "state", "EngineWorker": "worker", "QueueFull": "worker"}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{module}", __name__), name)
