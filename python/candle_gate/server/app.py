"""The FastAPI app (``create_app``) and ``candle-gate serve`` (``serve``).

The routes are thin: auth and readiness are FastAPI dependencies (:func:`require_key`,
:func:`require_ready`, in that order, before the body is read), the work is the serving
objects' (``serving_completion.py``, ``serving_chat.py``, ``serving_tokenization.py``), the state
is ``app.state.server`` (``state.py``). Every error leaves through one exception handler in
OpenAI's shape (``errors.py``) and is counted by status (``metrics.py``). The lifespan loads the
model in a thread (``/health`` says ``loading`` meanwhile) and, at shutdown, cancels what is left
and stops the engine thread.
"""
from __future__ import annotations

import asyncio
import hmac
import signal
import threading
import time
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Callable, Dict, Optional

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import _native
from .errors import APIError, error_body, request_validation_message
from .metrics import MEDIA_TYPE
from .openapi import error_responses, openapi_document, request_body, sse_content
from .protocol import (ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse, CompletionChunk,
                       CompletionRequest, CompletionResponse, DetokenizeRequest, DetokenizeResponse, HealthResponse,
                       ModelCard, ModelList, TokenizeRequest, TokenizeResponse)
from .serving_chat import OpenAIServingChat
from .serving_completion import OpenAIServingCompletion
from .serving_tokenization import OpenAIServingTokenization
from .settings import Settings
from .state import ServerState

#: the response header naming the replica that answered (``Settings.replica``)
REPLICA_HEADER = "X-Candle-Gate-Replica"

#: loads the model and attaches it to the state (in a thread the lifespan starts)
Loader = Callable[[ServerState, asyncio.AbstractEventLoop], None]


# ---------------------------------------------------------------------------------------------
# Dependencies

def server_state(request: Request) -> ServerState:
    return request.app.state.server


def key_ok(key: Optional[str], authorization: str) -> bool:
    """Whether an ``Authorization`` header carries ``Bearer KEY`` (compared in constant time);
    always, without a key."""
    if not key:
        return True
    given = authorization[7:].strip() if authorization[:7].lower() == "bearer " else ""
    return hmac.compare_digest(given.encode(), key.encode())


def require_key(request: Request) -> None:
    """With ``--api-key``: ``Authorization: Bearer KEY``, else 401."""
    if not key_ok(server_state(request).settings.api_key, request.headers.get("authorization", "")):
        raise APIError(401, "invalid API key", code="invalid_api_key")


def require_ready(request: Request) -> None:
    """503 while the model loads (or failed to) and once the server is draining."""
    server_state(request).check_ready()


_GUARDED = [Depends(require_key), Depends(require_ready)]
router = APIRouter()


# ---------------------------------------------------------------------------------------------
# Routes

@router.get("/health", responses={200: {"model": HealthResponse, "description": "ready"},
                                  503: {"model": HealthResponse, "description": "loading, failed to load, or draining"}})
async def health(request: Request):
    st = server_state(request)
    if st.draining:
        return JSONResponse({"status": "draining"}, status_code=503)
    if not st.ready:
        return JSONResponse({"status": "loading" if st.load_error is None else "error",
                             "error": st.load_error}, status_code=503)
    return {"status": "ok", "model": st.model_name}


@router.get("/v1/models", dependencies=_GUARDED,
            responses={200: {"model": ModelList, "description": "the served model"}, **error_responses(401, 503)})
async def models(request: Request):
    st = server_state(request)
    return {"object": "list", "data": [{
        "id": st.model_name, "object": "model", "created": st.created, "owned_by": "candle-gate",
        "root": st.model.path, "max_model_len": st.max_model_len}]}


@router.get("/v1/models/{name:path}", dependencies=_GUARDED,
            responses={200: {"model": ModelCard, "description": "the served model"}, **error_responses(401, 404, 503)})
