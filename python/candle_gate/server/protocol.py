"""The wire: OpenAI's request and response shapes as pydantic models, and reading a body into one.

The requests are parsed strictly (``"0.5"`` is not a number) and their fields carry the engine's
own bounds, so that the OpenAPI document says what the server accepts and a value out of range is
refused naming the field. The responses are documentation: the serving code builds plain dicts in
these shapes (``serving_completion.py``, ``serving_chat.py``) and schemathesis checks them against
these models (tests/server/test_server_schema.py).
"""
from __future__ import annotations

import asyncio
from typing import Annotated, Any, Dict, List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError, model_validator

from .. import _native
from .errors import APIError, validation_message

# ---------------------------------------------------------------------------------------------
# Requests (strict: a string is not a number; unknown fields are ignored)

_U64 = 2 ** 64 - 1
_I64 = 2 ** 63 - 1
_StopStr = Annotated[str, StringConstraints(min_length=1)]
StopT = Union[_StopStr, Annotated[List[_StopStr], Field(max_length=_native.MAX_STOP)], None]


def _bounded(kind: type, name: str) -> Any:
    """``kind`` within the engine's bounds on the sampling parameter ``name`` (Rust's, which
    ``SamplingParams`` checks too): declared here so that the OpenAPI document describes what the
    server accepts, and a value out of range is refused naming the field."""
    bounds = {k: kind(v) for k, v in _native.SAMPLING_BOUNDS[name].items()}
    if kind is float:
        bounds["allow_inf_nan"] = False
    return Annotated[kind, Field(**bounds)]


_MaxNewTokens = _bounded(int, "max_new_tokens")
_Temperature = _bounded(float, "temperature")
_TopP = _bounded(float, "top_p")
_MinP = _bounded(float, "min_p")
_N = _bounded(int, "n")
_PresencePenalty = _bounded(float, "presence_penalty")
_FrequencyPenalty = _bounded(float, "frequency_penalty")
_RepetitionPenalty = _bounded(float, "repetition_penalty")
_TopLogprobs = _bounded(int, "top_logprobs")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: Optional[bool] = None


