"""The sampler's work for a whole step: every sampled row at once, and prompt scores.

:func:`launch_tops` batches what per-row sampling would repeat per request (see
``sampler.step_tops`` / ``row_math.draw_rows`` for why the batch gives each row
its own bits) and leaves the host read to :meth:`StepTops.collect`;
:func:`record_prompt_scores` stores prompt logprobs and captured logits as
chunks of a prompt are computed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvwarden.engine.device_copy import upload
from kvwarden.engine.model_runner import StepLogits
from kvwarden.engine.row_math import RowMath, batchable
from kvwarden.engine.sampler import RowTops, prompt_logprob_rows, step_tops, top1_ids
from kvwarden.engine.scheduler import ScheduledChunk, SchedulerOutput


@dataclass
class StepTops:
    """A step's sampled rows as the device computes them; :meth:`collect` is the step's host read.

    Split in two so that the engine can launch the next step between them (``engine/overlap.py``): the
    device work and the copies to the host are queued here, :meth:`next_ids` hands the chosen tokens to the
    next step without leaving the device, and :meth:`collect` waits for this step's copies only.
    """

    rows: list[int]  # logits rows, in the order of the lists
    logprobs: torch.Tensor | None  # [R, vocab] with ``ids1``
    ids1: torch.Tensor | None  # [R, 1] each row's top id (no logprobs asked for), else None
    lists: list[RowTops] | None  # the top lists when logprobs were asked for (their host read is paid)
    greedy: list[bool]
    seeded: list[int]  # indices (into ``rows``) of the rows ``draws`` drew
    draws: torch.Tensor | None  # [len(seeded)] their seeded tokens, on the device
    host: list[torch.Tensor] = field(default_factory=list)  # top ids, top values, draws, their logprobs
    ready: torch.cuda.Event | None = None  # recorded after the copies to ``host`` (a GPU)

    def queue_copies(self) -> None:
        """Queue the copies :meth:`collect` reads, right behind this step's sampling.

        NOTE: a host read queued later (``tolist`` on a device tensor) would sit behind whatever was
        queued meanwhile, the step launched ahead included, and wait for it; pinned copies and an event
        recorded now wait for this step alone.
        """
        parts = []
        if self.ids1 is not None and self.logprobs is not None:
            parts += [self.ids1.view(-1), self.logprobs.gather(-1, self.ids1).view(-1)]
        if self.draws is not None and self.logprobs is not None:
            picked = upload(self.seeded, torch.long, self.logprobs.device)
            parts += [self.draws, self.logprobs[picked, self.draws]]  # one element a row, not its whole row
        if parts and parts[0].is_cuda:
            self.host = [t.to("cpu", non_blocking=True) for t in parts]  # pinned: the copy does not block
            self.ready = torch.cuda.Event()
            self.ready.record()
        else:
            self.host = parts

    def next_ids(self) -> torch.Tensor | None:
        """Every row's chosen token ``[R]`` on the device, or None when some row is chosen on the host (a
        top-k / top-p draw, a grammar's mask, logprobs)."""
        if self.ids1 is None or len(self.seeded) + sum(self.greedy) != len(self.rows):
            return None
        ids = self.ids1.view(-1)
        if not self.seeded:
            return ids
        assert self.draws is not None
        ids = ids.clone()
        ids[upload(self.seeded, torch.long, ids.device)] = self.draws
        return ids

    def collect(self) -> dict[int, RowTops]:
        """The rows' top lists and draws on the host, keyed by logits row (waits for this step's copies)."""
        if self.ready is not None:
            self.ready.synchronize()
        host = [t.tolist() for t in self.host]
        if self.ids1 is not None and self.logprobs is not None:
            ids, values = host[0], host[1]
            table = self.logprobs
            tops = [RowTops(table, i, [(ids[i], values[i])]) for i in range(len(ids))]
            host = host[2:]
        else:
            assert self.lists is not None
            tops = self.lists
        if self.draws is not None:
            drawn, drawn_logprobs = host if host else (self.draws.tolist(), [None] * len(self.seeded))
            for i, token, logprob in zip(self.seeded, drawn, drawn_logprobs, strict=True):
                tops[i] = RowTops(tops[i].table, tops[i].row, tops[i].top, token, logprob)
        return dict(zip(self.rows, tops, strict=True))


def launch_tops(completed: list[ScheduledChunk], step: StepLogits, math: RowMath) -> StepTops | None:
    """Log-softmax, top lists and seeded draws of every sampled row of the step, in one batch, queued on the
    device with their copies to the host (see :class:`StepTops`)."""
    if not completed:
        return None
    owners = [(r, c.request, j) for c in completed for j, r in enumerate(step.sample_rows[c.request.request_id])]
    rows = [r for r, _, _ in owners]
    k = max(c.request.params.logprobs or 0 for c in completed)
    if rows == list(range(step.logits.shape[0])):  # every row, in order (a decode step): no copy
        logits = step.logits
    else:
        logits = step.logits[upload(rows, torch.long, step.logits.device)]
    logprobs, ids1, lists = None, None, None
    if k <= 1:
        logprobs = math.log_softmax_rows(logits)
        ids1 = top1_ids(logprobs)
    else:
        lists = step_tops(logits, k, math)
    greedy = [req.params.greedy and req.grammar is None for _, req, _ in owners]
    # Seeded rows drawn together too, where the backend draws a batch as it draws each row alone
    # (RowMath.draw_rows); row j of a request is its position num_tokens + j, the key plain decoding uses.
    seeded = [i for i, (_, req, _) in enumerate(owners) if batchable(req.params)]
    draws = None
    if seeded:
        params = [(owners[i][1], owners[i][2]) for i in seeded]
        every = len(seeded) == logits.shape[0]  # most steps: no gather
        draws = math.draw_ids(
            logits if every else logits[upload(seeded, torch.long, logits.device)],
            [req.params.temperature for req, _ in params],
            [req.seed for req, _ in params],
            [req.num_tokens + j for req, j in params],
        )
        if draws is None:
            seeded = []
    tops = StepTops(rows, logprobs, ids1, lists, greedy, seeded, draws)
    tops.queue_copies()
    return tops


def record_prompt_scores(sched: SchedulerOutput, step: StepLogits, math: RowMath) -> None:
    """Prompt logprobs (and captured prompt logits) of the positions this step computed."""
    for chunk in sched.chunks:
        req = chunk.request
        entry = step.prompt_rows.get(req.request_id)
        if entry is None:
            continue
        first, rows = entry
        if req.capture_logits:
            # Positions recorded before a preemption are recomputed identically; skip them.
            have = len(req.prompt_logits)
            req.prompt_logits.extend(step.logits[r].cpu() for r in rows[max(0, have - first) :])
        k = req.params.prompt_logprobs
        if k is None:
            continue
        # prompt_logprobs[j] scores token j (entry 0 is None), from the row of position j-1.
        usable = rows[: max(0, req.num_prompt_tokens - 1 - first)]
        skip = max(0, len(req.prompt_logprobs) - 1 - first)
        usable = usable[skip:]
        if usable:
            start = first + skip
            next_tokens = req.prompt_token_ids[start + 1 : start + 1 + len(usable)]
            req.prompt_logprobs.extend(prompt_logprob_rows(step.logits[usable], next_tokens, k, math))
