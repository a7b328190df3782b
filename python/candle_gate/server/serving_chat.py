"""``POST /v1/chat/completions``: messages through the model's chat template in, a message out.

A message's ``content`` may be a string or a list of ``{"type": "text"}`` parts (joined); its
other keys go to the template as they were sent; ``tools`` are passed to the template. Logprobs:
``logprobs: true`` (with ``top_logprobs: k`` alternatives) gives ``{"content": [{token, logprob,
bytes, top_logprobs: [{token, logprob, bytes}]}]}``.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List

from .errors import APIError, engine_error
from .protocol import ChatCompletionRequest, ChatMessage, finish_reason
from .serving import OpenAIServing, Prepared, StreamState


class OpenAIServingChat(OpenAIServing):
    endpoint = "chat"
    request_model = ChatCompletionRequest
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    id_prefix = "chatcmpl-"

    def prepare(self, req: ChatCompletionRequest) -> Prepared:
        if not req.messages:
            raise APIError(400, "messages must hold at least one message", "messages")
        try:
            ids = self.st.model.encode_chat(template_messages(req.messages), tools=req.tools)
        except (ValueError, TypeError, OverflowError) as e:
            raise engine_error(e, self.endpoint, fallback="messages") from None
        top = req.top_logprobs or 0
        if top and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", "top_logprobs")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        return Prepared(ids, max_tokens, logprobs=bool(req.logprobs), top_logprobs=top)

    def choice(self, c: Any, prep: Prepared) -> Dict[str, Any]:
        ch: Dict[str, Any] = {"index": c.index, "message": {"role": "assistant", "content": c.text},
                              "logprobs": None, "finish_reason": finish_reason(c.finish_reason)}
        if prep.logprobs:
            top = prep.top_logprobs
            ch["logprobs"] = {"content": [
                chat_logprob(self.st.token_str, t, l, c.top_logprob_ids[i] if top else (),
                             c.top_logprobs[i] if top else ())
                for i, (t, l) in enumerate(zip(c.token_ids, c.logprobs))]}
        return ch

    def opening(self, n: int) -> List[Dict[str, Any]]:
        return [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                 "finish_reason": None} for i in range(n)]

    def piece(self, i: int, text: str, logprobs: Any = None) -> Dict[str, Any]:
        return {"index": i, "delta": {"content": text}, "logprobs": logprobs, "finish_reason": None}

    def event_logprobs(self, ev: Dict[str, Any], i: int, state: StreamState) -> Any:
        return {"content": [chat_logprob(self.st.token_str, int(ev["token"]), ev["logprob"],
                                         ev.get("top_logprob_ids", ()), ev.get("top_logprobs", ()))]}

    def closing(self, i: int, reason: str) -> Dict[str, Any]:
        return {"index": i, "delta": {}, "logprobs": None, "finish_reason": reason}


def chat_logprob(token_str: Callable[[int], str], tid: int, lp: float, top_ids: Any, top_lps: Any) -> Dict[str, Any]:
    """One token's entry: its text, logprob and UTF-8 bytes, and its alternatives'."""
    s = token_str(int(tid))
    return {"token": s, "logprob": float(lp), "bytes": list(s.encode("utf-8")),
            "top_logprobs": [{"token": token_str(int(t)), "logprob": float(l),
                              "bytes": list(token_str(int(t)).encode("utf-8"))}
                             for t, l in zip(top_ids, top_lps)]}


def content_text(content: Any) -> Any:
    """OpenAI's content parts (``[{"type": "text", "text": ...}]``) as one string."""
    if isinstance(content, list):
        parts = []
        for p in content:
            if not (isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)):
                raise APIError(400, "only text content parts are supported", "messages")
            parts.append(p["text"])
        return "".join(parts)
    return content


def template_messages(msgs: List[ChatMessage]) -> List[Dict[str, Any]]:
    """The messages as the template receives them: the keys that were sent, content parts joined."""
    out = []
    for m in msgs:
        d = m.model_dump(exclude_unset=True)
        if "content" in d:
            d["content"] = content_text(d["content"])
        out.append(d)
    return out
