"""A request's state while it moves through the engine."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvwarden.cache.kv_cache_manager import CacheView
from kvwarden.engine.detokenizer import IncrementalText
from kvwarden.engine.sampling_params import SamplingParams
from kvwarden.engine.spec_stats import SpecStats

if TYPE_CHECKING:
    from kvwarden.engine.structured.state import GrammarState

TopLogprobs = list[tuple[int, float]]


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    REMOTE = "remote"  # blocks allocated; another instance is writing the prompt's KV into them
    FINISHED = "finished"


@dataclass
class Request(CacheView):
    """One generation request.

    NOTE(invariant): ``num_computed_tokens`` catches up with
    ``len(all_token_ids)``; the step in which they become equal yields logits,
    and the sampled token is appended (so they differ by one again).

    Attributes:
        prompt_token_ids: the prompt.
        params: sampling parameters.
        seed: the seed actually used (``params.seed`` or a drawn one).
        output_token_ids: generated tokens so far.
        logprobs: top-k (token id, logprob) pairs per generated token.
        prompt_logprobs: per prompt position (``None`` for position 0).
        num_cached_tokens: prompt tokens served by the prefix cache at first
            scheduling (``-1`` until scheduled).
        finish_reason: ``"stop"``, ``"length"`` or ``"abort"`` once finished.
        stop_reason: the stop string or token id that ended generation.
        capture_logits: keep the float32 logits of every prompt position in
            ``prompt_logits`` (for :meth:`kvwarden.LLM.score` and the tools).
        final_only: the caller wants the finished output only (offline
            ``generate``): no output per step, and without stop strings the
            text is decoded once, at the end.
        spec_token_ids: draft tokens proposed for the next step. NOTE(invariant):
            they never enter ``all_token_ids`` (so never a block hash or the
            prefix cache) until the target has chosen the same token there.
        spec_stats: acceptance counts (``None`` when speculation is off).
        remote_prefill: a prefill instance computes ``prompt[:-1]`` and writes
            its KV (and recurrent state) into this request's blocks; the
            request waits in ``Status.REMOTE`` until :meth:`Scheduler.remote_done`.
        hold_blocks: on finishing, the blocks and working state stay allocated
            (a prefill instance still reads them for a transfer) until
            :meth:`kvwarden.engine.remote_kv.RemoteKV.release`.
        grammar: a structured output's matcher (``None`` without one), advanced
            by every emitted token.
    """

    prompt_token_ids: list[int] = field(default_factory=list)
    params: SamplingParams = field(default_factory=SamplingParams)
    seed: int = 0
    status: Status = Status.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[TopLogprobs] = field(default_factory=list)
    sampled_logprobs: list[float] = field(default_factory=list)
    prompt_logprobs: list[TopLogprobs | None] = field(default_factory=list)
    num_cached_tokens: int = -1
    num_preemptions: int = 0
    finish_reason: str | None = None
    error: str | None = None  # why the engine ended the request itself (finish_reason "abort")
    error_code: str | None = None  # that failure's kind, as the API reports it
    stop_reason: str | int | None = None
    text: str = ""
    detok: IncrementalText = field(default_factory=IncrementalText)  # how ``text`` grows, a window a step
    capture_logits: bool = False
    final_only: bool = False
    prompt_logits: list[torch.Tensor] = field(default_factory=list)
    spec_token_ids: list[int] = field(default_factory=list)
    spec_stats: SpecStats | None = None
    remote_prefill: bool = False
    hold_blocks: bool = False
    grammar: GrammarState | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens_to_compute(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def wants_prompt_scores(self) -> bool:
        return self.params.prompt_logprobs is not None or self.capture_logits

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