async def model_info(name: str, request: Request):
    st = server_state(request)
    st.check_model(name)
    return {"id": st.model_name, "object": "model", "created": st.created, "owned_by": "candle-gate"}


@router.get("/metrics", response_class=PlainTextResponse,
            responses={200: {"description": "Prometheus text format 0.0.4",
                             "content": {"text/plain": {"schema": {"type": "string"}}}}})
async def metrics(request: Request):
    return PlainTextResponse(server_state(request).metrics.exposition(), media_type=MEDIA_TYPE)


@router.post("/reset_prefix_cache", dependencies=_GUARDED,
             responses={200: {"description": "the prefix cache was emptied"}, **error_responses(401, 503)})
async def reset_prefix_cache(request: Request):
    """Forgets every cached prefix (vLLM's endpoint of the same name)."""
    await asyncio.get_running_loop().run_in_executor(None, server_state(request).worker.reset_prefix_cache)
    return {"status": "ok"}


@router.post("/tokenize", dependencies=_GUARDED, openapi_extra=request_body(TokenizeRequest),
             responses={200: {"model": TokenizeResponse, "description": "the token ids"},
                        **error_responses(400, 401, 404, 413, 503)})
async def tokenize(request: Request):
    return await request.app.state.serving_tokenization.tokenize(request)


@router.post("/detokenize", dependencies=_GUARDED, openapi_extra=request_body(DetokenizeRequest),
             responses={200: {"model": DetokenizeResponse, "description": "the text"},
                        **error_responses(400, 401, 404, 413, 503)})
async def detokenize(request: Request):
    return await request.app.state.serving_tokenization.detokenize(request)


@router.post("/v1/completions", dependencies=_GUARDED, openapi_extra=request_body(CompletionRequest),
             responses={200: {"model": CompletionResponse, "content": sse_content(CompletionChunk),
                              "description": "the completion (JSON), or with `stream` its chunks (SSE)"},
                        **error_responses(400, 401, 404, 413, 429, 500, 503)})
async def completions(request: Request):
    return await request.app.state.serving_completion.create(request)


@router.post("/v1/chat/completions", dependencies=_GUARDED, openapi_extra=request_body(ChatCompletionRequest),
             responses={200: {"model": ChatCompletionResponse, "content": sse_content(ChatCompletionChunk),
                              "description": "the chat completion (JSON), or with `stream` its chunks (SSE)"},
                        **error_responses(400, 401, 404, 413, 429, 500, 503)})
async def chat_completions(request: Request):
    return await request.app.state.serving_chat.create(request)


# ---------------------------------------------------------------------------------------------
# Errors: all in OpenAI's shape, counted by status

def error_response(request: Request, e: APIError) -> JSONResponse:
    if e.status >= 400:
        server_state(request).metrics.refused(e.status)
    return JSONResponse(error_body(e.status, e.message, e.param, e.code), status_code=e.status, headers=e.headers)


async def on_api_error(request: Request, e: APIError) -> JSONResponse:
    return error_response(request, e)


async def on_validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
    """FastAPI's own validation (path and query parameters): a 400, not a 422."""
    return error_response(request, APIError(400, request_validation_message(list(e.errors()))))


async def on_http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
    """Starlette's 404 (an unknown path), 405 (a method a path does not take), ..."""
    return error_response(request, APIError(e.status_code, str(e.detail)))


async def on_internal_error(request: Request, e: Exception) -> JSONResponse:
    return error_response(request, APIError(500, f"internal error: {type(e).__name__}: {e}"))


# ---------------------------------------------------------------------------------------------
# Around every request

#: the paths ``--api-key-scope all`` also guards (FastAPI's pages and the metrics; /health stays
#: open for health checks)
OPS_PATHS = frozenset({"/metrics", "/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"})


