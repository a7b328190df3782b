"""The endpoint probe's requests: one completion from an OpenAI-compatible server, with retries.

:class:`Sender` talks to the endpoint with the official ``openai`` client (chat completions for
a chat, completions for a string or a list of token ids), ``max_retries=0``, non-streaming or,
with ``stream=True``, streaming (SSE: the completion, its per-token logprobs and
``system_fingerprint`` are assembled from the chunks by :func:`assemble_stream`), and retries
itself (:class:`RetryPolicy`): a 429 sleeps its ``Retry-After`` (bounded), transport errors and
5xx back off exponentially, a bounded number of times; a request that still fails is an error
of its prompt, never a completion. Logprobs (with ``top_logprobs``) are asked for; if the
endpoint rejects them (400/422) the request is retried without and the rest of the run goes
without (``Sender.logprobs_note`` says so). docs/ENDPOINT_PROBE.md ("Requests, retries, errors").
"""
from __future__ import annotations

import re
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from .common import is_chat

DEFAULT_API_KEY = "EMPTY"


@dataclass
class RetryPolicy:
    """``max_retries`` retries after the first attempt (any kind of failure together);
    ``backoff`` * 2**k seconds before retry k (transport errors and 5xx), capped at
    ``max_backoff``; a 429 sleeps its ``Retry-After`` (seconds), capped at ``max_retry_after``
    (``backoff`` * 2**k without the header)."""
    max_retries: int = 3
    backoff: float = 0.5
    max_backoff: float = 8.0
    max_retry_after: float = 30.0

    def delay(self, k: int) -> float:
        return min(self.max_backoff, self.backoff * (2 ** k))


def _retry_after(err: Any) -> Optional[float]:
    resp = getattr(err, "response", None)
    if resp is None:
        return None
    v = resp.headers.get("retry-after")
    if v is None:
        return None
    try:
        return max(0.0, float(v))
    except ValueError:
        pass
    try:  # an HTTP date
        from email.utils import parsedate_to_datetime
        return max(0.0, parsedate_to_datetime(v).timestamp() - time.time())
    except (TypeError, ValueError):
        return None


def _sleep(seconds: float) -> None:
    """The retry loop's waits (one place, so that a test can record them instead of waiting)."""
    time.sleep(seconds)


class IncompleteStream(Exception):
    """A streamed response that ended before its choice's ``finish_reason``."""


def _read_errors() -> Tuple[type, ...]:
    """Transport errors that reading a stream can raise unwrapped (older ``openai`` clients let
    httpx's through; newer ones raise ``APIConnectionError``)."""
    try:
        import httpx
    except ImportError:
        return (IncompleteStream,)
    return (httpx.TransportError, IncompleteStream)


def _is_timeout(e: Exception) -> bool:
    try:
        import httpx
    except ImportError:
        return False
    return isinstance(e, httpx.TimeoutException)


