"""Errors in OpenAI's shape: :class:`APIError`, its JSON body, and where the messages come from.

Two sources name the offending request field: pydantic, when a body does not validate
(:func:`validation_message`), and the engine, when a value passes the schema but not Rust's
checks (:func:`engine_error`). The engine's exceptions carry the parameter as data
(``_native.InvalidParameter.param``, Rust's spelling); no message text is ever parsed.
"""
from __future__ import annotations

import json
import math
from typing import Any, Dict, List, Optional, Tuple

from pydantic import ValidationError

from .. import _native

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               408: "invalid_request_error",
               413: "invalid_request_error", 429: "rate_limit_error", 500: "internal_error",
               503: "service_unavailable"}


class APIError(Exception):
    """A refusal: the handlers raise it, the app's exception handler sends :func:`error_body`."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 headers: Optional[Dict[str, str]] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers


def error_body(status: int, message: str, param: Optional[str] = None, code: Optional[str] = None) -> Dict[str, Any]:
    """OpenAI's error object: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "error"), "param": param, "code": code}}


# ---------------------------------------------------------------------------------------------
# The engine's exceptions

#: Rust's name for a parameter -> the field of the request that carries it, per endpoint, where
#: they differ (the others are spelled alike: ``temperature``, ``top_p``, ``n``, ``stop``, ...).
REQUEST_FIELDS: Dict[str, Dict[str, str]] = {
    "completion": {"max_new_tokens": "max_tokens", "top_logprobs": "logprobs"},
    "chat": {"max_new_tokens": "max_tokens", "prompt": "messages"},
}

#: what the engine raises for a request it refuses (anything else is a server fault: 500);
#: ``InvalidParameter`` is a ValueError that names the parameter (``param``)
ENGINE_REFUSALS = (ValueError, TypeError, OverflowError, _native.CandleGateError)


def engine_error(e: BaseException, endpoint: str = "completion", fallback: Optional[str] = None) -> APIError:
    """The APIError for an exception the engine raised on a request of ``endpoint`` ("completion"
    or "chat"), from its class and its ``param`` (the message is passed on, never read): shut
    down is 503 ``shutting_down``; an invalid parameter, or any other refusal, is 400 naming the
    request's field for the engine's ``param``, else ``fallback`` (the field being processed,
    where the caller knows it: the prompt while tokenizing it)."""
    if isinstance(e, _native.EngineShutDown):
        return APIError(503, str(e), code="shutting_down")
    if isinstance(e, ENGINE_REFUSALS):
        param = getattr(e, "param", None)
        return APIError(400, str(e), fallback if param is None else request_field(param, endpoint))
    return APIError(500, f"internal error: {type(e).__name__}: {e}")


def request_field(param: Optional[str], endpoint: str = "completion") -> Optional[str]:
    """The request's name for the engine's parameter ``param`` (None stays None)."""
    if param is None:
        return None
    return REQUEST_FIELDS.get(endpoint, {}).get(param, param)


# ---------------------------------------------------------------------------------------------
# pydantic's validation errors

_UNION_TAGS = {"str", "int", "float", "bool", "none"}


def _clean_loc(loc: Tuple[Any, ...]) -> str:
    """A field's path without pydantic's union member tags (``constrained-str``, ``list[int]``)."""
    return ".".join(str(x) for x in loc
                    if not (isinstance(x, str) and (x in _UNION_TAGS or "[" in x or "-" in x)))


def validation_message(e: ValidationError, raw: bytes = b"") -> Tuple[str, Optional[str]]:
    """The message and the field (``param``) for a body (``raw``) that does not validate."""
    errs = e.errors()
    err = errs[0]
    if err.get("type") == "json_invalid":
        surrogate = lone_surrogate(raw)
        if surrogate is not None:
            return surrogate
        return f"the request body is not valid JSON: {err.get('ctx', {}).get('error', err.get('msg'))}", None
    if not err.get("loc"):
        return str(err.get("msg")), None
    param = str(err["loc"][0])
    same = [x for x in errs if x.get("loc") and x["loc"][0] == err["loc"][0]]
    # A union reports each alternative. Those the value's type matched but a bound refused (an
    # empty string for a string) are the reason; the others (not a list) would only confuse.
    matched = [x for x in same if not _is_type_error(x)]
    parts: List[str] = []
    for x in matched or same:
        m = f"{_clean_loc(x['loc'])}: {_reason(x)}"
        if m not in parts:
            parts.append(m)
    return "; or ".join(parts[:4]), param


def _is_type_error(err: Dict[str, Any]) -> bool:
    """pydantic's "the value is not of this type" (``string_type``, ``list_type``, ...)."""
    t = str(err.get("type", ""))
    return t.endswith("_type") or t.endswith("_parsing") or t in ("is_instance_of", "union_tag_invalid")


def _reason(err: Dict[str, Any]) -> str:
    t, value = err.get("type"), err.get("input")
    if t in ("string_too_short", "too_short") and value in ("", [], ()):
        return "must not be empty"
    if t == "finite_number" and isinstance(value, float):
        return f"must be a finite number, got {_float_name(value)}"
    if t in ("greater_than", "greater_than_equal", "less_than", "less_than_equal") and isinstance(value, float) \
            and not math.isfinite(value):
        return f"must be a finite number, got {_float_name(value)}"
    return str(err.get("msg"))


def _float_name(x: float) -> str:
    """JSON's spelling of a non-finite number (what the client sent)."""
    return "NaN" if math.isnan(x) else ("Infinity" if x > 0 else "-Infinity") if math.isinf(x) else repr(x)


def lone_surrogate(raw: bytes) -> Optional[Tuple[str, Optional[str]]]:
    """For a body pydantic's JSON parser refused: ``(message, field)`` when the reason is a lone
    UTF-16 surrogate escape (``"\\ud800"`` not followed by a low surrogate), which encodes no
    character (Python's parser accepts it; the message is pydantic's otherwise misleading
    "unexpected end of hex escape"); None for any other reason."""
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    found = _surrogate_path(doc, ())
    if found is None:
        return None
    path, ch = found
    where = ".".join(map(str, path)) or "the body"
    return (f"{where}: the string holds a lone UTF-16 surrogate (\\u{ord(ch):04x}), which is not a character: a "
            f"\\u escape of a surrogate must be a high one (d800-dbff) followed by a low one (dc00-dfff)",
            str(path[0]) if path else None)


def _surrogate_path(x: Any, path: Tuple[Any, ...]) -> Optional[Tuple[Tuple[Any, ...], str]]:
    if isinstance(x, str):
        ch = next((c for c in x if 0xD800 <= ord(c) <= 0xDFFF), None)
        return None if ch is None else (path, ch)
    items = x.items() if isinstance(x, dict) else enumerate(x) if isinstance(x, list) else ()
    for k, v in items:
        if isinstance(k, str) and _surrogate_path(k, ()) is not None:
            return path + (k,), next(c for c in k if 0xD800 <= ord(c) <= 0xDFFF)
        found = _surrogate_path(v, path + (k,))
        if found is not None:
            return found
    return None


def request_validation_message(errs: List[Dict[str, Any]]) -> str:
    """FastAPI's own validation errors (path and query parameters) as one message."""
    first = errs[0] if errs else {}
    return f"{'.'.join(map(str, first.get('loc', ())))}: {first.get('msg', 'invalid request')}"
