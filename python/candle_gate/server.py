"""An OpenAI-compatible HTTP server over one :class:`~candle_gate.Engine` (``candle-gate serve``).

One dedicated engine thread runs ``step()`` while there is work and otherwise sleeps on a
``threading.Event`` that a submit or a cancel sets. After each step it drains the engine's events
and hands them, grouped per request, to the asyncio loop with ``loop.call_soon_threadsafe`` into
each request's ``asyncio.Queue``; the HTTP side only awaits its queue. ``docs/SERVER.md``
describes the endpoints, the fields, the errors, ``system_fingerprint`` and the metrics.
"""
from __future__ import annotations

import asyncio
import bisect
import hashlib
import hmac
import json
import math
import secrets
import signal
import sys
import threading
import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Annotated, Any, Dict, List, Literal, Optional, Tuple, Union

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError, model_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from . import _native
from .engine import Engine, Model, SamplingParams

# ---------------------------------------------------------------------------------------------
# Errors in OpenAI's shape

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                413: "invalid_request_error", 429: "rate_limit_error", 500: "internal_error",
                503: "service_unavailable"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 headers: Optional[Dict[str, str]] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers


def error_body(status: int, message: str, param: Optional[str] = None, code: Optional[str] = None) -> Dict[str, Any]:
    return {"error": {"message": message, "type": _ERROR_TYPES.get(status, "error"), "param": param, "code": code}}


def _param_of(msg: str) -> Optional[str]:
    """The sampling parameter an engine error names (its messages start with the name)."""
    word = msg.split(" ", 1)[0]
    return word if word.isidentifier() else None


# ---------------------------------------------------------------------------------------------
# Request models (strict: a string is not a number; unknown fields are ignored)

_U64 = 2 ** 64 - 1
_I64 = 2 ** 63 - 1
#: the engine's limit on max_new_tokens (it stops at the end of the context anyway)
_MAX_NEW_TOKENS = 1 << 20
_StopStr = Annotated[str, StringConstraints(min_length=1)]
StopT = Union[_StopStr, Annotated[List[_StopStr], Field(max_length=16)], None]

# The bounds below are the engine's own (SamplingParams checks them too): declared here so that
# the OpenAPI document describes what the server accepts, and refused with the field's name.


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: Optional[bool] = None


