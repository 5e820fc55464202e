"""Turning engine outputs into OpenAI response pieces (shared by both endpoints)."""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from kvwarden.engine.outputs import RequestOutput
from kvwarden.engine.request import TopLogprobs
from kvwarden.engine.sampling_params import SamplingParams
from kvwarden.engine.spec_stats import SpecStats
from kvwarden.engine.structured.grammars import GrammarError, Grammars
from kvwarden.engine.structured.params import StructuredOutputsParams
from kvwarden.models.tokenizer import Tokenizer
from kvwarden.server.protocol import ApiError, refuse_unsupported
from kvwarden.server.structured import constraint_of

# Largest `n` per request; larger fan-outs are better sent as separate requests.
MAX_N = 16


class TokenText:
    """Token id -> the string shown in logprobs (``token_id:N`` when asked)."""

    def __init__(self, tokenizer: Tokenizer, as_ids: bool) -> None:
        self.tokenizer = tokenizer
        self.as_ids = as_ids

    def __call__(self, token_id: int) -> str:
        if self.as_ids:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def bytes_of(self, token_id: int) -> list[int]:
        return list(self.tokenizer.decode([token_id], skip_special_tokens=False).encode("utf-8"))


async def compile_constraint(
    req: Any, grammars: Grammars, adjust: Callable[[StructuredOutputsParams | None], Any] | None = None
) -> StructuredOutputsParams | None:
    """The request's constraint, compiled off the event loop and the engine thread; ``adjust`` turns it (or
    its absence) into the one the answer runs under (tool calls, a reasoning block before it).

    Raises:
        ApiError: 400 naming the field (malformed, several constraints, or not compilable).
    """
    refuse_unsupported(req)  # unknown and unsupported fields first: they are the likelier mistake
    try:
        found = constraint_of(req)
    except ValueError as exc:
        field, message = exc.args
        raise ApiError(400, f"{field}: {message}", field, "invalid_value") from exc
    params, field = found if found is not None else (None, "tools")
    if adjust is not None:
        params = adjust(params)
    if params is None:
        return None
    try:
        await asyncio.to_thread(grammars.compile, params)
    except GrammarError as exc:
        text = str(exc)
        if ": cannot be compiled: " in text:
            text = f"{field}: cannot be compiled: {text.split(': cannot be compiled: ', 1)[-1]}"
        raise ApiError(400, text, field, "invalid_value") from exc
    return params


def sampling_params(
    req: Any,
    *,
    max_tokens: int | None,
    prompt_len: int,
    max_model_len: int,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
    prompt_param: str = "prompt",
    kv_capacity: int | None = None,
    structured: StructuredOutputsParams | None = None,
) -> SamplingParams:
    """Validate an API request's sampling fields into :class:`SamplingParams`.

    Raises:
        ApiError: 400 naming the API field.
    """
    refuse_unsupported(req)
    if req.seed is not None and not -(2**63) <= req.seed < 2**64:
        raise ApiError(400, f"seed must be between -2**63 and 2**64 - 1, got {req.seed}", "seed", "invalid_value")
    if req.stream_options is not None and not req.stream:
        raise ApiError(400, "stream_options is only allowed when stream is true", "stream_options", "invalid_value")
    if structured is not None and req.stop:
        # a stop string can cut the constrained output mid-way (a date's "-"), leaving text the grammar never
        # allowed: refused, as ignore_eos is
        raise ApiError(
            400,
            "stop cannot be combined with a structured output (the grammar ends the output)",
            "stop",
            "invalid_value",
        )
    if not 1 <= req.n <= MAX_N:
        raise ApiError(400, f"n must be between 1 and {MAX_N}, got {req.n}", "n", "invalid_value")
    if prompt_len >= max_model_len:
        raise ApiError(
            400,
            f"This model's maximum context length is {max_model_len} tokens; the prompt has {prompt_len}.",
            prompt_param,
            "context_length_exceeded",
        )
    if max_tokens is None:
        max_tokens = max_model_len - prompt_len
        if kv_capacity is not None:  # unasked: generate while the pool can hold it
            max_tokens = max(1, min(max_tokens, kv_capacity - prompt_len))
    elif max_tokens >= 1 and prompt_len + max_tokens > max_model_len:
        raise ApiError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} in the completion).",
            "max_tokens",
            "context_length_exceeded",
        )
    elif kv_capacity is not None and max_tokens >= 1 and prompt_len + max_tokens > kv_capacity:
        # refused up front: such a request could never finish (it would be preempted and retried)
        raise ApiError(
            400,
            f"the prompt ({prompt_len} tokens) and max_tokens ({max_tokens}) need {prompt_len + max_tokens} "
            f"tokens of KV cache, but this server's whole pool holds {kv_capacity}; lower max_tokens",
            "max_tokens",
            "exceeds_kv_cache",
        )
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    values: dict[str, Any] = {
        "max_tokens": max_tokens,
        "min_tokens": req.min_tokens,
        "stop": stop,
        "stop_token_ids": list(req.stop_token_ids or []),
        "ignore_eos": req.ignore_eos,
        "skip_special_tokens": req.skip_special_tokens,
        "include_stop_str_in_output": req.include_stop_str_in_output,
        "logprobs": logprobs,
        "prompt_logprobs": prompt_logprobs,
        "seed": req.seed,
        "structured_outputs": structured,
    }
    for name in ("temperature", "top_p", "top_k"):
        value = getattr(req, name)
        if value is not None:
            values[name] = value
    try:
        return SamplingParams(**values)
    except ValueError as exc:
        param = str(exc).split(" ", 1)[0]
        raise ApiError(400, str(exc), param if param in values else None, "invalid_value") from exc


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """Params of choice ``index`` of ``n``: its own seed, a hash of ``(seed, index)``.

    Choice 0 keeps the request's seed (an ``n = 1`` request's answer). The others take 63 bits of SHA-256 over
    both numbers, not ``seed + index``: with that, ``seed=42, n=3`` and ``seed=43, n=3`` shared two samples.
    """
    if index == 0 or params.seed is None:
        return params
    digest = hashlib.sha256(f"kvwarden-choice:{params.seed}:{index}".encode()).digest()
    return params.replace(seed=int.from_bytes(digest[:8], "little") >> 1)


