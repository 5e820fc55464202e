"""Stop conditions and incremental detokenization of a request's output."""

from __future__ import annotations

from kvwarden.engine.request import Request
from kvwarden.models.tokenizer import Tokenizer


def update_text_and_check_stop(req: Request, tokenizer: Tokenizer, max_model_len: int) -> str | None:
    """Refresh ``req.text`` after a token was appended; return a finish reason or ``None``.

    Order of checks follows vLLM: stop tokens (after ``min_tokens``), stop
    strings, then length limits.
    """
    params = req.params
    token = req.output_token_ids[-1]
    n_out = len(req.output_token_ids)
    if params.stop or not req.final_only:  # else decoded once when it finishes (LLMEngine._release)
        req.text = req.detok.update(tokenizer, req.output_token_ids, params.skip_special_tokens)
    if n_out >= params.min_tokens:
        if (not params.ignore_eos and token in tokenizer.eos_token_ids) or token in params.stop_token_ids:
            req.stop_reason = token
            return "stop"
        for stop in params.stop:
            # Earlier steps found no match, so any occurrence is new.
            idx = req.text.find(stop)
            if idx >= 0:
                end = idx + len(stop) if params.include_stop_str_in_output else idx
                req.text = req.text[:end]
                req.stop_reason = stop
                return "stop"
    if n_out >= params.max_tokens or req.num_tokens >= max_model_len:
        return "length"
    return None