class _Req(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    model: Optional[str] = None
    max_tokens: Optional[_MaxNewTokens] = None
    stop: StopT = None
    #: default 1.0 when omitted, as OpenAI; 0 is greedy
    temperature: Optional[_Temperature] = None
    top_p: Optional[_TopP] = None
    top_k: Optional[Annotated[int, Field(ge=0, le=_I64)]] = None
    min_p: Optional[_MinP] = None
    seed: Optional[Annotated[int, Field(ge=0, le=_U64)]] = None
    n: Optional[_N] = None
    presence_penalty: Optional[_PresencePenalty] = None
    frequency_penalty: Optional[_FrequencyPenalty] = None
    repetition_penalty: Optional[_RepetitionPenalty] = None
    user: Optional[str] = None
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    #: extension: per choice ``margins`` and ``rechecked`` lists
    return_margins: Optional[bool] = False
    #: extension (vLLM's name): the prompt's token ids (``prompt_token_ids``) and each choice's
    #: (``token_ids``) on the response, what ``candle-gate verify`` pinpoints a difference by
    return_token_ids: Optional[bool] = False


_TokenIds = Annotated[List[Annotated[int, Field(ge=0, le=_I64)]], Field(min_length=1)]


class CompletionRequest(_Req):
    #: a string, a list of token ids, or a list of one string
    prompt: Union[Annotated[str, StringConstraints(min_length=1)], _TokenIds,
                  Annotated[List[Annotated[str, StringConstraints(min_length=1)]], Field(min_length=1, max_length=1)]]
    #: the number of alternatives per token (0: only the chosen token's logprob)
    logprobs: Optional[_TopLogprobs] = None
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
    max_completion_tokens: Optional[_MaxNewTokens] = None
    logprobs: Optional[bool] = False
    top_logprobs: Optional[_TopLogprobs] = None
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
# Responses (the OpenAPI document's: the serving code builds plain dicts in these shapes)

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


#: The engine's finish reasons (``_native.FINISH_REASONS``) as OpenAI's ``finish_reason``: the one
#: table between the two (the responses, the streams and the metrics' ``finished_reason``).
FINISH_REASON = {"eos": "stop", "stop": "stop", "length": "length", "context_full": "length",
                 "cancelled": "cancelled", "error": "error"}
#: OpenAI's finish reasons the server sends
FINISH_REASONS = tuple(dict.fromkeys(FINISH_REASON.values()))


def finish_reason(engine_reason: str) -> str:
    return FINISH_REASON.get(engine_reason, engine_reason)


_Finish = Literal[FINISH_REASONS]


class _ChoiceExt(BaseModel):
    index: int
    finish_reason: _Finish
    #: extension: the engine's output fingerprint of the choice (32 hex)
    fingerprint: str
    #: extension: the seed the choice's draws were keyed by; absent at temperature 0 without a
    #: seed (greedy decoding draws nothing)
    seed: Optional[int] = None
    #: extension, with ``return_margins``: the gate's per-step margin (null where not finite)
    margins: Optional[List[Optional[float]]] = None
    #: extension, with ``return_margins``: 1 where the step was rechecked
    rechecked: Optional[List[int]] = None
    #: extension, with ``return_token_ids``: the choice's generated token ids
    token_ids: Optional[List[int]] = None


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
    #: extension, with ``return_token_ids``: the prompt's token ids as the model read them
    prompt_token_ids: Optional[List[int]] = None


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
    #: extension, with ``return_token_ids``: the prompt's token ids as the model read them
    prompt_token_ids: Optional[List[int]] = None


class _StreamExt(BaseModel):
    index: int
    #: set on a choice's finish chunk, with the extensions below
    finish_reason: Optional[_Finish]
    fingerprint: Optional[str] = None
    seed: Optional[int] = None
    margins: Optional[List[Optional[float]]] = None
    rechecked: Optional[List[int]] = None
    token_ids: Optional[List[int]] = None


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
    #: with ``return_token_ids``: the prompt's token ids, in the chunk of the first finish
    prompt_token_ids: Optional[List[int]] = None


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
    #: with ``return_token_ids``: the prompt's token ids, in the chunk of the first finish
    prompt_token_ids: Optional[List[int]] = None


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


# ---------------------------------------------------------------------------------------------
# Reading a request

#: The largest request body read. A whole context of token ids as JSON is far below it; a body
#: above it is refused (413) without being read into memory.
MAX_BODY_BYTES = 8 << 20


async def read_body(request: Any, timeout: Optional[float] = None) -> bytes:
    """The body, refused with 413 as soon as it is known to pass :data:`MAX_BODY_BYTES` (from its
    ``Content-Length``, or, chunked, from the bytes read so far), and with 408 when it has not
    all arrived within ``timeout`` seconds (a slow trickle holds a connection and a handler;
    the connection is closed after the 408)."""
    too_big = f"the request body is larger than {MAX_BODY_BYTES} bytes"
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise APIError(413, too_big)
    parts: List[bytes] = []

    async def read() -> None:
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                raise APIError(413, too_big)
            parts.append(chunk)

    try:
        await asyncio.wait_for(read(), timeout)
    except asyncio.TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout:g} s", code="read_timeout",
                       headers={"Connection": "close"}) from None
    return b"".join(parts)


def parse(cls: type, raw: bytes) -> Any:
    """``raw`` as a ``cls``, or a 400 naming the first field that is wrong."""
    if not raw.strip():
        raise APIError(400, "the request body is empty; expected a JSON object")
    try:
        return cls.model_validate_json(raw)
    except ValidationError as e:
        msg, param = validation_message(e, raw)
        raise APIError(400, msg, param) from None
