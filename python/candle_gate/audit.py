"""Re-verify a server's response offline: ``candle-gate verify RECORD.json``.

A *record* is what a client keeps of one exchange with ``candle-gate serve`` (or any replica of
it): ``{"request": <the JSON body it sent>, "response": <the JSON body it got back>}``, for
``/v1/completions`` or ``/v1/chat/completions``, not streamed. :func:`verify` sends the same
request to an in-process copy of the same server app (the same code from the body to the
engine, with the settings given here, which must be the server's: model file, mode, gate, K/V
dtype), and compares the two responses bit for bit: ``system_fingerprint``, and per choice the
token ids, the logprobs, the text, ``finish_reason`` and the choice's ``fingerprint`` (which
hashes the model file, the kernel policy, the host's contribution to the bits and the tokens).

What to record so that every check can run: send the request with ``"return_token_ids": true``
(the response then carries ``prompt_token_ids`` and each choice's ``token_ids``, so a difference
is pinned to a position), with ``logprobs`` if they are to be checked, and keep the response as
it came. A sampled request without a ``seed`` is replayed with the seed the response reports
(each choice's ``seed`` extension).
"""
from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

#: the endpoint a response's ``object`` comes from
ENDPOINTS = {"text_completion": "/v1/completions", "chat.completion": "/v1/chat/completions"}


@dataclass
class ChoiceCheck:
    """One choice's comparison: each field is True when recorded and replayed agree bit for bit
    (None: the record does not carry it)."""
    index: int
    token_ids: Optional[bool] = None
    #: the first output position whose token differs
    first_token_difference: Optional[int] = None
    logprobs: Optional[bool] = None
    #: the first output position whose logprob entry (the token's and its alternatives') differs
    first_logprob_difference: Optional[int] = None
    text: bool = False
    finish_reason: bool = False
    fingerprint: bool = False

    @property
    def match(self) -> bool:
        return (self.token_ids is not False and self.logprobs is not False and self.text
                and self.finish_reason and self.fingerprint)


@dataclass
class Verification:
    """The outcome of :func:`verify`: ``match`` when everything recorded was reproduced."""
    endpoint: str
    system_fingerprint: Tuple[str, str]
    prompt_token_ids: Optional[bool]
    choices: List[ChoiceCheck]
    #: the replayed response, as the local app returned it
    replayed: Dict[str, Any] = field(repr=False, default_factory=dict)

    @property
    def match(self) -> bool:
        return (self.system_fingerprint[0] == self.system_fingerprint[1] and self.prompt_token_ids is not False
                and len(self.choices) > 0 and all(c.match for c in self.choices))

    def summary(self) -> str:
        rec, loc = self.system_fingerprint
        lines = [f"{self.endpoint}: {'MATCH' if self.match else 'MISMATCH'}",
                 f"  system_fingerprint: {'same' if rec == loc else 'DIFFERENT'} (recorded {rec}, local {loc})"]
        if rec != loc:
            lines.append("    the local stack differs (model file, mode, gate, K/V dtype, build or host class): "
                         "run verify with the server's settings")
        if self.prompt_token_ids is not None:
            lines.append(f"  prompt token ids: {'same' if self.prompt_token_ids else 'DIFFERENT'}")
        for c in self.choices:
            lines.append(f"  choice {c.index}: {'match' if c.match else 'MISMATCH'}")
            if c.token_ids is None:
                lines.append("    token ids: not recorded (send return_token_ids: true)")
            elif not c.token_ids:
                lines.append(f"    token ids: first difference at output position {c.first_token_difference}")
            if c.logprobs is False:
                lines.append(f"    logprobs: first difference at output position {c.first_logprob_difference}")
            for name in ("text", "finish_reason", "fingerprint"):
                if not getattr(c, name):
                    lines.append(f"    {name}: different")
        return "\n".join(lines)


def load_record(path: Union[str, Path]) -> Dict[str, Any]:
    try:
        record = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read the record {path}: {e}") from None
    return record


def verify(record: Dict[str, Any], settings: Any = None, **settings_kw: Any) -> Verification:
    """Replays ``record["request"]`` on an in-process server built from ``settings`` (a
    :class:`~candle_gate.server.Settings`, or its fields as keywords: ``model=``, ``mode=``,
    ``gate=``, ``kv_dtype=``, ...) and compares the response with ``record["response"]``."""
    from .server.settings import Settings

    request, response = _check_record(record)
    endpoint = ENDPOINTS[response["object"]]
    if settings is None:
        settings = Settings(**settings_kw)
    replayed = _replay(settings, endpoint, _replay_body(request, response))
    return compare(endpoint, response, replayed)