class Door:
    """Pure ASGI middleware, the outermost of the app's own: counts the requests in flight
    (``ServerState.active_requests``, what a SIGTERM drain waits for), answers with
    ``Connection: close`` once the server is draining (a keep-alive client gets its 503 and
    reconnects rather than finding its connection closed under it), and with
    ``api_key_scope="all"`` asks for the key on :data:`OPS_PATHS`."""

    def __init__(self, app: Any, st: ServerState):
        self.app, self.st = app, st
        s = st.settings
        self.guard_ops = bool(s.api_key) and s.api_key_scope == "all"

    async def __call__(self, scope: Dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        st = self.st
        if self.guard_ops and scope["path"] in OPS_PATHS:
            auth = dict(scope.get("headers") or ()).get(b"authorization", b"").decode("latin-1")
            if not key_ok(st.settings.api_key, auth):
                st.metrics.refused(401)
                body = error_body(401, "invalid API key", code="invalid_api_key")
                return await JSONResponse(body, status_code=401)(scope, receive, send)

        async def send_closing(message: Dict[str, Any]) -> None:
            if message["type"] == "http.response.start" and st.draining:
                message = {**message, "headers": [*message.get("headers", ()), (b"connection", b"close")]}
            await send(message)

        st.active_requests += 1
        try:
            await self.app(scope, receive, send_closing)
        finally:
            st.active_requests -= 1


# ---------------------------------------------------------------------------------------------
# The app

@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    st: ServerState = app.state.server
    loop = asyncio.get_running_loop()
    threading.Thread(target=app.state.load, args=(st, loop), name="candle-gate-load", daemon=True).start()
    if st.settings.ready_before_serving:
        await loop.run_in_executor(None, st.loaded.wait)
        if st.load_error is not None:
            raise RuntimeError(f"could not load the model: {st.load_error}")
    yield
    # Shutdown: uvicorn has waited for the connections (up to --drain-timeout); whatever is still
    # running is cancelled, then the engine thread stops.
    st.draining = True
    if st.worker is not None:
        st.worker.shutdown()


def create_app(settings: Settings, load: Optional[Loader] = None) -> FastAPI:
    """The app serving ``settings.model``; ``load`` (default :meth:`ServerState.load`) is how the
    model and the engine thread come to the state (a test passes a fake)."""
    st = ServerState(settings)
    app = FastAPI(title="candle-gate", version=_native.__version__, lifespan=lifespan,
                  description="An OpenAI-compatible server over one candle-gate engine (docs/SERVER.md).")
    app.state.server = st
    app.state.load = load or ServerState.load
    app.state.serving_completion = OpenAIServingCompletion(st)
    app.state.serving_chat = OpenAIServingChat(st)
    app.state.serving_tokenization = OpenAIServingTokenization(st)
    app.include_router(router)
    if settings.replica is not None:
        replica = settings.replica
        st.metrics.name_replica(replica)

        @app.middleware("http")
        async def name_the_replica(request: Request, call_next: Callable[[Request], Any]) -> Any:
            response = await call_next(request)
            response.headers[REPLICA_HEADER] = replica
            return response
    app.add_middleware(Door, st=st)  # (added last: the outermost)
    app.add_exception_handler(APIError, on_api_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, on_validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, on_http_error)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, on_internal_error)

    def openapi() -> Dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        doc = openapi_document(app, bool(settings.api_key), st.model_name,
                               ops_keyed=bool(settings.api_key) and settings.api_key_scope == "all")
        if st.ready:  # (before, the served name is not known yet)
            app.openapi_schema = doc
        return doc

    app.openapi = openapi  # type: ignore[method-assign]
    return app


# ---------------------------------------------------------------------------------------------
# Running it

def uvicorn_config(app: FastAPI, s: Settings) -> Any:
    """uvicorn's configuration for ``app`` under ``s``, with :func:`timed_head_protocol`."""
    import uvicorn
    return uvicorn.Config(app, host=s.host, port=s.port, log_level=s.log_level, http=timed_head_protocol(s.read_timeout),
                          timeout_graceful_shutdown=s.drain_timeout, access_log=s.access_log)


