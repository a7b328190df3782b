"""``POST /v1/completions``: a prompt (a string, token ids, or a list of one string) in, text out.

Logprobs in OpenAI's legacy shape: ``{tokens, token_logprobs, top_logprobs: [{token: logprob}],
text_offset}``, ``logprobs: k`` asking for k alternatives per token (0: only the chosen one's).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

from .errors import APIError, engine_error
from .protocol import CompletionRequest, finish_reason
from .serving import OpenAIServing, Prepared, StreamState

#: OpenAI's default ``max_tokens`` for a completion
DEFAULT_COMPLETION_TOKENS = 16


class OpenAIServingCompletion(OpenAIServing):
    endpoint = "completion"
    request_model = CompletionRequest
    object = "text_completion"
    chunk_object = "text_completion"
    id_prefix = "cmpl-"

    def prepare(self, req: CompletionRequest) -> Prepared:
        p: Any = req.prompt
        if isinstance(p, list) and p and isinstance(p[0], str):
            if len(p) != 1:
                raise APIError(400, "a list of several prompts is not supported; send one request per prompt",
                               "prompt")
            p = p[0]
        try:
            ids = self.st.model.encode_prompt(p)
        except (ValueError, TypeError, OverflowError) as e:
            raise engine_error(e, self.endpoint, fallback="prompt") from None
        max_tokens = DEFAULT_COMPLETION_TOKENS if req.max_tokens is None else req.max_tokens
        return Prepared(ids, max_tokens, logprobs=req.logprobs is not None, top_logprobs=req.logprobs or 0)

    def choice(self, c: Any, prep: Prepared) -> Dict[str, Any]:
        ch: Dict[str, Any] = {"index": c.index, "text": c.text, "logprobs": None,
                              "finish_reason": finish_reason(c.finish_reason)}
        if prep.logprobs:
            ch["logprobs"] = completion_logprobs(self.st.token_str, c.token_ids, c.logprobs,
                                                 c.top_logprob_ids if prep.top_logprobs else None, c.top_logprobs)
        return ch

    def piece(self, i: int, text: str, logprobs: Any = None) -> Dict[str, Any]:
        return {"index": i, "text": text, "logprobs": logprobs, "finish_reason": None}

    def event_logprobs(self, ev: Dict[str, Any], i: int, state: StreamState) -> Any:
        tid = int(ev["token"])
        lp = completion_logprobs(self.st.token_str, [tid], [ev["logprob"]], [ev.get("top_logprob_ids", ())],
                                 [ev.get("top_logprobs", ())], state.offsets[i])
        state.offsets[i] += len(self.st.token_str(tid))
        return lp

    def closing(self, i: int, reason: str) -> Dict[str, Any]:
        return {"index": i, "text": "", "logprobs": None, "finish_reason": reason}


def completion_logprobs(token_str: Callable[[int], str], ids: Any, lps: Any, top_ids: Optional[Any], top_lps: Any,
                        offset0: int = 0) -> Dict[str, Any]:
    """The legacy logprobs object of ``ids`` (their log-probabilities ``lps``, per token the
    alternatives ``top_ids[i]`` with ``top_lps[i]``), text offsets counted from ``offset0``."""
    tokens: List[str] = []
    offsets: List[int] = []
    tops: List[Dict[str, float]] = []
    off = offset0
    for i, tid in enumerate(ids):
        s = token_str(int(tid))
        tokens.append(s)
        offsets.append(off)
        off += len(s)
        row = {}
        if top_ids is not None and len(top_ids) > i:
            for t, l in zip(top_ids[i], top_lps[i]):
                row[token_str(int(t))] = float(l)
        tops.append(row)
    return {"tokens": tokens, "token_logprobs": [float(x) for x in lps], "top_logprobs": tops,
            "text_offset": offsets}