class _Req(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    model: Optional[str] = None
    max_tokens: Optional[Annotated[int, Field(ge=1, le=_MAX_NEW_TOKENS)]] = None
    stop: StopT = None
    #: default 1.0 when omitted, as OpenAI; 0 is greedy
    temperature: Optional[Annotated[float, Field(ge=0, allow_inf_nan=False)]] = None
    top_p: Optional[Annotated[float, Field(gt=0, le=1)]] = None
    top_k: Optional[Annotated[int, Field(ge=0, le=_I64)]] = None
    min_p: Optional[Annotated[float, Field(ge=0, le=1)]] = None
    seed: Optional[Annotated[int, Field(ge=0, le=_U64)]] = None
    n: Optional[Annotated[int, Field(ge=1, le=64)]] = None
    presence_penalty: Optional[Annotated[float, Field(ge=-2, le=2)]] = None
    frequency_penalty: Optional[Annotated[float, Field(ge=-2, le=2)]] = None
    repetition_penalty: Optional[Annotated[float, Field(gt=0, le=10)]] = None
    user: Optional[str] = None
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    #: extension: per choice ``margins`` and ``rechecked`` lists
    return_margins: Optional[bool] = False


_TokenIds = Annotated[List[Annotated[int, Field(ge=0, le=_I64)]], Field(min_length=1)]


class CompletionRequest(_Req):
    #: a string, a list of token ids, or a list of one string
    prompt: Union[Annotated[str, StringConstraints(min_length=1)], _TokenIds,
                  Annotated[List[Annotated[str, StringConstraints(min_length=1)]], Field(min_length=1, max_length=1)]]
    #: the number of alternatives per token (0: only the chosen token's logprob)
    logprobs: Optional[Annotated[int, Field(ge=0, le=20)]] = None
    echo: Optional[bool] = False


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """A message as the chat template receives it: other keys (``name``, ...) are passed through;
    ``content`` may be null only with ``tool_calls`` (and then the model's template decides)."""
    model_config = ConfigDict(extra="allow", strict=True, json_schema_extra={"anyOf": [
        {"properties": {"content": {"type": ["string", "array"]}}},
        {"required": ["tool_calls"], "properties": {"tool_calls": {"type": "array"}}}]})
    role: str
    content: Union[str, List[ContentPart], None]
    tool_calls: Optional[List[Dict[str, Any]]] = None

    @model_validator(mode="after")
    def _content_or_tool_calls(self) -> "ChatMessage":
        if self.content is None and self.tool_calls is None:
            raise ValueError("content may be null only with tool_calls")
        return self


class ChatCompletionRequest(_Req):
    messages: Annotated[List[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Optional[Annotated[int, Field(ge=1, le=_MAX_NEW_TOKENS)]] = None
    logprobs: Optional[bool] = False
    top_logprobs: Optional[Annotated[int, Field(ge=0, le=20)]] = None
    tools: Optional[List[Dict[str, Any]]] = None


class TokenizeRequest(BaseModel):
    """``prompt`` (a string) or ``messages``."""
    model_config = ConfigDict(extra="ignore", strict=True)
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[List[ChatMessage]] = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    model: Optional[str] = None
    tokens: List[Annotated[int, Field(ge=0, le=_I64)]]


# ---------------------------------------------------------------------------------------------
# Response models (documentation: the handlers build plain dicts in these shapes)

class ErrorDetail(BaseModel):
    message: str
    type: str
    param: Optional[str]
    code: Optional[str]


class ErrorResponse(BaseModel):
    """OpenAI's error object."""
    error: ErrorDetail


class PromptTokensDetails(BaseModel):
    #: prompt tokens whose K/V came from the prefix cache
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: Optional[PromptTokensDetails] = None


class _ChoiceExt(BaseModel):
    index: int
    finish_reason: _Finish
    #: extension: the engine's output fingerprint of the choice (32 hex)
    fingerprint: str
    #: extension: the seed the choice's draws were keyed by
    seed: int
    #: extension, with ``return_margins``: the gate's per-step margin (null where not finite)
    margins: Optional[List[Optional[float]]] = None
    #: extension, with ``return_margins``: 1 where the step was rechecked
    rechecked: Optional[List[int]] = None


class CompletionLogprobs(BaseModel):
    tokens: List[str]
    token_logprobs: List[float]
    top_logprobs: List[Dict[str, float]]
    text_offset: List[int]


class CompletionChoice(_ChoiceExt):
    text: str
    logprobs: Optional[CompletionLogprobs]


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    system_fingerprint: str
    choices: List[CompletionChoice]
    usage: Usage


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: List[int]


class ChatLogprob(TopLogprob):
    top_logprobs: List[TopLogprob]


class ChatChoiceLogprobs(BaseModel):
    content: List[ChatLogprob]


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class ChatChoice(_ChoiceExt):
    message: AssistantMessage
    logprobs: Optional[ChatChoiceLogprobs]


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    system_fingerprint: str
    choices: List[ChatChoice]
    usage: Usage


_Finish = Literal["stop", "length", "cancelled", "error"]


class _StreamExt(BaseModel):
    index: int
    #: set on a choice's finish chunk, with the extensions below
    finish_reason: Optional[_Finish]
    fingerprint: Optional[str] = None
    seed: Optional[int] = None
    margins: Optional[List[Optional[float]]] = None
    rechecked: Optional[List[int]] = None


class CompletionStreamChoice(_StreamExt):
    text: str
    logprobs: Optional[CompletionLogprobs]


class CompletionChunk(BaseModel):
    """One streamed event's data (``stream: true``)."""
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    system_fingerprint: str
    #: empty in the last chunk of ``stream_options.include_usage``
    choices: List[CompletionStreamChoice]
    #: with ``stream_options.include_usage``: null, and the usage in the last chunk
    usage: Optional[Usage] = None


class ChatDelta(BaseModel):
    role: Optional[Literal["assistant"]] = None
    content: Optional[str] = None


class ChatStreamChoice(_StreamExt):
    delta: ChatDelta
    logprobs: Optional[ChatChoiceLogprobs]


class ChatCompletionChunk(BaseModel):
    """One streamed event's data (``stream: true``)."""
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    system_fingerprint: str
    choices: List[ChatStreamChoice]
    usage: Optional[Usage] = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    #: the GGUF path (in the list)
    root: Optional[str] = None
    #: the context the server allows (prompt + new tokens)
    max_model_len: Optional[int] = None


class ModelList(BaseModel):
    object: Literal["list"]
    data: List[ModelCard]


class TokenizeResponse(BaseModel):
    tokens: List[int]
    count: int
    max_model_len: int


class DetokenizeResponse(BaseModel):
    prompt: str


class HealthResponse(BaseModel):
    status: Literal["ok", "loading", "error", "draining"]
    model: Optional[str] = None
    error: Optional[str] = None


_UNION_TAGS = {"str", "int", "float", "bool", "none"}


def _clean_loc(loc: Tuple[Any, ...]) -> str:
    """A field's path without pydantic's union member tags (``constrained-str``, ``list[int]``)."""
    return ".".join(str(x) for x in loc
                    if not (isinstance(x, str) and (x in _UNION_TAGS or "[" in x or "-" in x)))


def _validation_message(e: ValidationError) -> Tuple[str, Optional[str]]:
    errs = e.errors()
    err = errs[0]
    if err.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {err.get('ctx', {}).get('error', err.get('msg'))}", None
    if not err.get("loc"):
        return str(err.get("msg")), None
    # A union reports each alternative: say them all (the first element names the field).
    param = str(err["loc"][0])
    parts: List[str] = []
    for x in errs:
        if x.get("loc") and x["loc"][0] == err["loc"][0]:
            m = f"{_clean_loc(x['loc'])}: {x.get('msg')}"
            if m not in parts:
                parts.append(m)
    return "; or ".join(parts[:4]), param


#: The largest request body read. A whole context of token ids as JSON is far below it; a body
#: above it is refused (413) without being read into memory.
MAX_BODY_BYTES = 8 << 20


async def _read_body(request: Any) -> bytes:
    too_big = f"the request body is larger than {MAX_BODY_BYTES} bytes"
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise APIError(413, too_big)
    parts, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise APIError(413, too_big)
        parts.append(chunk)
    return b"".join(parts)


def _parse(cls: type, raw: bytes) -> Any:
    if not raw.strip():
        raise APIError(400, "the request body is empty; expected a JSON object")
    try:
        return cls.model_validate_json(raw)
    except ValidationError as e:
        msg, param = _validation_message(e)
        raise APIError(400, msg, param) from None


# ---------------------------------------------------------------------------------------------
# Metrics (Prometheus text format, written here)

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0)


class Histogram:
    def __init__(self, buckets: Tuple[float, ...] = _LATENCY_BUCKETS):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, v)] += 1
        self.sum += v
        self.count += 1

    def lines(self, name: str, labels: str) -> List[str]:
        out, acc = [], 0
        for b, c in zip(self.buckets, self.counts):
            acc += c
            out.append(f'{name}_bucket{{{labels},le="{b}"}} {acc}')
        out.append(f'{name}_bucket{{{labels},le="+Inf"}} {self.count}')
        out.append(f"{name}_sum{{{labels}}} {self.sum}")
        out.append(f"{name}_count{{{labels}}} {self.count}")
        return out


class Metrics:
    def __init__(self) -> None:
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.success: Dict[str, int] = {}
        self.errors: Dict[str, int] = {}
        self.ttft = Histogram()
        self.itl = Histogram()
        self.e2e = Histogram()


