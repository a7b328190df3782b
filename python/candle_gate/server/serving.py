"""What the two generation endpoints share: a request's way from its body to the engine and back.

:class:`OpenAIServing` runs one request: parse the body (``protocol.py``), turn it into token ids
and :class:`~candle_gate.SamplingParams` (the endpoint's :meth:`~OpenAIServing.prepare`), submit
it to the engine thread (``worker.py``) and then either wait for its ``Result`` or stream its
events as Server-Sent Events. ``serving_completion.py`` and ``serving_chat.py`` supply the
endpoint's shapes: its prompt, its choices, its streamed pieces, its logprobs.

The worker is anything with ``submit(ids, params, queue, max_queue) -> id`` (blocking; it
delivers lists of events into ``queue`` on the event loop, as :class:`~.worker.EngineWorker`
does) and ``cancel(id)``: tests/server/test_serving.py drives this module with a fake one.
"""
from __future__ import annotations

import asyncio
import json
import math
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Dict, List, Optional, Tuple, Union

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from ..engine import SamplingParams
from .errors import ENGINE_REFUSALS, APIError, engine_error, error_body, request_field
from .metrics import Timing
from .protocol import finish_reason, parse, read_body
from .state import ServerState
from .worker import QueueFull

#: a request's ``max_tokens`` when it gives none and the context is unknown
DEFAULT_MAX_TOKENS = 256
DONE = "data: [DONE]\n\n"


@dataclass
class Prepared:
    """A request as the engine takes it: the prompt's token ids and what it asks for."""
    ids: List[int]
    #: None: the rest of the context, or what the KV pool can hold where that is less
    max_tokens: Optional[int]
    logprobs: bool = False
    top_logprobs: int = 0


@dataclass
class Call:
    """One request in flight."""
    rid: int
    queue: asyncio.Queue
    n: int
    head: Dict[str, Any]
    prep: Prepared
    return_margins: bool
    timing: Timing
    return_token_ids: bool = False
    include_usage: bool = False
    #: the choices report their ``seed``: the request sampled (temperature > 0), or gave one.
    #: Greedy decoding draws nothing, and a seed drawn for it would make equal answers differ.
    report_seed: bool = True
    #: the Result (or an error) has arrived: nothing to cancel any more
    finished: bool = False


@dataclass
class StreamState:
    """What a stream has sent so far, per choice."""
    streamed: List[str]
    #: completions' ``text_offset`` of the next token
    offsets: List[int] = field(default_factory=list)

    @classmethod
    def of(cls, n: int) -> "StreamState":
        return cls([""] * n, [0] * n)