#: what a connection whose request head did not arrive in time gets, before it is closed
_HEAD_TIMEOUT_RESPONSE = (b"HTTP/1.1 408 Request Timeout\r\nContent-Type: application/json\r\nConnection: close\r\n"
                          b"Content-Length: %d\r\n\r\n%s")


def timed_head_protocol(timeout: float) -> type:
    """uvicorn's HTTP protocol (httptools where installed, else h11: its "auto") with a bound on
    the time a request's head (the request line and headers) takes to arrive, from the
    connection or from the first byte of a kept-alive connection's next request: past
    ``timeout`` seconds it gets 408 and its connection is closed. uvicorn has no such bound (a
    client trickling its headers holds a connection for ever); the body has its own, in the app
    (``protocol.read_body``). A head is complete when uvicorn made the request's cycle."""
    import json
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    body = json.dumps(error_body(408, f"the request head did not arrive within {timeout:g} s",
                                 code="read_timeout")).encode()

    class TimedHeadProtocol(AutoHTTPProtocol):  # type: ignore[valid-type, misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._head_timer: Any = None
            self._head_cycle: Any = None

        def _arm(self) -> None:
            self._head_cycle = self.cycle
            self._head_timer = self.loop.call_later(timeout, self._head_timed_out)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timed_out(self) -> None:
            self._head_timer = None
            if self.cycle is self._head_cycle and not self.transport.is_closing():
                self.transport.write(_HEAD_TIMEOUT_RESPONSE % (len(body), body))
                self.transport.close()

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self._head_timer is None and (self.cycle is None or self.cycle.response_complete):
                self._arm()  # a kept-alive connection's next request begins
            super().data_received(data)
            if self._head_timer is not None and self.cycle is not self._head_cycle:
                self._disarm()  # its head is in

        def connection_lost(self, exc: Optional[Exception]) -> None:
            self._disarm()
            super().connection_lost(exc)

    return TimedHeadProtocol


def serve(settings: Settings) -> int:
    """``candle-gate serve``: the app under uvicorn until SIGTERM or Ctrl-C (docs/SERVER.md,
    "Cancellation and shutdown"); 0 once drained, 1 when the model cannot be loaded."""
    import uvicorn

    app = create_app(settings)
    st: ServerState = app.state.server
    s = settings

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            # The first signal stops admitting (503, with Connection: close) while the requests in
            # flight finish, still listening, so that a client on a kept-alive connection gets
            # its 503 rather than a closed connection; then uvicorn stops listening and waits
            # for what is left, up to --drain-timeout in all. A second signal ends the wait
            # (Ctrl-C: at once). Exit 0 afterwards: uvicorn would re-raise the signal at the end,
            # so it is not recorded as captured.
            if st.draining:
                if sig == signal.SIGINT:
                    self.force_exit = True
                self.should_exit = True
                return
            st.draining = True
            threading.Thread(target=self.drain, name="candle-gate-drain", daemon=True).start()

        def drain(self) -> None:
            deadline = time.monotonic() + s.drain_timeout
            while st.active_requests > 0 and time.monotonic() < deadline and not self.should_exit:
                time.sleep(0.05)
            self.config.timeout_graceful_shutdown = max(int(deadline - time.monotonic()), 1)
            self.should_exit = True

    def stop_if_the_model_fails() -> None:
        st.loaded.wait()
        if st.load_error is not None:  # (said by the loader) exit non-zero, not a server answering 503
            server.should_exit = True

    print(f"candle-gate serve: loading {s.model} on http://{s.host}:{s.port}", flush=True)
    server = Server(uvicorn_config(app, s))
    threading.Thread(target=stop_if_the_model_fails, name="candle-gate-load-watch", daemon=True).start()
    server.run()
    return 1 if st.load_error is not None else 0