# ---------------------------------------------------------------------------------------------
# The engine thread

class QueueFull(Exception):
    pass


class _Track:
    __slots__ = ("queue", "n", "finished")

    def __init__(self, queue: asyncio.Queue, n: int):
        self.queue, self.n, self.finished = queue, n, 0


class EngineWorker:
    """Owns the stepping of ``eng``; requests register an asyncio.Queue that receives, per step,
    a list of that request's events, and at the end ``("done", Result)`` (or ``("error", msg)``)."""

    def __init__(self, eng: Engine, loop: asyncio.AbstractEventLoop, on_done: Any = None):
        self.eng = eng
        self.loop = loop
        self.on_done = on_done  # called on the loop with each finished Result (metrics)
        self.wake = threading.Event()
        self.lock = threading.Lock()  # guards `tracks`; never held across a step
        self.tracks: Dict[int, _Track] = {}
        self.stopping = False
        # The native getters take the engine's mutex while holding the GIL, so only this thread
        # (which never steps concurrently with itself) reads them; others read these copies.
        self.num_running = 0
        self.num_waiting = 0
        self.submitted_since_refresh = 0
        #: the KV pool and the prefix cache's counters (``Engine.kv_stats``, as of the last step)
        self.kv_stats: Dict[str, int] = eng.kv_stats()
        self.gate_stats: Dict[str, int] = {"steps": 0, "rechecks": 0, "corrections": 0, "deep_rechecks": 0}
        self.thread = threading.Thread(target=self._run, name="candle-gate-engine", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopping = True
        self.wake.set()
        self.thread.join(timeout=10)

    def submit(self, ids: List[int], params: SamplingParams, queue: asyncio.Queue, max_queue: int) -> int:
        """Blocking (waits for the engine's mutex while a step runs): call it in an executor."""
        with self.lock:
            if self.num_waiting + self.submitted_since_refresh >= max_queue:
                raise QueueFull()
            rid = self.eng.submit(ids, params=params)
            self.tracks[rid] = _Track(queue, params.n)
            self.submitted_since_refresh += 1
        self.wake.set()
        return rid

    def cancel(self, rid: int) -> None:
        with self.lock:
            live = rid in self.tracks
        if live:
            self.eng.cancel(rid)
            self.wake.set()  # its finished events are drained by the engine thread

    def _deliver(self, batch: List[Tuple[asyncio.Queue, List[Any]]]) -> None:
        for q, items in batch:
            q.put_nowait(items)
            last = items[-1]
            if self.on_done is not None and isinstance(last, tuple) and last[0] == "done":
                self.on_done(last[1])

    def _drain(self) -> None:
        events = self.eng.events()
        if not events:
            return
        per: Dict[int, List[Any]] = {}
        with self.lock:
            for ev in events:
                rid = ev["id"]
                tr = self.tracks.get(rid)
                if tr is None:
                    continue
                items = per.setdefault(rid, [])
                items.append(ev)
                if ev["type"] == "finished":
                    tr.finished += 1
                    if tr.finished >= tr.n:
                        res = self.eng.result(rid)
                        items.append(("done", res))
            batch = [(self.tracks[rid].queue, items) for rid, items in per.items()]
            for rid, items in per.items():
                if isinstance(items[-1], tuple):
                    del self.tracks[rid]
        self._post(batch)

    def _post(self, batch: List[Tuple[asyncio.Queue, List[Any]]]) -> None:
        try:
            self.loop.call_soon_threadsafe(self._deliver, batch)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            pass

    def _refresh(self) -> None:
        with self.lock:
            self.num_running, self.num_waiting = self.eng.num_running, self.eng.num_waiting
            self.submitted_since_refresh = 0
        self.kv_stats = self.eng.kv_stats()
        self.gate_stats = self.eng.gate_stats()

    def _fail_all(self, msg: str) -> None:
        with self.lock:
            batch = [(tr.queue, [("error", msg)]) for tr in self.tracks.values()]
            rids = list(self.tracks)
            self.tracks.clear()
        for rid in rids:
            try:
                self.eng.cancel(rid)
            except Exception:
                pass
        self._post(batch)

    def _run(self) -> None:
        while not self.stopping:
            self.wake.clear()
            try:
                self._drain()
                if self.eng.has_work:
                    self.eng.step()
                    # the counts first: a client that got its answer and reads /metrics at once
                    # sees the state after the step that finished it
                    self._refresh()
                    self._drain()
                    continue
                self._refresh()
            except Exception as e:  # an engine failure fails the requests in flight, not the server
                print(f"candle-gate serve: engine error: {e}", file=sys.stderr, flush=True)
                self._fail_all(f"engine error: {e}")
                continue
            self.wake.wait()
        try:
            self._drain()
        except Exception:
            pass


# ---------------------------------------------------------------------------------------------
# The server state

FINISH = {"eos": "stop", "stop": "stop", "length": "length", "context_full": "length"}


def finish_reason(r: str) -> str:
    return FINISH.get(r, r)


class ServerState:
    def __init__(self, args: Any):
        self.args = args
        self.model: Optional[Model] = None
        self.eng: Optional[Engine] = None
        self.worker: Optional[EngineWorker] = None
        self.model_name = ""
        self.model_aliases: set = set()
        self.system_fingerprint = ""
        self.ready = False
        self.draining = False
        self.load_error: Optional[str] = None
        self.metrics = Metrics()
        self.created = int(time.time())
        self._tok_str: Dict[int, str] = {}
        self.in_flight = 0
        #: the context a request may use (prompt + new tokens): the model's, or less with
        #: ``args.max_model_len``
        self.max_model_len = 0

    def load(self, loop: asyncio.AbstractEventLoop) -> None:
        from .models import KNOWN_MODELS
        a = self.args
        try:
            self.model = Model.load(a.model, mode=a.mode, profile=a.profile)
            self.eng = Engine(self.model, gate=a.gate, tau=a.tau, deep_tau=a.deep_tau, profile=a.profile,
                              max_num_seqs=a.max_num_seqs, threads=a.threads, kv_dtype=a.kv_dtype,
                              prefill_chunk=a.prefill_chunk, max_tokens_per_step=a.max_num_batched_tokens,
                              kv_budget_tokens=a.kv_budget_tokens, enable_prefix_caching=not a.no_prefix_cache)
        except Exception as e:
            self.load_error = str(e)
            print(f"candle-gate serve: error: could not load the model: {e}", file=sys.stderr, flush=True)
            return
        ctx = int(self.model.config.get("context_length", 0) or 0)
        cap = getattr(a, "max_model_len", None)
        self.max_model_len = min(ctx, int(cap)) if cap and ctx else int(cap or ctx)
        path = self.model.path
        stem = Path(path).stem
        self.model_name = a.served_model_name or (a.model if a.model in KNOWN_MODELS else stem)
        self.model_aliases = {self.model_name, stem, Path(path).name, path, str(a.model)}
        stack = "\n".join([self.model.sha256(), _native.__version__, self.eng.kernels, self.eng.gate,
                           _native.host_signature(a.mode)])
        self.system_fingerprint = "fp_" + hashlib.sha256(stack.encode()).hexdigest()[:16]
        self.worker = EngineWorker(self.eng, loop, self._count_finished)
        self.worker.start()
        self.ready = True
        print(f"candle-gate serve: model {self.model_name} ({path}, mode {a.mode}, gate {a.gate}) "
              f"at http://{a.host}:{a.port}/v1 (system_fingerprint {self.system_fingerprint})", flush=True)
        if self.eng.gate_source:
            print(f"candle-gate serve: gate tau {self.eng.tau:.4g}, deep_tau {self.eng.deep_tau:.4g} "
                  f"from {self.eng.gate_source}", flush=True)

    def _count_finished(self, res: Any) -> None:
        s = self.metrics.success
        for c in res.choices:
            r = finish_reason(c.finish_reason)
            s[r] = s.get(r, 0) + 1

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

    def token_str(self, tid: int) -> str:
        s = self._tok_str.get(tid)
        if s is None:
            s = self.model.detokenize([tid])
            self._tok_str[tid] = s
        return s


# ---------------------------------------------------------------------------------------------
# Building requests

def _sampling(st: ServerState, req: _Req, prompt_len: int, max_tokens: Optional[int],
              logprobs: bool, top_logprobs: int, prompt_param: str = "prompt") -> SamplingParams:
    ctx = st.max_model_len
    if ctx and prompt_len >= ctx:
        raise APIError(400, f"the prompt has {prompt_len} tokens but the context holds {ctx} "
                            f"(including at least one new token)", prompt_param)
    if max_tokens is None:
        max_tokens = ctx - prompt_len if ctx else 256
    elif ctx:
        # the engine would stop at the end of the context anyway (finish_reason "length")
        max_tokens = min(max_tokens, ctx - prompt_len)
    kw: Dict[str, Any] = dict(
        max_new_tokens=max_tokens,
        stop=req.stop,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=0 if req.top_k is None else req.top_k,
        min_p=0.0 if req.min_p is None else req.min_p,
        presence_penalty=0.0 if req.presence_penalty is None else req.presence_penalty,
        frequency_penalty=0.0 if req.frequency_penalty is None else req.frequency_penalty,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        seed=req.seed,
        n=1 if req.n is None else req.n,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
    )
    try:
        return SamplingParams(**kw)
    except (ValueError, TypeError, OverflowError) as e:
        msg = str(e)
        param = _param_of(msg)
        if param == "max_new_tokens":
            param = "max_tokens"
        raise APIError(400, msg, param) from None


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone away. The body has been read, so the next ASGI message
    is ``http.disconnect`` (uvicorn sends it when the connection closes): no polling."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _content_text(content: Any) -> Any:
    """OpenAI's content parts (``[{"type": "text", "text": ...}]``) as one string."""
    if isinstance(content, list):
        parts = []
        for p in content:
            if not (isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)):
                raise APIError(400, "only text content parts are supported", "messages")
            parts.append(p["text"])
        return "".join(parts)
    return content


