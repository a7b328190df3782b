"""``POST /tokenize`` and ``POST /detokenize`` (vLLM's endpoints of the same names)."""
from __future__ import annotations

from typing import Any, Dict

from fastapi import Request

from .errors import APIError, engine_error
from .protocol import DetokenizeRequest, TokenizeRequest, parse, read_body
from .serving_chat import template_messages
from .state import ServerState


class OpenAIServingTokenization:
    def __init__(self, st: ServerState):
        self.st = st

    async def tokenize(self, request: Request) -> Dict[str, Any]:
        """``prompt`` (a string) or ``messages`` (through the chat template) -> token ids."""
        req = parse(TokenizeRequest, await read_body(request, self.st.settings.read_timeout))
        self.st.check_model(req.model)
        if req.messages is None and req.prompt is None:
            raise APIError(400, "pass `prompt` (a string) or `messages`", "prompt")
        try:
            if req.messages is not None:
                ids = self.st.model.encode_chat(template_messages(req.messages))
            else:
                ids = self.st.model.tokenize(req.prompt)
        except (ValueError, TypeError, OverflowError) as e:
            endpoint, field = ("chat", "messages") if req.messages is not None else ("completion", "prompt")
            raise engine_error(e, endpoint, fallback=field) from None
        return {"tokens": ids, "count": len(ids), "max_model_len": self.st.max_model_len}

    async def detokenize(self, request: Request) -> Dict[str, Any]:
        """Token ids (within the vocabulary) -> text."""
        req = parse(DetokenizeRequest, await read_body(request, self.st.settings.read_timeout))
        self.st.check_model(req.model)
        vocab = int(self.st.model.config.get("vocab", 0) or 0)
        bad = [t for t in req.tokens if t < 0 or (vocab and t >= vocab)]
        if bad:
            raise APIError(400, f"token id {bad[0]} is outside the vocabulary of {vocab}", "tokens")
        try:
            return {"prompt": self.st.model.detokenize(req.tokens)}
        except (ValueError, TypeError, OverflowError) as e:
            raise engine_error(e, fallback="tokens") from None
