"""What both probes use: the prompts (checking, loading, their kinds), the concurrency levels,
the first difference of two outputs, the progress bar, and writing the JSON report.

The in-process probe (:mod:`.runner`, :mod:`.report`) and the endpoint probe (:mod:`.endpoint`)
read the same prompt files, compare outputs position by position the same way, and write their
JSON the same way; ``candle-gate probe``'s flags are :mod:`candle_gate.cli.probe`'s."""
from __future__ import annotations

import json
import os
import sys
from numbers import Integral
from typing import Any, List, Optional, Sequence, Union

import numpy as np
from tqdm import tqdm

from .. import _native

# ----------------------------------------------------------------------------- prompts


def is_chat(prompt: Any) -> bool:
    """A chat: a non-empty list of message dicts (a string or a list of token ids is not)."""
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict)


def prompt_kind(prompt: Any) -> str:
    """``"chat"``, ``"completion"`` (a string) or ``"token_ids"``."""
    if is_chat(prompt):
        return "chat"
    return "completion" if isinstance(prompt, str) else "token_ids"


def check_prompts(prompts: Any) -> List[Any]:
    """A non-empty list of prompts: strings, chats (lists of message dicts) or token-id lists
    (returned as lists of int). Raises ValueError naming the first bad prompt."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, (list, tuple)):
        raise ValueError(f"prompts must be a list, got {type(prompts).__name__}")
    if not prompts:
        raise ValueError("the prompt list is empty")
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            if not p.strip():
                raise ValueError(f"prompt {i} is empty")
        elif isinstance(p, list) and p and all(isinstance(m, dict) for m in p):
            try:  # the chat rules are the Rust side's (roles, content), checked without a model
                _native.check_chat(json.dumps(p, ensure_ascii=False))
            except TypeError as e:
                raise ValueError(f"prompt {i}: {e}") from None
        elif isinstance(p, (list, tuple)) and p and all(
                isinstance(t, (int, np.integer)) and not isinstance(t, bool) and t >= 0 for t in p):
            p = [int(t) for t in p]
        else:
            raise ValueError(f"prompt {i} must be a non-empty string, a chat (list of "
                             f"{{'role', 'content'}} dicts) or a list of token ids, got {p!r:.80}")
        out.append(p)
    return out


def check_concurrency(levels: Union[int, Sequence[int]]) -> List[int]:
    """Concurrency levels (an int or a list of ints): positive, in order, without repeats. The
    command line's ``"1,4,8"`` is :func:`candle_gate.cli.parse_concurrency`'s to read."""
    vals = [levels] if isinstance(levels, Integral) else levels
    if (isinstance(vals, (str, bytes)) or not isinstance(vals, Sequence) or not vals
            or any(isinstance(v, bool) or not isinstance(v, Integral) or v <= 0 for v in vals)):
        raise ValueError(f"concurrency must be a positive int or a list of positive ints, got {levels!r}")
    return list(dict.fromkeys(int(v) for v in vals))


def load_prompts(path: str) -> List[Any]:
    """A JSON list of prompts (strings, chats or token ids), or a text file with one prompt per
    line. A file whose first non-blank character is ``[`` or ``{``, or whose name ends in
    ``.json``, is read as JSON. Raises ValueError with the reason for anything else."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise ValueError(f"prompts file {path!r} does not exist") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"prompts file {path!r} is not UTF-8 text: {e}") from None
    except OSError as e:
        raise ValueError(f"cannot read prompts file {path!r}: {e}") from None
    stripped = text.lstrip()
    if not stripped:
        raise ValueError(f"prompts file {path!r} holds no prompts")
    if str(path).endswith(".json") or stripped.startswith(("[", "{")):
        try:
            data = json.loads(text)
        except ValueError as e:
            raise ValueError(f"prompts file {path!r} is not valid JSON: {e}") from None
        if not isinstance(data, list):
            raise ValueError(f"prompts file {path!r} must hold a JSON list of prompts "
                             f"(strings or lists of chat messages), got a {type(data).__name__}")
    else:
        data = [line for line in text.splitlines() if line.strip()]
    if not data:
        raise ValueError(f"prompts file {path!r} holds no prompts")
    try:
        return check_prompts(data)
    except ValueError as e:
        raise ValueError(f"prompts file {path!r}: {e}") from None


# ----------------------------------------------------------------------------- comparing


def first_difference(a: Sequence[Any], b: Sequence[Any]) -> Optional[int]:
    """The first position where two sequences (token ids, token strings, texts) differ, the
    shorter length when one is a prefix of the other, or None when they are equal."""
    m = min(len(a), len(b))
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        d = np.nonzero(np.asarray(a[:m]) != np.asarray(b[:m]))[0]
        if len(d):
            return int(d[0])
    else:
        for i in range(m):
            if a[i] != b[i]:
                return i
    return None if len(a) == len(b) else m


# ----------------------------------------------------------------------------- output


def progress_bar(total: int, label: str = "probe", enabled: bool = True, unit: str = "run") -> tqdm:
    """A ``tqdm`` bar on stderr, off when the caller is quiet (``enabled`` False) or stderr is not
    a terminal. Name the current phase with ``bar.set_postfix_str``; ``bar.update()`` per unit."""
    return tqdm(total=total, desc=label, unit=unit, file=sys.stderr, disable=None if enabled else True,
                dynamic_ncols=True)


def write_json(obj: Any, path: str, ensure_ascii: bool = True) -> None:
    """``obj`` as indented JSON at ``path``, written to a temporary file first (never half a file)."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, ensure_ascii=ensure_ascii)
        f.write("\n")
    os.replace(tmp, path)
