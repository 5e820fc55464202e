"""``POST /tokenize`` and ``POST /detokenize``, with vLLM's request and response shapes.

vLLM's benchmark client and other tools probe for them; the token ids returned
are exactly what the completions endpoint would feed the engine for the same
prompt (same tokenizer, same BOS rule, same chat template).
"""

from __future__ import annotations

from typing import Any

from kvwarden.server.async_engine import AsyncEngine
from kvwarden.server.protocol import ApiError, DetokenizeRequest, TokenizeRequest, require_text


class Tokenization:
    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    def tokenize(self, req: TokenizeRequest) -> dict[str, Any]:
        """``{"count", "max_model_len", "tokens", "token_strs"}``."""
        tokenizer = self.engine.engine.tokenizer
        if (req.prompt is None) == (req.messages is None):
            raise ApiError(400, "give exactly one of prompt or messages", "prompt", "invalid_value")
        require_text(req.prompt, "prompt")
        require_text(req.messages, "messages")
        if req.messages is not None:
            messages = [{"role": m.role, "content": m.text()} for m in req.messages]
            try:
                text = tokenizer.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt)
            except ValueError as exc:
                raise ApiError(400, str(exc), "messages", "invalid_value") from exc
        else:
            text = str(req.prompt)
        # Default: exactly what /v1/completions and /v1/chat/completions feed the engine for this input.
        ids = tokenizer.encode(text, add_special_tokens=req.add_special_tokens)
        strs = [tokenizer.id_to_token(t) or "" for t in ids] if req.return_token_strs else None
        return {"count": len(ids), "max_model_len": self.engine.engine.max_model_len, "tokens": ids, "token_strs": strs}

    def detokenize(self, req: DetokenizeRequest) -> dict[str, Any]:
        """``{"prompt": text}``; ids outside the vocabulary are a 400 naming ``tokens``."""
        vocab = self.engine.engine.model_config.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            message = f"tokens: id {bad[0]} is outside the vocabulary [0, {vocab})"
            raise ApiError(400, message, "tokens", "invalid_value")
        return {"prompt": self.engine.engine.tokenizer.decode(req.tokens, skip_special_tokens=False)}