class OpenAIServing:
    #: the key of ``errors.REQUEST_FIELDS``: "completion" or "chat"
    endpoint = ""
    request_model: type = object
    object = ""
    chunk_object = ""
    id_prefix = ""

    def __init__(self, st: ServerState):
        self.st = st

    # -- the endpoint's shapes (serving_completion.py, serving_chat.py) --------------------------

    def prepare(self, req: Any) -> Prepared:
        raise NotImplementedError

    def choice(self, c: Any, prep: Prepared) -> Dict[str, Any]:
        """A finished choice of the JSON response (the extensions are added after)."""
        raise NotImplementedError

    def opening(self, n: int) -> List[Dict[str, Any]]:
        """The choices of the stream's first chunk, if it has one."""
        return []

    def piece(self, i: int, text: str, logprobs: Any = None) -> Dict[str, Any]:
        """A streamed choice carrying ``text``."""
        raise NotImplementedError

    def event_logprobs(self, ev: Dict[str, Any], i: int, state: StreamState) -> Any:
        """A streamed token's logprobs (the request asked for them)."""
        raise NotImplementedError

    def closing(self, i: int, reason: str) -> Dict[str, Any]:
        """A choice's finish chunk (the extensions are added after)."""
        raise NotImplementedError

    # -- a request -------------------------------------------------------------------------------

    async def create(self, request: Request) -> Union[Dict[str, Any], Response]:
        """The endpoint: the JSON response, a stream, or 499 when the client went away."""
        t0 = time.perf_counter()
        req = parse(self.request_model, await read_body(request, self.st.settings.read_timeout))
        self.st.check_model(req.model)
        prep = self.prepare(req)
        params = self.sampling_params(req, prep)
        rid, q = await self.submit(prep.ids, params)
        call = Call(rid, q, params.n, self.head(), prep, bool(req.return_margins), Timing(self.st.metrics, t0),
                    return_token_ids=bool(req.return_token_ids),
                    include_usage=bool(req.stream_options and req.stream_options.include_usage),
                    report_seed=params.temperature > 0 or params.seed is not None)
        if req.stream:
            return StreamingResponse(self.stream(call), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        res = await self.collect(request, call)
        if res is None:
            return Response(status_code=499)  # nobody reads it
        call.timing.done()
        return self.response(call, res)

    def head(self) -> Dict[str, Any]:
        return {"id": self.id_prefix + secrets.token_hex(12), "object": self.object, "created": int(time.time()),
                "model": self.st.model_name, "system_fingerprint": self.st.system_fingerprint}

    def sampling_params(self, req: Any, prep: Prepared) -> SamplingParams:
        """The request's decoding, ``max_tokens`` fitted to the context (the engine would stop
        at its end anyway, ``finish_reason`` "length"). Without ``max_tokens`` (a chat): the rest
        of the context, or what the KV pool can hold for the request's choices where that is
        less (``--kv-budget-tokens`` below the context), rather than a refusal."""
        ctx, n_prompt = self.st.max_model_len, len(prep.ids)
        if ctx and n_prompt >= ctx:
            raise APIError(400, f"the prompt has {n_prompt} tokens but the context holds {ctx} "
                                f"(including at least one new token)", request_field("prompt", self.endpoint))
        max_tokens = prep.max_tokens
        if max_tokens is None:
            max_tokens = ctx - n_prompt if ctx else DEFAULT_MAX_TOKENS
            fit = self.st.kv_fit(n_prompt, req.n or 1)
            if fit is not None:
                max_tokens = min(max_tokens, fit)
        elif ctx:
            max_tokens = min(max_tokens, ctx - n_prompt)
        try:
            return SamplingParams(max_new_tokens=max_tokens, logprobs=prep.logprobs,
                                  top_logprobs=prep.top_logprobs, **sampling_keywords(req))
        except ENGINE_REFUSALS as e:
            raise engine_error(e, self.endpoint) from None

    async def submit(self, ids: List[int], params: SamplingParams) -> Tuple[int, asyncio.Queue]:
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        max_queue = self.st.settings.max_queue
        try:
            rid = await loop.run_in_executor(None, self.st.worker.submit, ids, params, q, max_queue)
        except QueueFull:
            raise APIError(429, f"the queue is full ({max_queue} requests waiting); retry later",
                           code="queue_full", headers={"Retry-After": "1"}) from None
        except ENGINE_REFUSALS as e:
            raise engine_error(e, self.endpoint) from None
        self.st.metrics.submitted(len(ids))
        return rid, q

    # -- waiting for the result ------------------------------------------------------------------

    async def collect(self, request: Request, call: Call) -> Any:
        """The request's Result, or None if the client went away first (then it is cancelled:
        its KV is freed at once, it leaves the batch within a step)."""
        gone = asyncio.ensure_future(disconnected(request))
        try:
            while True:
                get = asyncio.ensure_future(call.queue.get())
                await asyncio.wait((get, gone), return_when=asyncio.FIRST_COMPLETED)
                if not get.done():
                    get.cancel()
                    return None
                tokens, res, error = take(get.result())
                if error is not None:
                    raise APIError(500, error, code="engine_error")
                call.timing.tokens(len(tokens))
                if res is not None:
                    call.finished = True
                    return res
        finally:
            gone.cancel()
            if not call.finished:
                self.st.worker.cancel(call.rid)

    def response(self, call: Call, res: Any) -> Dict[str, Any]:
        choices = []
        for c in res.choices:
            ch = self.choice(c, call.prep)
            ch.update(extensions(c, call))
            choices.append(ch)
        out = {**call.head, "choices": choices, "usage": usage(res)}
        if call.return_token_ids:
            out["prompt_token_ids"] = [int(t) for t in call.prep.ids]
        return out

    # -- streaming -------------------------------------------------------------------------------

    async def stream(self, call: Call) -> AsyncIterator[str]:
        """The request's events as SSE chunks, then its finish chunk (and usage), then [DONE].

        With ``stream_interval_ms`` > 0 the events that arrive within that interval after a write
        go out as one write: each write is a message through a proxy (Ray Serve's), and on few
        cores every message's wake-ups take CPU from the engine. The first token is written as
        soon as it is there, and the events themselves are the same either way."""
        state = StreamState.of(call.n)
        interval = (self.st.settings.stream_interval_ms or 0) / 1e3
        buf: List[str] = []
        due = 0.0  # when buf must be written: time.monotonic()
        try:
            opening = self.opening(call.n)
            if opening:
                yield self.sse(call, opening)
            res = None
            while res is None:
                if buf:  # written when due, with whatever arrived until then
                    try:
                        item = await asyncio.wait_for(call.queue.get(), max(due - time.monotonic(), 0.0))
                    except asyncio.TimeoutError:
                        yield "".join(buf)
                        buf.clear()
                        due = time.monotonic() + interval
                        continue
                else:
                    item = await call.queue.get()
                tokens, res, error = take(item)
                if error is not None:
                    call.finished = True
                    yield "".join(buf) + f"data: {json.dumps(error_body(500, error, code='engine_error'))}\n\n" + DONE
                    return
                call.timing.tokens(len(tokens))
                out = self.pieces(tokens, call, state)
                if out:
                    buf.append(self.sse(call, out))
                if buf and res is None and time.monotonic() >= due:
                    yield "".join(buf)
                    buf.clear()
                    due = time.monotonic() + interval
            call.finished = True
            call.timing.done()
            prompt = {"prompt_token_ids": [int(t) for t in call.prep.ids]} if call.return_token_ids else {}
            buf.append(self.sse(call, self.finish(res, call, state), **prompt))
            if call.include_usage:
                buf.append(self.sse(call, [], usage(res)))
            buf.append(DONE)
            yield "".join(buf)
        finally:
            if not call.finished:  # the client went away (or the task was cancelled): free the KV now
                self.st.worker.cancel(call.rid)

    def pieces(self, tokens: List[Dict[str, Any]], call: Call, state: StreamState) -> List[Dict[str, Any]]:
        """One step's token events as streamed choices (a token whose text is held back, as a
        possible stop string's start, sends nothing unless logprobs are asked for)."""
        out = []
        for ev in tokens:
            i, text = ev["index"], ev["text"]
            state.streamed[i] += text
            if text or call.prep.logprobs:
                out.append(self.piece(i, text, self.event_logprobs(ev, i, state) if call.prep.logprobs else None))
        return out

    def finish(self, res: Any, call: Call, state: StreamState) -> List[Dict[str, Any]]:
        """The choices of the last chunk. The events' deltas hold back text that could start a
        stop string; the Result's text is the authority, so whatever it has beyond the deltas
        goes out here, before each choice's finish."""
        out = []
        for c in res.choices:
            i, sent = c.index, state.streamed[c.index]
            if c.text.startswith(sent) and len(c.text) > len(sent):
                out.append(self.piece(i, c.text[len(sent):]))
            end = self.closing(i, finish_reason(c.finish_reason))
            end.update(extensions(c, call))
            out.append(end)
        return out

    def sse(self, call: Call, choices: List[Dict[str, Any]], usage: Any = None, **extra: Any) -> str:
        d = {**call.head, "object": self.chunk_object, "choices": choices}
        if call.include_usage:
            d["usage"] = usage
        d.update(extra)
        return "data: " + json.dumps(d, ensure_ascii=False, separators=(",", ":")) + "\n\n"


# ---------------------------------------------------------------------------------------------
# Shapes both endpoints use

def sampling_keywords(req: Any) -> Dict[str, Any]:
    """The request's sampling fields as SamplingParams keywords, OpenAI's defaults where omitted
    (``temperature`` 1.0)."""
    def given(v: Any, default: Any) -> Any:
        return default if v is None else v
    return dict(stop=req.stop, temperature=given(req.temperature, 1.0), top_p=given(req.top_p, 1.0),
                top_k=given(req.top_k, 0), min_p=given(req.min_p, 0.0),
                presence_penalty=given(req.presence_penalty, 0.0), frequency_penalty=given(req.frequency_penalty, 0.0),
                repetition_penalty=given(req.repetition_penalty, 1.0), seed=req.seed, n=given(req.n, 1))


def take(items: List[Any]) -> Tuple[List[Dict[str, Any]], Any, Optional[str]]:
    """One delivery from the worker: its token events, the Result if it came, the engine's error
    message if it failed."""
    tokens, res = [], None
    for it in items:
        if isinstance(it, tuple):
            if it[0] == "error":
                return tokens, None, it[1]
            res = it[1]
        elif it["type"] == "token":
            tokens.append(it)
    return tokens, res, None


def extensions(c: Any, call: Call) -> Dict[str, Any]:
    """A choice's extensions: ``fingerprint``, ``seed`` (where it keyed draws, or was given), with
    ``return_margins`` the gate's per-step ``margins`` (null where not finite) and
    ``rechecked``, with ``return_token_ids`` its ``token_ids``."""
    out: Dict[str, Any] = {"fingerprint": c.fingerprint}
    if call.report_seed:
        out["seed"] = int(c.seed)
    if call.return_margins:
        out["margins"] = [float(m) if math.isfinite(float(m)) else None for m in c.margins]
        out["rechecked"] = [int(x) for x in c.rechecked]
    if call.return_token_ids:
        out["token_ids"] = [int(t) for t in c.token_ids]
    return out


def usage(res: Any) -> Dict[str, Any]:
    comp = sum(len(c.token_ids) for c in res.choices)
    return {"prompt_tokens": int(res.prompt_tokens), "completion_tokens": comp,
            "total_tokens": int(res.prompt_tokens) + comp,
            "prompt_tokens_details": {"cached_tokens": int(res.cached_tokens)}}


async def disconnected(request: Request) -> None:
    """Returns when the client has gone away. The body has been read, so the next ASGI message
    is ``http.disconnect`` (uvicorn sends it when the connection closes): no polling."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
