"""Overlapped scheduling: the next decode step is launched before the host reads this step's tokens.

Without it a decode step is strictly serial: the GPU runs step n, the host waits for its tokens, then does
its own work (stop checks, detokenizing, outputs, the next step's staging) while the GPU idles. At batch 64
that idle share was 45-60 % of a replayed step. With it, once step n's sampling is queued on the device,
the engine stages and replays step n+1 with step n's tokens taken from the device (a device-to-device copy
into the graph's token buffer), and only then reads step n's tokens; its per-request work runs while the GPU
computes step n+1. SGLang's overlap scheduler and vLLM's async scheduling do the same.

A step is launched ahead only when it is exactly the step the scheduler would choose next: every running
request decoded in step n, none waits (no prompt to admit), and each request's next token is chosen on the
device (greedy, or a seeded temperature-only draw: no top-k / top-p draw, grammar or logprob list on the
host), on a model whose decode step replays a graph with no per-step host state (attention-only models:
no recurrent states, no sparse-attention indexer), without speculation, a host tier, fault injection or
context parallelism. A request whose next token surely ends it (``max_tokens``, ``max_model_len``) is left
out; one that stops on a token the host has not seen yet (end of sequence, a stop string) rides along and
its row is dropped.

NOTE(invariance): no number can change. Each row of the early step is the row the next regular step would
compute: the same request, position and token (the one step n chose: the device holds it before the host
does), over the same blocks (allocated here as the scheduler would), in a graph whose rows never mix. A row
whose request ended meanwhile is computed and never read; its K/V lands in blocks the request still owned
when the step was queued, and every later use of those blocks is queued behind it on the same stream.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvwarden.cache.kv_cache_manager import KVCacheManager
from kvwarden.engine.device_copy import upload
from kvwarden.engine.model_runner import ModelRunner, StepLogits
from kvwarden.engine.request import Request
from kvwarden.engine.scheduler import ScheduledChunk, Scheduler, SchedulerOutput
from kvwarden.engine.step_sampling import StepTops


@dataclass
class AheadStep:
    """A decode step on the device whose outputs the engine has not processed: its chunks start at the
    position of a token their requests get only when the previous step is processed."""

    chunks: list[ScheduledChunk]
    logits: StepLogits

    def live(self) -> list[ScheduledChunk]:
        """The chunks whose requests are still running (the others ended meanwhile: their rows are dropped)."""
        return [c for c in self.chunks if not c.request.is_finished]


def why_not_overlapped(runner: ModelRunner, speculative: bool, host_tier: bool) -> str | None:
    """Why this engine never launches a step ahead, or None when it can (see the module's docstring)."""
    if runner.graphs is None:
        return "decode steps run eagerly (no CUDA graphs)"
    if runner.parallel is not None:
        return "context parallelism"
    if runner.states is not None:
        return "recurrent layers stage boundary states on the host after each step"
    if runner.model.cfg.mla is not None:
        return "sparse attention (DSA)"
    if speculative:
        return "speculative decoding decides on the host how far each request advances"
    if host_tier:
        return "the host tier copies blocks between steps"
    return None


class Overlap:
    """Launches the next decode step while the host still holds the previous one's outputs.

    Args:
        scheduler: the engine's scheduler (read only: which requests run and wait).
        kv: the block manager the early step's slots come from.
        runner: runs the early step (:meth:`ModelRunner.execute_ahead`).
        max_model_len: a request at the limit ends with its next token.
    """

    def __init__(self, scheduler: Scheduler, kv: KVCacheManager, runner: ModelRunner, max_model_len: int) -> None:
        assert runner.graphs is not None
        self.scheduler, self.kv, self.runner, self.max_model_len = scheduler, kv, runner, max_model_len
        self.max_size = runner.graphs.max_size
        self.launched = 0  # steps launched ahead
        self.dropped_rows = 0  # rows of requests that ended before their early step was processed

    def launch(self, sched: SchedulerOutput, completed: list[ScheduledChunk], tops: StepTops) -> AheadStep | None:
        """Queue the step after ``sched`` on the device, fed by ``tops``' tokens; None when it is not the step
        the scheduler would choose next, or when a row's token is chosen on the host."""
        sch = self.scheduler
        if sch.waiting or sch.remote or not (len(completed) == len(sched.chunks) == len(sch.running)):
            return None
        if len(tops.rows) != len(completed) or self.runner.tracer is not None:
            return None  # drafts (several rows a request)
        chunks: list[ScheduledChunk] = []
        rows: list[int] = []
        for i, c in enumerate(completed):
            req = c.request
            if req.grammar is not None or req.hold_blocks or req.wants_prompt_scores:
                return None
            if not self._ends_with_next_token(req):
                chunks.append(ScheduledChunk(req, c.end, 1))
                rows.append(i)
        if not chunks or len(chunks) > self.max_size:
            return None
        next_ids = tops.next_ids()
        if next_ids is None:
            return None
        # NOTE: allocate_slots is all or nothing per request and asks for what the next regular step would
        # ask for, so a refusal part-way leaves only blocks that step takes anyway.
        for c in chunks:
            if self.kv.allocate_slots(c.request, 1) is None:
                return None
        if len(rows) != len(completed):
            next_ids = next_ids[upload(rows, torch.long, next_ids.device)]
        self.launched += 1
        return AheadStep(chunks, self.runner.execute_ahead(chunks, self.kv, next_ids))

    def _ends_with_next_token(self, req: Request) -> bool:
        """The token being sampled now surely ends ``req``: its step after would be computed for nothing."""
        return len(req.output_token_ids) + 1 >= req.params.max_tokens or req.num_tokens + 1 >= self.max_model_len