def usage(
    prompt_tokens: int, completion_tokens: int, cached_tokens: int, outputs: Iterable[RequestOutput] = ()
) -> dict[str, Any]:
    """OpenAI's usage object; with speculation on, ``spec_decoding`` totals over the outputs too."""
    body: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
    stats = [o.spec_stats for o in outputs if o.spec_stats is not None]
    if stats:
        total = SpecStats()
        for st in stats:
            total.num_drafts += st.num_drafts
            total.num_draft_tokens += st.num_draft_tokens
            total.num_accepted_tokens += st.num_accepted_tokens
        body["spec_decoding"] = total.as_dict()
    return body


def with_spec(choice: dict[str, Any], out: RequestOutput) -> dict[str, Any]:
    """Add the choice's cumulative ``spec_decoding`` statistics (speculation on only).

    Sent in every streamed chunk, so a proxy can watch acceptance during generation.
    """
    if out.spec_stats is not None:
        choice["spec_decoding"] = out.spec_stats.as_dict()
    return choice


def _first_per_text(top: TopLogprobs, token_text: TokenText) -> dict[str, float]:
    """``{text: logprob}`` of a top list in rank order, the first (highest-ranked) token of each text kept."""
    out: dict[str, float] = {}
    for token, lp in top:
        out.setdefault(token_text(token), lp)
    return out


def completion_logprobs(
    token_ids: list[int],
    sampled: list[float | None],
    tops: list[TopLogprobs | None],
    token_text: TokenText,
    text_offset_start: int = 0,
) -> dict[str, Any]:
    """Legacy completions logprobs object (``tokens``/``token_logprobs``/``top_logprobs``)."""
    tokens = [token_text(t) for t in token_ids]
    offsets, pos = [], text_offset_start
    for piece in tokens:
        offsets.append(pos)
        pos += len(piece)
    return {
        "tokens": tokens,
        "token_logprobs": sampled,
        # text keys can collide (two tokens with the same text): the highest-ranked one is kept (the list is in
        # rank order, so the first), as return_tokens_as_token_ids avoids altogether
        "top_logprobs": [None if top is None else _first_per_text(top, token_text) for top in tops],
        "text_offset": offsets,
    }


def chat_logprobs(token_ids: list[int], sampled: list[float], tops: list[TopLogprobs], token_text: TokenText) -> dict:
    content = []
    for token, lp, top in zip(token_ids, sampled, tops, strict=True):
        content.append(
            {
                "token": token_text(token),
                "logprob": lp,
                "bytes": token_text.bytes_of(token),
                "top_logprobs": [
                    {"token": token_text(t), "logprob": v, "bytes": token_text.bytes_of(t)} for t, v in top
                ],
            }
        )
    return {"content": content}


@dataclass
class DeltaTracker:
    """What a stream has already sent of one choice.

    Text is held back while it may still change: a trailing U+FFFD (an
    incomplete UTF-8 sequence) and, while stop strings are set, the last
    ``len(longest stop) - 1`` characters, which a stop string may still claim.
    """

    hold: int = 0
    sent_text: int = 0
    sent_tokens: int = 0
    created: int = field(default_factory=lambda: int(time.time()))

    def text_delta(self, out: RequestOutput) -> str:
        text = out.text
        end = len(text)
        if not out.finished:
            end = max(self.sent_text, end - self.hold)
            while end > self.sent_text and text[end - 1] == "\ufffd":
                end -= 1
        delta = text[self.sent_text : end]
        self.sent_text = max(self.sent_text, end)
        return delta

    def new_tokens(self, out: RequestOutput) -> range:
        start, self.sent_tokens = self.sent_tokens, len(out.token_ids)
        return range(start, self.sent_tokens)