class Sender:
    """Sends one prompt at a time (from any thread) and counts the retries of the run."""

    def __init__(self, client: Any, model: str, max_tokens: int, temperature: float, seed: Optional[int],
                 top_logprobs: int, policy: RetryPolicy, secret: str, stream: bool = False):
        self.client, self.model, self.max_tokens = client, model, max_tokens
        self.temperature, self.seed, self.top = temperature, seed, top_logprobs
        self.policy, self.secret, self.stream = policy, secret, stream
        self.logprobs = top_logprobs is not None and top_logprobs >= 0
        self.logprobs_note: Optional[str] = None
        self.retries = Counter()
        self.lock = threading.Lock()

    def scrub(self, s: str) -> str:
        return s.replace(self.secret, "***") if self.secret else s

    def _kwargs(self, prompt: Any, logprobs: bool) -> Tuple[Any, Dict[str, Any]]:
        kw: Dict[str, Any] = {"model": self.model, "max_tokens": self.max_tokens, "temperature": self.temperature}
        if self.seed is not None:
            kw["seed"] = self.seed
        if self.stream:
            kw["stream"] = True
        if is_chat(prompt):
            kw["messages"] = prompt
            if logprobs:
                kw["logprobs"] = True
                kw["top_logprobs"] = self.top
            return self.client.chat.completions.create, kw
        kw["prompt"] = prompt  # a string, or token ids (OpenAI's `prompt: [int, ...]`)
        if logprobs:
            kw["logprobs"] = self.top
        return self.client.completions.create, kw

    def _request(self, prompt: Any, logprobs: bool) -> Dict[str, Any]:
        """One HTTP request: {text, tokens, top, fingerprint, finish_reason}. Raises the openai
        client's errors, and while a stream is read httpx's transport errors, an ``APIError``
        for an error event, or :class:`IncompleteStream`."""
        fn, kw = self._kwargs(prompt, logprobs)
        chat = is_chat(prompt)
        if not self.stream:
            r = fn(**kw)
            tokens, top = _logprobs_of(r, chat)
            c = r.choices[0]
            text = (c.message.content or "") if chat else (c.text or "")
            return {"text": text, "tokens": tokens, "top": top,
                    "fingerprint": getattr(r, "system_fingerprint", None), "finish_reason": c.finish_reason}
        with fn(**kw) as chunks:
            return assemble_stream(chunks, chat)

    def send(self, prompt: Any) -> Dict[str, Any]:
        """One request with the retry loop: {"ok": True, text, tokens, top, fingerprint, ...}
        or {"ok": False, "error", "status", "attempts"}."""
        import openai
        read_errors = _read_errors()
        attempts = 0
        retries = Counter()
        while True:
            attempts += 1
            logprobs = self.logprobs
            try:
                r = self._request(prompt, logprobs)
            except openai.APIStatusError as e:
                last: Exception = e
                status = e.status_code
                if status in (400, 422) and logprobs:
                    # Perhaps the logprobs: try once without; if that works, go without from now.
                    try:
                        r = self._request(prompt, False)
                    except (openai.APIError,) + read_errors:
                        return self._fail(e, status, attempts, retries)
                    with self.lock:
                        if self.logprobs:
                            self.logprobs = False
                            self.logprobs_note = ("the endpoint rejected logprobs "
                                                  f"(HTTP {status}: {self.scrub(_msg(e))}); requests "
                                                  "go without, divergences are in characters")
                    return self._ok(r, attempts, retries)
                if status == 429:
                    wait = _retry_after(e)
                    wait = self.policy.delay(attempts - 1) if wait is None else min(wait, self.policy.max_retry_after)
                    kind = "429"
                elif status >= 500:
                    wait, kind = self.policy.delay(attempts - 1), "5xx"
                else:
                    return self._fail(e, status, attempts, retries)
            except openai.APIConnectionError as e:  # includes APITimeoutError
                last = e
                wait, kind, status = self.policy.delay(attempts - 1), (
                    "timeout" if isinstance(e, openai.APITimeoutError) else "transport"), None
            except read_errors as e:  # while a stream was read
                last = e
                wait, kind, status = self.policy.delay(attempts - 1), (
                    "timeout" if _is_timeout(e) else "transport"), None
            except openai.APIError as e:  # an error event in a stream
                last = e
                wait, kind, status = self.policy.delay(attempts - 1), "stream_error", None
            else:
                return self._ok(r, attempts, retries)
            if attempts > self.policy.max_retries:
                return self._fail(last, status, attempts, retries)
            retries[kind] += 1
            _sleep(wait)

    def _fail(self, e: Exception, status: Optional[int], attempts: int, retries: Counter) -> Dict[str, Any]:
        with self.lock:
            self.retries.update(retries)
        return {"ok": False, "error": self.scrub(f"{type(e).__name__}: {_msg(e)}"), "status": status,
                "attempts": attempts, "retries": dict(retries)}

    def _ok(self, r: Dict[str, Any], attempts: int, retries: Counter) -> Dict[str, Any]:
        with self.lock:
            self.retries.update(retries)
        return {"ok": True, **r, "attempts": attempts, "retries": dict(retries)}


def _msg(e: Exception) -> str:
    m = getattr(e, "message", None) or str(e)
    return str(m)[:300]


