"""The OpenAPI document (``GET /openapi.json``), written to describe the server as it behaves.

The generation and tokenizer endpoints parse their bodies themselves (strictly, so that a wrong
type is a 400 in OpenAI's shape), so their request bodies are declared here from the same models;
the responses declare the success bodies, the SSE events of a stream, and every error status an
endpoint returns. FastAPI's 422 is left out (it never reaches a client). With ``--api-key`` the
endpoints that need the key declare bearer authentication. tests/server/test_server_schema.py checks the
server against this document with schemathesis.
"""
from __future__ import annotations

from typing import Any, Dict

from .protocol import (MAX_BODY_BYTES, ChatCompletionChunk, ChatCompletionRequest, CompletionChunk,
                       CompletionRequest, DetokenizeRequest, ErrorResponse, TokenizeRequest)

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


def sse_content(chunk: type) -> Dict[str, Any]:
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


def error_responses(*codes: int) -> Dict[int, Dict[str, Any]]:
    out: Dict[int, Dict[str, Any]] = {}
    for c in codes:
        out[c] = {"model": ErrorResponse, "description": _ERROR_DESCRIPTIONS[c]}
        if c == 429:
            out[c]["headers"] = {"Retry-After": {"description": "seconds", "schema": {"type": "integer"}}}
    return out


def request_body(model: type) -> Dict[str, Any]:
    """The request body of an endpoint that parses it itself (strictly, with ``model``)."""
    return {"requestBody": {"required": True, "content": {
        "application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


def openapi_document(app: Any, keyed: bool, model_name: str, ops_keyed: bool = False) -> Dict[str, Any]:
    """FastAPI's document for ``app``'s routes, with the request and stream models' schemas
    added, the 422s removed, the served model's name as the example of ``/v1/models/{name}`` and,
    when ``keyed``, bearer authentication on the endpoints that need the key (``ops_keyed``:
    ``/metrics`` too, ``--api-key-scope all``)."""
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
            elif ops_keyed and path == "/metrics":
                op["security"] = [{"bearer": []}]
                op.setdefault("responses", {})["401"] = {
                    "description": _ERROR_DESCRIPTIONS[401],
                    "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}
    return doc
