"""What the engine hands back: one :class:`RequestOutput` per request update."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvwarden.engine.request import Request, TopLogprobs
from kvwarden.engine.spec_stats import SpecStats


@dataclass
class RequestOutput:
    """A request's state after a step (cumulative, not a delta).

    Attributes:
        request_id: the id given to ``add_request``.
        prompt_token_ids: the prompt as token ids.
        token_ids: generated tokens (stop tokens included, as in vLLM).
        text: detokenized output (stop strings removed unless asked to keep them).
        logprobs: top-k ``(token_id, logprob)`` pairs per generated token, or
            ``None`` when the request did not ask for logprobs.
        sampled_logprobs: the logprob of each generated token.
        prompt_logprobs: per prompt position (``None`` at position 0), when asked.
        num_cached_tokens: prompt tokens served from the prefix cache.
        finish_reason: ``"stop"``, ``"length"``, ``"abort"`` or ``None`` while running.
        stop_reason: the stop string or token id that ended the request.
        prompt_logits: ``[prompt_len, vocab]`` float32 logits when captured.
        spec_stats: speculative-decoding acceptance so far (``num_drafts``,
            ``num_draft_tokens``, ``num_accepted_tokens``, ``accept_length``,
            ``accept_rate``), ``None`` when speculation is off.
        error: why the engine ended the request itself (a structured output's grammar that could not
            go on, non-finite logits), with ``finish_reason`` ``"abort"``; ``None`` otherwise;
            ``error_code`` names the kind (``structured_output_failed``, ``non_finite_logits``).
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    logprobs: list[TopLogprobs] | None
    sampled_logprobs: list[float]
    prompt_logprobs: list[TopLogprobs | None] | None
    num_cached_tokens: int
    finish_reason: str | None
    stop_reason: str | int | None = None
    num_preemptions: int = 0
    prompt: str | None = field(default=None, repr=False)
    prompt_logits: torch.Tensor | None = field(default=None, repr=False)
    spec_stats: SpecStats | None = None
    error: str | None = None
    error_code: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @classmethod
    def of(cls, req: Request, prompt: str | None = None) -> RequestOutput:
        params = req.params
        return cls(
            request_id=req.request_id,
            prompt_token_ids=list(req.prompt_token_ids),
            token_ids=list(req.output_token_ids),
            text=req.text,
            logprobs=[list(t) for t in req.logprobs] if params.logprobs is not None else None,
            sampled_logprobs=list(req.sampled_logprobs),
            prompt_logprobs=list(req.prompt_logprobs) if params.prompt_logprobs is not None else None,
            num_cached_tokens=max(req.num_cached_tokens, 0),
            finish_reason=req.finish_reason,
            stop_reason=req.stop_reason,
            num_preemptions=req.num_preemptions,
            prompt=prompt,
            prompt_logits=torch.stack(req.prompt_logits) if req.capture_logits and req.prompt_logits else None,
            spec_stats=req.spec_stats.copy() if req.spec_stats is not None else None,
            error=req.error,
            error_code=req.error_code,
        )