def _messages(msgs: List[ChatMessage]) -> List[Dict[str, Any]]:
    """The messages as the template receives them: the keys that were sent, content parts joined."""
    out = []
    for m in msgs:
        d = m.model_dump(exclude_unset=True)
        if "content" in d:
            d["content"] = _content_text(d["content"])
        out.append(d)
    return out


async def _submit(st: ServerState, ids: List[int], params: SamplingParams) -> Tuple[int, asyncio.Queue]:
    loop = asyncio.get_running_loop()
    q: asyncio.Queue = asyncio.Queue()
    try:
        rid = await loop.run_in_executor(None, st.worker.submit, ids, params, q, st.args.max_queue)
    except QueueFull:
        raise APIError(429, f"the queue is full ({st.args.max_queue} requests waiting); retry later",
                       code="queue_full", headers={"Retry-After": "1"}) from None
    except (ValueError, TypeError, OverflowError) as e:
        msg = str(e)
        param = "prompt" if "prompt" in msg or "token id" in msg else _param_of(msg)
        raise APIError(400, msg, param) from None
    except _native.CandleGateError as e:
        msg = str(e)
        if "shut" in msg:
            raise APIError(503, msg, code="shutting_down") from None
        raise APIError(400, msg) from None
    st.metrics.prompt_tokens += len(ids)
    return rid, q


class _Timing:
    def __init__(self, st: ServerState, t0: float):
        self.st, self.t0, self.last = st, t0, None

    def tokens(self, k: int) -> None:
        if k <= 0:
            return
        now = time.perf_counter()
        m = self.st.metrics
        m.generation_tokens += k
        if self.last is None:
            m.ttft.observe(now - self.t0)
            k -= 1
        else:
            m.itl.observe(now - self.last)
            k -= 1
        for _ in range(k):  # tokens delivered in the same step
            m.itl.observe(0.0)
        self.last = now

    def done(self) -> None:
        self.st.metrics.e2e.observe(time.perf_counter() - self.t0)


