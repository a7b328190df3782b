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
from .app import create_app, serve
from .errors import APIError, engine_error, error_body
from .metrics import Metrics
from .protocol import MAX_BODY_BYTES
from .settings import Settings
from .state import ServerState
from .worker import EngineWorker, QueueFull

__all__ = ["create_app", "serve", "APIError", "engine_error", "error_body", "Metrics", "MAX_BODY_BYTES",
           "Settings", "ServerState", "EngineWorker", "QueueFull"]
