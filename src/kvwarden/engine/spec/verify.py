"""Verifying draft tokens against the target's own choices.

The target scores the request's last token and its ``k`` draft tokens in one
step, so it has ``k + 1`` rows of logits: row ``i`` is the distribution of the
token at position ``p + i``. With canonical numerics each row is bitwise the
row plain decoding would compute at that position (every kernel is row- and
chunk-invariant), so the question is only which tokens to keep.

``match`` (the default) walks the rows in order and chooses the target's token
at each position exactly as plain decoding would (greedy argmax, or the seeded
draw keyed by ``(seed, position)``); a draft token is accepted iff it equals
that choice, and the first mismatch ends the step with the target's own token.
Every emitted token is therefore the token speculation-off would have emitted:
the output is equal bit for bit, whatever was proposed.

``rejection`` is standard speculative sampling for a proposer whose draft is a
point mass (every proposer here drafts greedily): accept draft ``d`` with
probability ``p(d)``, else draw from ``p`` without ``d``. The distribution of
the output is the target's, but not the tokens speculation-off draws, so it is
labelled not invariant.
"""

from __future__ import annotations

import torch

from kvwarden.engine.randomness import draw_from, uniform
from kvwarden.engine.row_math import RowMath, sampling_probs
from kvwarden.engine.sampler import RowTops, Sample, sample_row
from kvwarden.engine.sampling_params import SamplingParams

# Randomness streams of rejection sampling (stream 0 is plain decoding's draw).
_ACCEPT_STREAM = 1
_RESIDUAL_STREAM = 2


def verify(
    logits: torch.Tensor,
    drafts: list[int],
    params: SamplingParams,
    seed: int,
    position: int,
    math: RowMath,
    acceptance: str = "match",
    pre: list[RowTops] | None = None,
    masks: torch.Tensor | None = None,
) -> tuple[list[Sample], int]:
    """Tokens to emit from ``len(drafts) + 1`` rows of logits, and how many drafts were accepted.

    Args:
        logits: ``[len(drafts) + 1, vocab]`` float32; row ``i`` scores position ``position + i``.
        drafts: the proposed tokens for positions ``position .. position + k - 1``.
        params, seed: the request's sampling parameters and seed.
        position: absolute position of the first token to emit.
        math: the sampler's row reductions.
        acceptance: ``"match"`` or ``"rejection"``.
        pre: each row's log-softmax and top list, computed for the whole step (optional).
        masks: a structured output's allowed tokens per row (``GrammarState.masks``): row ``i``
            after ``drafts[:i]``. It may have fewer rows than ``logits`` (it ends at a draft the
            grammar refuses, which then cannot be chosen, or after one that ends the grammar):
            verification stops there.

    Returns:
        ``(samples, accepted)``: ``accepted`` drafts then one token chosen by the
        target (a correction, or the bonus token after all drafts).
    """
    out: list[Sample] = []
    accepted = 0
    for i in range(len(drafts) + 1):
        if masks is not None and i == masks.shape[0]:
            break  # the previous draft ended the grammar: nothing may follow it
        pos = position + i
        allowed = masks[i] if masks is not None else None
        sample = sample_row(logits[i], params, seed, pos, math, pre[i] if pre is not None else None, allowed)
        if i < len(drafts) and acceptance == "rejection" and not params.greedy:
            sample = _rejection_step(logits[i], drafts[i], sample, params, seed, pos, math, allowed)
        out.append(sample)
        if i == len(drafts) or sample.token_id != drafts[i]:
            break
        accepted += 1  # (an accepted draft that ends the grammar leaves no row for a bonus token)
    return out, accepted


def _rejection_step(
    row: torch.Tensor,
    draft: int,
    plain: Sample,
    params: SamplingParams,
    seed: int,
    pos: int,
    math: RowMath,
    allowed: torch.Tensor | None = None,
) -> Sample:
    """Accept ``draft`` with probability p(draft); otherwise a draw from p with the draft removed
    (p over the allowed ids where a grammar masks the row; the logprob reported is the raw one)."""
    masked = row if allowed is None else row.masked_fill(~allowed, float("-inf"))
    probs = sampling_probs(masked, params, math)
    if uniform(seed, pos, _ACCEPT_STREAM) < float(probs[draft]):
        token = draft
    else:
        residual = probs.clone()
        residual[draft] = 0.0
        token = draw_from(residual, seed, pos, _RESIDUAL_STREAM) if float(residual.sum()) > 0 else draft
    logprobs = math.log_softmax(row.view(1, -1))[0]
    return Sample(token_id=token, logprob=float(logprobs[token]), top=plain.top)