def _chat_logprob_entry(st: ServerState, tid: int, lp: float, top_ids: Any, top_lps: Any) -> Dict[str, Any]:
    s = st.token_str(int(tid))
    return {"token": s, "logprob": float(lp), "bytes": list(s.encode("utf-8")),
            "top_logprobs": [{"token": st.token_str(int(t)), "logprob": float(l),
                              "bytes": list(st.token_str(int(t)).encode("utf-8"))}
                             for t, l in zip(top_ids, top_lps)]}


def _completion_logprobs(st: ServerState, ids: Any, lps: Any, top_ids: Any, top_lps: Any,
                         offset0: int = 0) -> Dict[str, Any]:
    tokens, offsets, tops = [], [], []
    off = offset0
    for i, tid in enumerate(ids):
        s = st.token_str(int(tid))
        tokens.append(s)
        offsets.append(off)
        off += len(s)
        row = {}
        if top_ids is not None and len(top_ids) > i:
            for t, l in zip(top_ids[i], top_lps[i]):
                row[st.token_str(int(t))] = float(l)
        tops.append(row)
    return {"tokens": tokens, "token_logprobs": [float(x) for x in lps], "top_logprobs": tops,
            "text_offset": offsets}


def _extensions(c: Any, return_margins: bool) -> Dict[str, Any]:
    out = {"fingerprint": c.fingerprint, "seed": int(c.seed)}
    if return_margins:
        out["margins"] = [float(m) if math.isfinite(float(m)) else None for m in c.margins]
        out["rechecked"] = [int(x) for x in c.rechecked]
    return out


def _usage(res: Any) -> Dict[str, int]:
    comp = sum(len(c.token_ids) for c in res.choices)
    return {"prompt_tokens": int(res.prompt_tokens), "completion_tokens": comp,
            "total_tokens": int(res.prompt_tokens) + comp,
            "prompt_tokens_details": {"cached_tokens": int(res.cached_tokens)}}


# ---------------------------------------------------------------------------------------------
# The OpenAPI document

_ERROR_DESCRIPTIONS = {
    400: "an invalid request: malformed JSON, wrong types, values out of range, a prompt longer than the context",
    401: "`--api-key` is set and the Bearer key is missing or wrong",
    404: "an unknown model",
    413: f"the request body is larger than {MAX_BODY_BYTES} bytes",
    429: "the waiting queue is full; retry after `Retry-After` seconds",
    500: "an engine failure (the server keeps serving)",
    503: "the model is loading, or the server is shutting down",
}
_REQUEST_MODELS = (CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest)
_STREAM_MODELS = (CompletionChunk, ChatCompletionChunk)


def _sse(chunk: type) -> Dict[str, Any]:
    """``text/event-stream``: the schema describes each event (Open API 3.1 has no ``itemSchema``):
    its ``data`` is a JSON chunk (or an error object), and the last one ``[DONE]``."""
    ref = lambda m: {"$ref": f"#/components/schemas/{m}"}  # noqa: E731
    return {"text/event-stream": {"schema": {
        "type": "object", "required": ["data"],
        "description": "one server-sent event, `data: {chunk}`; the last is `data: [DONE]`",
        "properties": {"data": {
            "type": "string",
            "if": {"const": "[DONE]"},
            "else": {"contentMediaType": "application/json",
                     "contentSchema": {"anyOf": [ref(chunk.__name__), ref("ErrorResponse")]}}}}}}}


def _errors(*codes: int) -> Dict[int, Dict[str, Any]]:
    out: Dict[int, Dict[str, Any]] = {}
    for c in codes:
        out[c] = {"model": ErrorResponse, "description": _ERROR_DESCRIPTIONS[c]}
        if c == 429:
            out[c]["headers"] = {"Retry-After": {"description": "seconds", "schema": {"type": "integer"}}}
    return out