def _chat_rows(content: Any) -> Tuple[List[str], List[List[float]]]:
    """Chat logprob entries: the token strings and, per position, the top logprobs (the
    sampled token's own when the endpoint gives no top list)."""
    tokens = [e.token for e in content]
    top = [[t.logprob for t in (e.top_logprobs or [])] or [e.logprob] for e in content]
    return tokens, top


def _completion_rows(lp: Any) -> Tuple[List[str], List[List[float]]]:
    """Completions logprobs (``tokens``, ``token_logprobs``, ``top_logprobs`` as dicts)."""
    tops = lp.top_logprobs or []
    lps = lp.token_logprobs or []
    top = []
    for i, _ in enumerate(lp.tokens):
        row = tops[i] if i < len(tops) and tops[i] else {}
        vals = list(row.values()) if isinstance(row, dict) else []
        top.append(vals or ([lps[i]] if i < len(lps) and lps[i] is not None else []))
    return list(lp.tokens), top


def _logprobs_of(r: Any, chat: bool) -> Tuple[Optional[List[str]], Optional[List[List[float]]]]:
    try:
        lp = r.choices[0].logprobs
        if lp is None:
            return None, None
        if chat:
            if not lp.content:
                return None, None
            return _chat_rows(lp.content)
        if not lp.tokens:
            return None, None
        return _completion_rows(lp)
    except (AttributeError, IndexError, TypeError):
        return None, None


def assemble_stream(chunks: Any, chat: bool) -> Dict[str, Any]:
    """A streamed response's choice 0 from its chunks: the text (the deltas, or the completion
    chunks' ``text``, joined), the token strings and top logprobs (each chunk's logprob entries,
    in order; None when no chunk carried any), ``system_fingerprint`` (the first chunk's that has
    one) and ``finish_reason``. Raises :class:`IncompleteStream` when no chunk gave a
    ``finish_reason`` (the stream was cut)."""
    parts: List[str] = []
    tokens: List[str] = []
    top: List[List[float]] = []
    seen_lp = False
    fingerprint = None
    finish = None
    for ch in chunks:
        if fingerprint is None:
            fingerprint = getattr(ch, "system_fingerprint", None)
        for c in getattr(ch, "choices", None) or []:
            if getattr(c, "index", 0) != 0:
                continue
            lp = getattr(c, "logprobs", None)
            if chat:
                d = getattr(c, "delta", None)
                if d is not None and d.content:
                    parts.append(d.content)
                if lp is not None and getattr(lp, "content", None):
                    t, tp = _chat_rows(lp.content)
                    tokens += t
                    top += tp
                    seen_lp = True
            else:
                parts.append(getattr(c, "text", None) or "")
                if lp is not None and getattr(lp, "tokens", None):
                    t, tp = _completion_rows(lp)
                    tokens += t
                    top += tp
                    seen_lp = True
            if c.finish_reason:
                finish = c.finish_reason
    if finish is None:
        raise IncompleteStream("the stream ended before a finish_reason")
    return {"text": "".join(parts), "tokens": tokens if seen_lp else None, "top": top if seen_lp else None,
            "fingerprint": fingerprint, "finish_reason": finish}


def base_url(url: str) -> str:
    """The OpenAI base URL: ``http(s)://host[:port]`` gets ``/v1``; anything but http(s) is refused."""
    if not re.match(r"^https?://", url or ""):
        raise ValueError(f"--endpoint: expected an http(s) URL, got {url!r}")
    u = url.rstrip("/")
    # A bare host[:port] gets OpenAI's /v1.
    if re.fullmatch(r"https?://[^/]+", u):
        u += "/v1"
    return u


def make_client(url: str, api_key: Optional[str], timeout: float) -> Any:
    """The ``openai`` client for ``url`` (:func:`base_url`), without its own retries (the
    :class:`Sender`'s loop retries)."""
    import openai
    return openai.OpenAI(base_url=base_url(url), api_key=api_key or DEFAULT_API_KEY, max_retries=0,
                         timeout=timeout)
