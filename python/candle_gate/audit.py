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

The model comes from the record unless it is given (:func:`replay_settings`): the name the
response (or the request) carries, as a known model's name, its file's name or stem, a path, or
a file in the model cache; else the recorded ``system_fingerprint`` matched against each known
model's SHA-256 in each mode and K/V dtype (gate off), which also gives the mode and the K/V
dtype. When neither finds it, the default model is used and :attr:`Origin.note` says "recorded
with X, replaying with Y".
"""
from __future__ import annotations

import asyncio
import contextlib
import copy
import functools
import io
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

#: the endpoint a response's ``object`` comes from
ENDPOINTS = {"text_completion": "/v1/completions", "chat.completion": "/v1/chat/completions"}


@dataclass(frozen=True)
class Origin:
    """Where the model a record is replayed on came from."""
    #: the model the record names (``response.model``, else ``request.model``; None: neither)
    recorded: Optional[str]
    #: the model replayed on (a known name or a path), its mode and K/V dtype
    model: str
    mode: str
    kv_dtype: str
    #: how it was found in the record: "model name", "system_fingerprint"; "given" (the caller
    #: chose it); None: not found, the default
    found_by: Optional[str]
    #: "recorded with X, replaying with Y" where the replay's model is not the one recorded
    note: Optional[str] = None

    def describe(self) -> str:
        how = {"model name": "from the record's model name", "system_fingerprint": "from the record's "
               "system_fingerprint", "given": "as given"}.get(self.found_by or "", "the default")
        return f"replayed on {self.model} (mode {self.mode}, kv {self.kv_dtype}; {how})"


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
    #: at the first differing position: the recorded and the replayed token (id and text), and
    #: the text around it, as lines for a person to read
    details: List[str] = field(default_factory=list)

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
    #: the model it was replayed on, and where that came from
    origin: Optional[Origin] = None

    @property
    def match(self) -> bool:
        return (self.system_fingerprint[0] == self.system_fingerprint[1] and self.prompt_token_ids is not False
                and len(self.choices) > 0 and all(c.match for c in self.choices))

    def summary(self) -> str:
        rec, loc = self.system_fingerprint
        lines = [f"{self.endpoint}: {'MATCH' if self.match else 'MISMATCH'}"]
        if self.origin is not None:
            lines.append(f"  {self.origin.note or self.origin.describe()}")
        lines.append(f"  system_fingerprint: {'same' if rec == loc else 'DIFFERENT'} (recorded {rec}, local {loc})")
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
            lines.extend(f"    {d}" for d in c.details)
        return "\n".join(lines)


def load_record(path: Union[str, Path]) -> Dict[str, Any]:
    try:
        record = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read the record {path}: {e}") from None
    return record


def verify(record: Dict[str, Any], settings: Any = None, *, on_origin: Optional[Callable[[Origin], None]] = None,
           **settings_kw: Any) -> Verification:
    """Replays ``record["request"]`` on an in-process server built from ``settings`` (a
    :class:`~candle_gate.server.Settings`, or its fields as keywords: ``model=``, ``mode=``,
    ``gate=``, ``kv_dtype=``, ...; what is not given comes from the record, see
    :func:`replay_settings`) and compares the response with ``record["response"]``.
    ``on_origin`` is told the model chosen before the replay starts."""
    request, response = _check_record(record)
    endpoint = ENDPOINTS[response["object"]]
    settings, origin = replay_settings(record, settings, **settings_kw)
    if on_origin is not None:
        on_origin(origin)
    replayed, model = _replay(settings, endpoint, _replay_body(request, response))
    v = compare(endpoint, response, replayed, _detokenizer(model))
    v.origin = origin
    return v


# ---------------------------------------------------------------------------------------------
# The model a record was served with

def replay_settings(record: Dict[str, Any], settings: Any = None, **settings_kw: Any) -> Tuple[Any, Origin]:
    """The settings to replay ``record`` with, and where its model came from. ``settings`` (or
    ``model=`` among the keywords) chooses the model; else it is the record's (its model name,
    else its ``system_fingerprint``, which also gives the mode and the K/V dtype where they are
    not given), else the default model, with a note saying so."""
    from .models import DEFAULT_MODEL
    from .server.settings import Settings

    _check_record(record)
    recorded = _recorded_name(record)
    found, found_by = _model_of_record(record)
    if settings is None:
        kw = dict(settings_kw)
        if "model" in kw and kw["model"] is not None:
            given = True
        else:
            given = False
            kw["model"] = found[0] if found else DEFAULT_MODEL
            if found:
                for key, value in zip(("mode", "kv_dtype"), found[1:]):
                    if value is not None and kw.get(key) is None:
                        kw[key] = value
        settings = Settings(**{k: v for k, v in kw.items() if v is not None})
    else:
        given = True
    kv = settings.kv_dtype or _default_kv_dtype()
    if found and _same_model(found[0], settings.model):
        how, note = (found_by if not given else "given"), None
    else:
        how = "given" if given else None
        note = f"recorded with {recorded or 'an unnamed model'}, replaying with {settings.model}"
        if found:
            note += f" (the record's {found_by} names {found[0]})"
    return settings, Origin(recorded, str(settings.model), settings.mode, kv, how, note)


def _default_kv_dtype() -> str:
    from .engine import ENGINE_DEFAULTS
    return str(ENGINE_DEFAULTS["kv_dtype"])


def _recorded_name(record: Dict[str, Any]) -> Optional[str]:
    for part in ("response", "request"):
        name = record[part].get("model")
        if isinstance(name, str) and name:
            return name
    return None


def model_by_name(name: str) -> Optional[str]:
    """The model a served name stands for: a known model's name (also its file's name or stem),
    a path to a file, or a file of that name (or stem) in the model cache; None if none is."""
    from .models import KNOWN_MODELS, cache_dir

    if name in KNOWN_MODELS:
        return name
    for k in KNOWN_MODELS.values():
        if name in (k.file_name, Path(k.file_name).stem):
            return k.name
    p = Path(name).expanduser()
    if p.suffix == ".gguf" and p.is_file():
        return str(p)
    for candidate in (cache_dir() / name, cache_dir() / f"{name}.gguf"):
        if candidate.suffix == ".gguf" and candidate.is_file():
            return str(candidate)
    return None


def model_by_fingerprint(system_fingerprint: str) -> Optional[Tuple[str, str, str]]:
    """``(model, mode, kv_dtype)`` whose engine, gate off and no profile, on this host and build,
    reports ``system_fingerprint``: every known model's SHA-256 (then each other GGUF in the model
    cache) in every mode and K/V dtype. None: no such stack here."""
    from . import _native
    from .engine import MODES
    from .models import KNOWN_MODELS, cache_dir

    def match(sha: str) -> Optional[Tuple[str, str]]:
        for mode in MODES:
            for kv in ("f16", "f32"):
                if _native.system_fingerprint(sha, mode, kv) == system_fingerprint:
                    return mode, kv
        return None

    for k in KNOWN_MODELS.values():
        m = match(k.sha256)
        if m:
            return (k.name, *m)
    known_files = {k.file_name for k in KNOWN_MODELS.values()}
    for f in sorted(cache_dir().glob("*.gguf")) if cache_dir().is_dir() else []:
        if f.name not in known_files:
            m = match(_file_sha256(str(f), f.stat().st_size, f.stat().st_mtime_ns))
            if m:
                return (str(f), *m)
    return None


@functools.lru_cache(maxsize=None)
def _file_sha256(path: str, size: int, mtime_ns: int) -> str:
    from .models import _sha256
    return _sha256(Path(path))


def _model_of_record(record: Dict[str, Any]) -> Tuple[Optional[Tuple[str, Optional[str], Optional[str]]], str]:
    """``((model, mode, kv_dtype), how)``: the model the record names, else the one its
    fingerprint matches (with its mode and K/V dtype); ``(None, "")`` when neither finds one."""
    for part in ("response", "request"):
        name = record[part].get("model")
        if isinstance(name, str) and name:
            found = model_by_name(name)
            if found is not None:
                return (found, None, None), "model name"
    fp = record["response"].get("system_fingerprint")
    if isinstance(fp, str) and fp:
        by_fp = model_by_fingerprint(fp)
        if by_fp is not None:
            return by_fp, "system_fingerprint"
    return None, ""


def _same_model(a: str, b: str) -> bool:
    """Whether two model names (known names or paths) are the same file."""
    from .models import resolve
    if a == b:
        return True
    try:
        return resolve(a, download=False).resolve() == resolve(b, download=False).resolve()
    except (FileNotFoundError, OSError):
        return False


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


def _replay(settings: Any, endpoint: str, body: Dict[str, Any]) -> Tuple[Dict[str, Any], Any]:
    """The replayed response, and the model (its tokenizer) that gave it."""
    from .server.app import create_app

    async def run() -> Tuple[int, Dict[str, Any], Any]:
        app = create_app(settings)
        st = app.state.server
        async with app.router.lifespan_context(app):
            await asyncio.get_running_loop().run_in_executor(None, st.loaded.wait)
            if st.load_error is not None:
                raise ValueError(f"the local server could not load the model: {st.load_error}")
            status, data = await _post(app, endpoint, body)
            return status, data, st.model

    # The app's console messages (the "serve: model ... at http://..." banner) are a server's:
    # nothing listens here, so they are dropped. Errors come back as exceptions.
    with contextlib.redirect_stdout(io.StringIO()):
        status, data, model = asyncio.run(run())
    if status != 200:
        msg = data.get("error", {}).get("message", data) if isinstance(data, dict) else data
        raise ValueError(f"the local server refused the recorded request ({status}): {msg}")
    return data, model


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


#: ``token ids -> text``; None: no tokenizer, ids are shown alone
Detokenizer = Optional[Callable[[List[int]], str]]


def _detokenizer(model: Any) -> Detokenizer:
    if model is None:
        return None

    def detok(ids: List[int]) -> str:
        return model.detokenize([int(t) for t in ids])
    return detok


#: tokens of text shown before and after a difference
CONTEXT_BEFORE, CONTEXT_AFTER = 8, 4


def _token(detok: Detokenizer, ids: List[int], pos: int) -> str:
    if pos >= len(ids):
        return "(none: the output ends before)"
    return f"{ids[pos]} {_text_of(detok, ids[pos:pos + 1])}"


def _text_of(detok: Detokenizer, ids: List[int]) -> str:
    if detok is None:
        return repr(ids)
    try:
        return repr(detok(ids))
    except (ValueError, TypeError, OverflowError):  # ids another vocabulary gave
        return repr(ids)


def token_difference(detok: Detokenizer, recorded: List[int], replayed: List[int], pos: int) -> List[str]:
    """Lines showing the first differing token at output position ``pos``: the recorded and the
    replayed token, and the text before and after it."""
    before = _text_of(detok, recorded[max(0, pos - CONTEXT_BEFORE):pos])
    return [f"at output position {pos}: recorded token {_token(detok, recorded, pos)}, "
            f"replayed {_token(detok, replayed, pos)}",
            f"  after {before}: recorded {_text_of(detok, recorded[pos:pos + CONTEXT_AFTER])}, "
            f"replayed {_text_of(detok, replayed[pos:pos + CONTEXT_AFTER])}"]


def _text_difference(recorded: Any, replayed: Any, width: int = 24) -> List[str]:
    if not (isinstance(recorded, str) and isinstance(replayed, str)):
        return [f"text: recorded {recorded!r}, replayed {replayed!r}"]
    i = _first_difference(list(recorded), list(replayed)) or 0
    return [f"text: first difference at character {i}: after {recorded[max(0, i - width):i]!r}, recorded "
            f"{recorded[i:i + width]!r}, replayed {replayed[i:i + width]!r}"]


def compare(endpoint: str, recorded: Dict[str, Any], replayed: Dict[str, Any],
            detok: Detokenizer = None) -> Verification:
    """The checks of :func:`verify` on two responses to the same request (``detok``: the
    tokenizer's ``ids -> text``, to show a difference's tokens as text)."""
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
            if not c.token_ids:
                c.details += token_difference(detok, rc["token_ids"], lc["token_ids"], c.first_token_difference)
        rl, ll = _logprob_entries(rc), _logprob_entries(lc)
        if rl is not None:
            c.first_logprob_difference = _first_difference(rl, ll or [])
            c.logprobs = c.first_logprob_difference is None
            i = c.first_logprob_difference
            if i is not None and c.token_ids is not False:
                got = (ll or [])[i] if i < len(ll or []) else None
                c.details.append(f"logprobs at output position {i}: recorded {rl[i] if i < len(rl) else None}, "
                                 f"replayed {got}")
        c.text = _text(rc) == _text(lc)
        if not c.text and c.token_ids is None:
            c.details += _text_difference(_text(rc), _text(lc))
        c.finish_reason = rc.get("finish_reason") == lc.get("finish_reason")
        c.fingerprint = rc.get("fingerprint") == lc.get("fingerprint")
        checks.append(c)
    prompt = None
    if "prompt_token_ids" in recorded:
        prompt = recorded["prompt_token_ids"] == replayed.get("prompt_token_ids")
    return Verification(endpoint, (str(recorded.get("system_fingerprint")), str(replayed.get("system_fingerprint"))),
                        prompt, checks, replayed)
