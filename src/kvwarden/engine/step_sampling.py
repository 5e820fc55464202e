"""The sampler's work for a whole step: every sampled row at once, and prompt scores.

:func:`row_tops` batches what per-row sampling would repeat per request (see
``sampler.step_tops`` / ``sampler.draw_rows`` for why the batch gives each row
its own bits); :func:`record_prompt_scores` stores prompt logprobs and captured
logits as chunks of a prompt are computed.
"""

from __future__ import annotations

import torch

from kvwarden.engine.model_runner import StepLogits
from kvwarden.engine.sampler import RowMath, RowTops, batchable, prompt_logprob_rows, step_tops
from kvwarden.engine.scheduler import ScheduledChunk, SchedulerOutput


def row_tops(completed: list[ScheduledChunk], step: StepLogits, math: RowMath) -> dict[int, RowTops] | None:
    """Log-softmax and top lists of every sampled row of the step, in one batch, keyed by logits row."""
    if not completed:
        return None
    owners = [(r, c.request, j) for c in completed for j, r in enumerate(step.sample_rows[c.request.request_id])]
    rows = [r for r, _, _ in owners]
    k = max(c.request.params.logprobs or 0 for c in completed)
    if rows == list(range(step.logits.shape[0])):  # every row, in order (a decode step): no copy
        logits = step.logits
    else:
        logits = step.logits[torch.tensor(rows, dtype=torch.long, device=step.logits.device)]
    tops = step_tops(logits, k, math)
    # Seeded rows drawn together too, where the backend draws a batch as it draws each row alone
    # (RowMath.draw_rows); row j of a request is its position num_tokens + j, the key plain decoding uses.
    seeded = [i for i, (_, req, _) in enumerate(owners) if batchable(req.params)]
    if seeded:
        params = [(owners[i][1], owners[i][2]) for i in seeded]
        tokens = math.draw_rows(
            logits[seeded],
            [req.params.temperature for req, _ in params],
            [req.seed for req, _ in params],
            [req.num_tokens + j for req, j in params],
        )
        if tokens is not None:
            for i, token in zip(seeded, tokens, strict=True):
                tops[i] = RowTops(tops[i].logprobs, tops[i].top, token)
    return dict(zip(rows, tops, strict=True))


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