def _check_record(record: Any) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    if not isinstance(record, dict) or not isinstance(record.get("request"), dict) \
            or not isinstance(record.get("response"), dict):
        raise ValueError('a record is {"request": <the body sent>, "response": <the body returned>}')
    request, response = record["request"], record["response"]
    if response.get("object") not in ENDPOINTS:
        kind = response.get("object")
        hint = " (a streamed response: record the same request with stream=false)" if kind and "chunk" in kind else ""
        raise ValueError(f"the response's object is {kind!r}; expected one of {', '.join(ENDPOINTS)}{hint}")
    if not response.get("choices"):
        raise ValueError("the response has no choices")
    return request, response


def _replay_body(request: Dict[str, Any], response: Dict[str, Any]) -> Dict[str, Any]:
    body = copy.deepcopy(request)
    body["stream"] = False
    body.pop("stream_options", None)
    body["return_token_ids"] = True
    if body.get("seed") is None and "seed" in response["choices"][0]:
        body["seed"] = response["choices"][0]["seed"]  # the seed the server drew and reported
    body.pop("model", None)  # the local app serves the settings' model under its own name
    return body


def _replay(settings: Any, endpoint: str, body: Dict[str, Any]) -> Dict[str, Any]:
    from .server.app import create_app

    async def run() -> Tuple[int, Dict[str, Any]]:
        app = create_app(settings)
        st = app.state.server
        async with app.router.lifespan_context(app):
            await asyncio.get_running_loop().run_in_executor(None, st.loaded.wait)
            if st.load_error is not None:
                raise ValueError(f"the local server could not load the model: {st.load_error}")
            return await _post(app, endpoint, body)

    # The app's loading messages (meant for a server's console) go to stderr: stdout is the report.
    with contextlib.redirect_stdout(sys.stderr):
        status, data = asyncio.run(run())
    if status != 200:
        msg = data.get("error", {}).get("message", data) if isinstance(data, dict) else data
        raise ValueError(f"the local server refused the recorded request ({status}): {msg}")
    return data


async def _post(app: Any, path: str, body: Dict[str, Any]) -> Tuple[int, Any]:
    """One POST through the ASGI app, as uvicorn would deliver it."""
    raw = json.dumps(body).encode()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())],
             "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0)}
    delivered, done = False, asyncio.Event()
    status, chunks = 0, []

    async def receive() -> Dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await done.wait()  # the client stays until the response is complete
        return {"type": "http.disconnect"}

    async def send(message: Dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                done.set()

    await app(scope, receive, send)
    done.set()
    return status, json.loads(b"".join(chunks) or b"null")


def _logprob_entries(choice: Dict[str, Any]) -> Optional[List[Any]]:
    """A choice's logprobs, one entry per output position (the token's logprob and its
    alternatives), for either endpoint; None when there are none."""
    lp = choice.get("logprobs")
    if not lp:
        return None
    if "content" in lp:  # chat
        return [(e["logprob"], [(t["token"], t["logprob"]) for t in e.get("top_logprobs", [])]) for e in lp["content"]]
    tops = lp.get("top_logprobs") or [None] * len(lp["token_logprobs"])
    return list(zip(lp["token_logprobs"], tops))


def _first_difference(a: List[Any], b: List[Any]) -> Optional[int]:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _text(choice: Dict[str, Any]) -> Any:
    return choice["message"]["content"] if "message" in choice else choice.get("text")


def compare(endpoint: str, recorded: Dict[str, Any], replayed: Dict[str, Any]) -> Verification:
    """The checks of :func:`verify` on two responses to the same request."""
    by_index = {c["index"]: c for c in replayed["choices"]}
    checks = []
    for rc in recorded["choices"]:
        lc = by_index.get(rc["index"])
        c = ChoiceCheck(index=rc["index"])
        if lc is None:
            c.token_ids = False if "token_ids" in rc else None
            checks.append(c)
            continue
        if "token_ids" in rc:
            c.first_token_difference = _first_difference(rc["token_ids"], lc["token_ids"])
            c.token_ids = c.first_token_difference is None
        rl, ll = _logprob_entries(rc), _logprob_entries(lc)
        if rl is not None:
            c.first_logprob_difference = _first_difference(rl, ll or [])
            c.logprobs = c.first_logprob_difference is None
        c.text = _text(rc) == _text(lc)
        c.finish_reason = rc.get("finish_reason") == lc.get("finish_reason")
        c.fingerprint = rc.get("fingerprint") == lc.get("fingerprint")
        checks.append(c)
    prompt = None
    if "prompt_token_ids" in recorded:
        prompt = recorded["prompt_token_ids"] == replayed.get("prompt_token_ids")
    return Verification(endpoint, (str(recorded.get("system_fingerprint")), str(replayed.get("system_fingerprint"))),
                        prompt, checks, replayed)