def _body(model: type) -> Dict[str, Any]:
    """The request body of an endpoint that parses it itself (strictly, with ``model``)."""
    return {"requestBody": {"required": True, "content": {
        "application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


def _openapi_document(app: Any, keyed: bool, model_name: str) -> Dict[str, Any]:
    from fastapi.openapi.utils import get_openapi
    from pydantic.json_schema import models_json_schema

    doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    _, defs = models_json_schema([(m, "validation") for m in _REQUEST_MODELS + _STREAM_MODELS],
                                 ref_template="#/components/schemas/{model}")
    schemas.update(defs.get("$defs", {}))
    # FastAPI's 422 never reaches a client: validation errors are 400 in OpenAI's shape.
    schemas.pop("HTTPValidationError", None)
    schemas.pop("ValidationError", None)
    if keyed:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    for path, ops in doc.get("paths", {}).items():
        for op in ops.values():
            op.get("responses", {}).pop("422", None)
            for prm in op.get("parameters", ()):
                if path == "/v1/models/{name}" and prm.get("name") == "name" and model_name:
                    prm["schema"]["examples"] = [model_name]
            if keyed and (path.startswith("/v1/") or path in ("/tokenize", "/detokenize", "/reset_prefix_cache")):
                op["security"] = [{"bearer": []}]
    return doc


# ---------------------------------------------------------------------------------------------
# The app

def create_app(args: Any):
    st = ServerState(args)

    @asynccontextmanager
    async def lifespan(app: Any):
        loop = asyncio.get_running_loop()
        threading.Thread(target=st.load, args=(loop,), name="candle-gate-load", daemon=True).start()
        yield
        # Shutdown: uvicorn has waited for the connections (up to --drain-timeout); whatever is
        # still running is cancelled, then the engine thread stops.
        st.draining = True
        if st.eng is not None:
            try:
                st.eng.shutdown()
            except Exception:
                pass
        if st.worker is not None:
            with st.worker.lock:
                rids = list(st.worker.tracks)
            for rid in rids:
                st.worker.cancel(rid)
            st.worker.stop()

    app = FastAPI(title="candle-gate", version=_native.__version__, lifespan=lifespan,
                  description="An OpenAI-compatible server over one candle-gate engine (docs/SERVER.md).")
    app.state.server = st

    def openapi() -> Dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        doc = _openapi_document(app, bool(args.api_key), st.model_name)
        if st.ready:  # (before, the served name is not known yet)
            app.openapi_schema = doc
        return doc

    app.openapi = openapi  # type: ignore[method-assign]

    def err(e: APIError) -> JSONResponse:
        if e.status >= 400:
            st.metrics.errors[str(e.status)] = st.metrics.errors.get(str(e.status), 0) + 1
        return JSONResponse(error_body(e.status, e.message, e.param, e.code), status_code=e.status,
                            headers=e.headers)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return err(e)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError):
        errs = e.errors()
        first = errs[0] if errs else {}
        return err(APIError(400, f"{'.'.join(map(str, first.get('loc', ())))}: {first.get('msg', 'invalid request')}"))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException):
        return err(APIError(e.status_code, str(e.detail)))

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception):
        return err(APIError(500, f"internal error: {type(e).__name__}: {e}"))

    def auth(request: Request) -> None:
        key = args.api_key
        if not key:
            return
        h = request.headers.get("authorization", "")
        given = h[7:].strip() if h[:7].lower() == "bearer " else ""
        if not hmac.compare_digest(given.encode(), key.encode()):
            raise APIError(401, "invalid API key", code="invalid_api_key")

    @app.get("/health", responses={200: {"model": HealthResponse, "description": "ready"},
                                   503: {"model": HealthResponse, "description": "loading, failed to load, or draining"}})
    async def health():
        if st.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if not st.ready:
            return JSONResponse({"status": "loading" if st.load_error is None else "error",
                                 "error": st.load_error}, status_code=503)
        return {"status": "ok", "model": st.model_name}

    @app.get("/v1/models", responses={200: {"model": ModelList, "description": "the served model"},
                                       **_errors(401, 503)})
    async def models(request: Request):
        auth(request)
        st.check_ready()
        return {"object": "list", "data": [{
            "id": st.model_name, "object": "model", "created": st.created, "owned_by": "candle-gate",
            "root": st.model.path, "max_model_len": st.max_model_len}]}

    @app.get("/v1/models/{name:path}", responses={200: {"model": ModelCard, "description": "the served model"},
                                                   **_errors(401, 404, 503)})
    async def model_info(name: str, request: Request):
        auth(request)
        st.check_ready()
        st.check_model(name)
        return {"id": st.model_name, "object": "model", "created": st.created, "owned_by": "candle-gate"}

    @app.get("/metrics", response_class=PlainTextResponse,
             responses={200: {"description": "Prometheus text format 0.0.4",
                              "content": {"text/plain": {"schema": {"type": "string"}}}}})
    async def metrics():
        m = st.metrics
        running = waiting = 0
        kv = {"used": 0, "cached": 0, "free": 0, "total": 1, "prefix_queries": 0, "prefix_hits": 0, "preemptions": 0}
        gs = {"steps": 0, "rechecks": 0, "corrections": 0, "deep_rechecks": 0}
        if st.ready:
            w = st.worker
            running, waiting, gs = w.num_running, w.num_waiting + w.submitted_since_refresh, w.gate_stats
            kv = w.kv_stats
        lbl = f'model_name="{st.model_name}"'
        lines = [
            "# HELP candle_gate:num_requests_running Sequences in the running batch.",
            "# TYPE candle_gate:num_requests_running gauge",
            f"candle_gate:num_requests_running{{{lbl}}} {running}",
            "# HELP candle_gate:num_requests_waiting Sequences waiting to be scheduled.",
            "# TYPE candle_gate:num_requests_waiting gauge",
            f"candle_gate:num_requests_waiting{{{lbl}}} {waiting}",
            "# HELP candle_gate:kv_cache_usage_perc KV blocks held by running requests over the pool (1 = full).",
            "# TYPE candle_gate:kv_cache_usage_perc gauge",
            f"candle_gate:kv_cache_usage_perc{{{lbl}}} {kv['used'] / max(kv['total'], 1):.6g}",
        ]
        for k, help_ in (("used", "held by running requests"), ("cached", "kept for prefix hits, held by none"),
                         ("free", "free")):
            lines += [f"# HELP candle_gate:kv_cache_{k}_blocks KV blocks {help_}.",
                      f"# TYPE candle_gate:kv_cache_{k}_blocks gauge",
                      f"candle_gate:kv_cache_{k}_blocks{{{lbl}}} {kv[k]}"]
        for name, k, help_ in (("prefix_cache_queries", "prefix_queries", "Prompt tokens looked up in the prefix cache."),
                               ("prefix_cache_hits", "prefix_hits", "Prompt tokens found in the prefix cache."),
                               ("num_preemptions", "preemptions", "Requests preempted to free KV blocks.")):
            lines += [f"# HELP candle_gate:{name}_total {help_}", f"# TYPE candle_gate:{name}_total counter",
                      f"candle_gate:{name}_total{{{lbl}}} {kv[k]}"]
        lines += [
            "# HELP candle_gate:prompt_tokens_total Prompt tokens submitted.",
            "# TYPE candle_gate:prompt_tokens_total counter",
            f"candle_gate:prompt_tokens_total{{{lbl}}} {m.prompt_tokens}",
            "# HELP candle_gate:generation_tokens_total Tokens generated.",
            "# TYPE candle_gate:generation_tokens_total counter",
            f"candle_gate:generation_tokens_total{{{lbl}}} {m.generation_tokens}",
            "# HELP candle_gate:request_success_total Finished choices by finish reason.",
            "# TYPE candle_gate:request_success_total counter",
        ]
        for r in ("stop", "length", "cancelled", "error"):
            lines.append(f'candle_gate:request_success_total{{{lbl},finished_reason="{r}"}} {m.success.get(r, 0)}')
        lines += ["# HELP candle_gate:request_errors_total Requests refused, by HTTP status.",
                  "# TYPE candle_gate:request_errors_total counter"]
        for s in sorted(set(m.errors) | {"400", "401", "404", "429", "503"}):
            lines.append(f'candle_gate:request_errors_total{{{lbl},status="{s}"}} {m.errors.get(s, 0)}')
        for name, h, help_ in (("time_to_first_token_seconds", m.ttft, "Time to the first token."),
                               ("inter_token_latency_seconds", m.itl, "Time between tokens."),
                               ("e2e_request_latency_seconds", m.e2e, "Request latency, arrival to last token.")):
            lines += [f"# HELP candle_gate:{name} {help_}", f"# TYPE candle_gate:{name} histogram"]
            lines += h.lines(f"candle_gate:{name}", lbl)
        for k in ("steps", "rechecks", "corrections", "deep_rechecks"):
            lines += [f"# HELP candle_gate:gate_{k}_total The margin gate's {k.replace('_', ' ')}.",
                      f"# TYPE candle_gate:gate_{k}_total counter",
                      f"candle_gate:gate_{k}_total{{{lbl}}} {int(gs.get(k, 0))}"]
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    @app.post("/reset_prefix_cache", responses={200: {"description": "the prefix cache was emptied"},
                                                 **_errors(401, 503)})
    async def reset_prefix_cache(request: Request):
        """Forgets every cached prefix (vLLM's endpoint of the same name)."""
        auth(request)
        st.check_ready()
        def reset() -> None:
            st.eng.reset_prefix_cache()
            st.worker.kv_stats = st.eng.kv_stats()
        await asyncio.get_running_loop().run_in_executor(None, reset)
        return {"status": "ok"}

    @app.post("/tokenize", openapi_extra=_body(TokenizeRequest),
              responses={200: {"model": TokenizeResponse, "description": "the token ids"},
                         **_errors(400, 401, 404, 413, 503)})
    async def tokenize(request: Request):
        auth(request)
        st.check_ready()
        req = _parse(TokenizeRequest, await _read_body(request))
        st.check_model(req.model)
        try:
            if req.messages is not None:
                ids = st.model.encode_chat(_messages(req.messages))
            elif req.prompt is not None:
                ids = st.model.tokenize(req.prompt)
            else:
                raise APIError(400, "pass `prompt` (a string) or `messages`", "prompt")
        except (ValueError, TypeError, OverflowError) as e:
            raise APIError(400, str(e), "messages" if req.messages is not None else "prompt") from None
        return {"tokens": ids, "count": len(ids), "max_model_len": st.max_model_len}

    @app.post("/detokenize", openapi_extra=_body(DetokenizeRequest),
              responses={200: {"model": DetokenizeResponse, "description": "the text"},
                         **_errors(400, 401, 404, 413, 503)})
    async def detokenize(request: Request):
        auth(request)
        st.check_ready()
        req = _parse(DetokenizeRequest, await _read_body(request))
        st.check_model(req.model)
        vocab = int(st.model.config.get("vocab", 0) or 0)
        bad = [t for t in req.tokens if t < 0 or (vocab and t >= vocab)]
        if bad:
            raise APIError(400, f"token id {bad[0]} is outside the vocabulary of {vocab}", "tokens")
        try:
            return {"prompt": st.model.detokenize(req.tokens)}
        except (ValueError, TypeError, OverflowError) as e:
            raise APIError(400, str(e), "tokens") from None

    # -- generation ----------------------------------------------------------------------------

    async def run_request(request: Request, chat: bool):
        t0 = time.perf_counter()
        auth(request)
        st.check_ready()
        raw = await _read_body(request)
        req = _parse(ChatCompletionRequest if chat else CompletionRequest, raw)
        st.check_model(req.model)
        if chat:
            if not req.messages:
                raise APIError(400, "messages must hold at least one message", "messages")
            try:
                ids = st.model.encode_chat(_messages(req.messages), tools=req.tools)
            except (ValueError, TypeError, OverflowError) as e:
                raise APIError(400, str(e), "messages") from None
            max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
            want_lp = bool(req.logprobs)
            top = req.top_logprobs or 0
            if top and not want_lp:
                raise APIError(400, "top_logprobs needs logprobs=true", "top_logprobs")
        else:
            p = req.prompt
            if isinstance(p, list) and p and isinstance(p[0], str):
                if len(p) != 1:
                    raise APIError(400, "a list of several prompts is not supported; send one request per prompt",
                                   "prompt")
                p = p[0]
            try:
                ids = st.model.encode_prompt(p)
            except (ValueError, TypeError, OverflowError) as e:
                raise APIError(400, str(e), "prompt") from None
            max_tokens = 16 if req.max_tokens is None else req.max_tokens
            want_lp = req.logprobs is not None
            top = req.logprobs or 0
        params = _sampling(st, req, len(ids), max_tokens, want_lp, top, "messages" if chat else "prompt")
        rid, q = await _submit(st, ids, params)
        timing = _Timing(st, t0)
        rm = bool(req.return_margins)
        created = int(time.time())
        cid = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        head = {"id": cid, "object": "chat.completion" if chat else "text_completion", "created": created,
                "model": st.model_name, "system_fingerprint": st.system_fingerprint}
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(stream(rid, q, params.n, head, chat, want_lp, rm, include_usage, timing),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        res = None
        finished = False
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            while True:
                get = asyncio.ensure_future(q.get())
                await asyncio.wait((get, gone), return_when=asyncio.FIRST_COMPLETED)
                if not get.done():
                    # The client went away: cancel now (the KV is freed at once, the sequence
                    # leaves the batch within a step); nobody reads the response.
                    get.cancel()
                    return Response(status_code=499)
                items = get.result()
                k = 0
                for it in items:
                    if isinstance(it, tuple):
                        if it[0] == "error":
                            raise APIError(500, it[1], code="engine_error")
                        res = it[1]
                    elif it["type"] == "token":
                        k += 1
                timing.tokens(k)
                if res is not None:
                    finished = True
                    break
        finally:
            gone.cancel()
            if not finished:
                st.worker.cancel(rid)
        timing.done()
        choices = []
        for c in res.choices:
            if chat:
                ch: Dict[str, Any] = {"index": c.index, "message": {"role": "assistant", "content": c.text},
                                      "logprobs": None, "finish_reason": finish_reason(c.finish_reason)}
                if want_lp:
                    ch["logprobs"] = {"content": [
                        _chat_logprob_entry(st, t, l, c.top_logprob_ids[i] if top else (),
                                            c.top_logprobs[i] if top else ())
                        for i, (t, l) in enumerate(zip(c.token_ids, c.logprobs))]}
            else:
                ch = {"index": c.index, "text": c.text, "logprobs": None,
                      "finish_reason": finish_reason(c.finish_reason)}
                if want_lp:
                    ch["logprobs"] = _completion_logprobs(st, c.token_ids, c.logprobs,
                                                          c.top_logprob_ids if top else None, c.top_logprobs)
            ch.update(_extensions(c, rm))
            choices.append(ch)
        return {**head, "choices": choices, "usage": _usage(res)}

    async def stream(rid: int, q: asyncio.Queue, n: int, head: Dict[str, Any], chat: bool, want_lp: bool,
                     rm: bool, include_usage: bool, timing: _Timing):
        head = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}
        streamed = [""] * n
        offsets = [0] * n
        finished = False

        def chunk(choices: List[Dict[str, Any]], usage: Any = None) -> str:
            d = {**head, "choices": choices}
            if include_usage:
                d["usage"] = usage
            return "data: " + json.dumps(d, ensure_ascii=False, separators=(",", ":")) + "\n\n"

        def piece(i: int, text: str, ev: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
            lp = None
            if want_lp and ev is not None:
                tid = int(ev["token"])
                tops_i = ev.get("top_logprob_ids", ())
                tops_l = ev.get("top_logprobs", ())
                if chat:
                    lp = {"content": [_chat_logprob_entry(st, tid, ev["logprob"], tops_i, tops_l)]}
                else:
                    lp = _completion_logprobs(st, [tid], [ev["logprob"]], [tops_i], [tops_l], offsets[i])
                    offsets[i] += len(st.token_str(tid))
            if chat:
                return {"index": i, "delta": {"content": text}, "logprobs": lp, "finish_reason": None}
            return {"index": i, "text": text, "logprobs": lp, "finish_reason": None}

        try:
            if chat:
                yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None} for i in range(n)])
            while True:
                items = await q.get()
                out: List[Dict[str, Any]] = []
                res = None
                k = 0
                for it in items:
                    if isinstance(it, tuple):
                        if it[0] == "error":
                            finished = True
                            yield f"data: {json.dumps(error_body(500, it[1], code='engine_error'))}\n\n"
                            yield "data: [DONE]\n\n"
                            return
                        res = it[1]
                    elif it["type"] == "token":
                        k += 1
                        i = it["index"]
                        text = it["text"]
                        streamed[i] += text
                        if text or want_lp:
                            out.append(piece(i, text, it))
                timing.tokens(k)
                if out:
                    yield chunk(out)
                if res is not None:
                    finished = True
                    break
            timing.done()
            final = []
            for c in res.choices:
                i = c.index
                # The events' deltas hold back text that could start a stop string; the result's
                # text is the authority, so whatever it has beyond the deltas goes out here.
                if c.text.startswith(streamed[i]) and len(c.text) > len(streamed[i]):
                    final.append(piece(i, c.text[len(streamed[i]):]))
                end = ({"index": i, "delta": {}, "logprobs": None, "finish_reason": finish_reason(c.finish_reason)}
                       if chat else
                       {"index": i, "text": "", "logprobs": None, "finish_reason": finish_reason(c.finish_reason)})
                end.update(_extensions(c, rm))
                final.append(end)
            yield chunk(final)
            if include_usage:
                yield chunk([], _usage(res))
            yield "data: [DONE]\n\n"
        finally:
            if not finished:  # the client went away (or the task was cancelled): free the KV now
                st.worker.cancel(rid)

    @app.post("/v1/completions", openapi_extra=_body(CompletionRequest),
              responses={200: {"model": CompletionResponse, "content": _sse(CompletionChunk),
                               "description": "the completion (JSON), or with `stream` its chunks (SSE)"},
                         **_errors(400, 401, 404, 413, 429, 500, 503)})
    async def completions(request: Request):
        return await run_request(request, chat=False)

    @app.post("/v1/chat/completions", openapi_extra=_body(ChatCompletionRequest),
              responses={200: {"model": ChatCompletionResponse, "content": _sse(ChatCompletionChunk),
                               "description": "the chat completion (JSON), or with `stream` its chunks (SSE)"},
                         **_errors(400, 401, 404, 413, 429, 500, 503)})
    async def chat_completions(request: Request):
        return await run_request(request, chat=True)

    return app


# ---------------------------------------------------------------------------------------------
# Running it

def serve(args: Any) -> int:
    import uvicorn

    app = create_app(args)
    st: ServerState = app.state.server

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            # Stop admitting at once (503), let uvicorn drain the connections (up to
            # --drain-timeout), and exit 0 afterwards: uvicorn would re-raise the signal at the
            # end, so it is not recorded as captured.
            st.draining = True
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True
            else:
                self.should_exit = True

    print(f"candle-gate serve: loading {args.model} on http://{args.host}:{args.port}", flush=True)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=args.drain_timeout, access_log=args.access_log)
    Server(config).run()
    return 0
