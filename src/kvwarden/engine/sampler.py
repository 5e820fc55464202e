"""Logprobs, top-k lists and token choice.

NOTE(invariance): a row's log-softmax never sees batch partners: on the CPU
each row is reduced alone, as a ``[1, vocab]`` tensor (torch splits a single
long row across threads differently from a batch of rows); on a GPU the
canonical Triton row kernel runs one program per row in a fixed order, so all
of a step's rows go in one launch (``engine/row_math.py``'s :class:`RowMath` is
the seam, and holds the seeded draws). Selections
(top-k, sorting) are exact and ties are broken by token id, so they are
functions of the values alone and may run on the whole step at once
(:func:`step_tops`): one launch sequence and one host transfer per step instead
of several per row.

Seeded sampling uses counter-based randomness: the uniform number of token
``i`` at position ``p`` is a hash of ``(seed, p, i)`` - integer arithmetic,
exact on every device - turned into an exponential race ``argmax(prob / E)``
with ``E = -log(u)``, which draws exactly from ``prob``. No generator carries
state between steps or requests, so the draw for position ``p`` depends on
nothing but the seed, the position and that row's distribution: not on batch
partners, preemption, earlier draws or speculative decoding.

Logprobs are the model's raw distribution (before temperature, top-k, top-p),
as vLLM reports by default; fingerprints therefore do not depend on sampling
parameters.
"""

from __future__ import annotations

from math import isfinite as math_isfinite
from typing import NamedTuple

import torch

from kvwarden.engine.request import TopLogprobs
from kvwarden.engine.row_math import RowMath
from kvwarden.engine.sampling_params import SamplingParams


class Sample(NamedTuple):
    """One chosen token (a named tuple: made for every token of every request, so cheap to build)."""

    token_id: int
    logprob: float
    top: TopLogprobs


class RowTops(NamedTuple):
    """One logits row's log-softmax (row ``row`` of the step's ``table``, on the device) and its exact top
    list, computed for the whole step, and (``token``) its seeded draw when the step drew it with the others.
    (A named tuple: one is made per sampled row per step.)"""

    table: torch.Tensor
    row: int
    top: TopLogprobs
    token: int | None = None
    token_logprob: float | None = None  # the drawn token's logprob, read with the rest (no read of its own)

    @property
    def logprobs(self) -> torch.Tensor:
        # NOTE: indexed on use only: most rows never need it, and a tensor view costs microseconds a row
        return self.table[self.row]


def top_logprobs(logprobs: torch.Tensor, k: int) -> list[tuple[int, float]]:
    """The ``k`` largest (id, logprob) pairs of one row, descending, ties by token id.

    Exact without sorting the vocabulary: every id whose value reaches the k-th
    largest value is a candidate (all ties included), and the candidates are
    sorted stably by value, so equal values keep ascending ids.
    """
    kk = max(k, 1)
    threshold = torch.topk(logprobs, kk).values[-1]
    candidates = torch.nonzero(logprobs >= threshold).view(-1)  # ascending ids
    order = torch.sort(logprobs[candidates], descending=True, stable=True).indices
    ids = candidates[order][:kk]
    return list(zip(ids.tolist(), logprobs[ids].tolist(), strict=True))


def step_tops(logits: torch.Tensor, k: int, math: RowMath) -> list[RowTops]:
    """Log-softmax and the exact top-``k`` list (ties by id) of every row of ``[R, vocab]`` at once.

    Equal to :func:`top_logprobs` per row: a row's candidates are the ids whose
    value reaches its ``k``-th largest; taking the ``m`` largest of every row,
    ``m`` the most candidates any row has, keeps all of each row's candidates,
    and sorting them by id then stably by value puts equal values in id order.
    """
    if logits.shape[0] == 0:
        return []
    logprobs = math.log_softmax_rows(logits)
    kk = max(k, 1)
    if kk == 1:
        return top1_lists(logprobs, top1_ids(logprobs))
    threshold = torch.topk(logprobs, kk, dim=-1).values[:, -1:]
    m = int((logprobs >= threshold).sum(dim=-1).max())  # the one host sync before the lists
    values, ids = torch.topk(logprobs, m, dim=-1)
    ids, by_id = torch.sort(ids, dim=-1)
    values = values.gather(-1, by_id)
    values, order = torch.sort(values, dim=-1, descending=True, stable=True)
    ids = ids.gather(-1, order)[:, :kk]
    pairs = zip(ids.tolist(), values[:, :kk].tolist(), strict=True)
    return [RowTops(logprobs, i, list(zip(i_ids, i_vals, strict=True))) for i, (i_ids, i_vals) in enumerate(pairs)]


def top1_ids(logprobs: torch.Tensor) -> torch.Tensor:
    """Each row's top id ``[R, 1]``, on the device (no host read): the list :func:`step_tops` gives for ``k = 1``.

    NOTE: one entry (no logprobs asked for: greedy rows and the NaN check need only the top): argmax returns
    the first maximum, the lowest id among ties, as the lists order them; argmax and a gather instead of two
    top-ks, two sorts, two gathers and a sync for the candidate count.
    """
    return torch.argmax(logprobs, dim=-1, keepdim=True)


def top1_lists(logprobs: torch.Tensor, ids1: torch.Tensor) -> list[RowTops]:
    """The one-entry top lists of :func:`top1_ids`' ids: the step's host read."""
    pairs = zip(ids1.view(-1).tolist(), logprobs.gather(-1, ids1).view(-1).tolist(), strict=True)
    return [RowTops(logprobs, i, [pair]) for i, pair in enumerate(pairs)]


class NonFiniteLogits(ValueError):
    """A row of logits with NaN (or only infinities): no token can be chosen from it."""

    code = "non_finite_logits"

    def __init__(self, position: int) -> None:
        super().__init__(
            f"the model produced non-finite logits (NaN or inf) for position {position}: the request was ended "
            "there (an overflow in the model's dtype, or non-finite weights); other requests are unaffected"
        )


def sample_row(
    logits: torch.Tensor,
    params: SamplingParams,
    seed: int,
    position: int,
    math: RowMath | None = None,
    pre: RowTops | None = None,
    allowed: torch.Tensor | None = None,
) -> Sample:
    """Choose the token at ``position`` from one row of float32 logits ``[vocab]``.

    ``pre``: the row's log-softmax and top list from :func:`step_tops` (with at
    least ``params.logprobs`` entries), saving the per-row work. ``allowed``: a
    structured output's mask (bool ``[vocab]``); the token is chosen among the
    allowed ids, the reported logprobs stay the raw distribution's.
    """
    if pre is not None and allowed is None:
        got = sample_from_tops(pre, params, position)
        if got is not None:
            return got
    math = math or RowMath()
    row = logits.view(1, -1)
    if pre is None:
        logprobs = math.log_softmax(row)[0]
        top = top_logprobs(logprobs, params.logprobs or 0)
    else:
        logprobs, top = pre.logprobs, pre.top
    _check_finite(top, position)
    if allowed is not None:
        return _masked(row[0], allowed, logprobs, top, params, seed, position, math)
    if params.greedy:
        token = top[0][0]
        return Sample(token_id=token, logprob=top[0][1], top=top[: params.logprobs or 0])
    token = _draw(row[0], params, seed, position, math)
    return Sample(token_id=token, logprob=float(logprobs[token]), top=top[: params.logprobs or 0])


def sample_from_tops(pre: RowTops, params: SamplingParams, position: int) -> Sample | None:
    """The token :func:`sample_row` chooses when the step's batched work already chose it (a greedy row's
    top, a seeded temperature-only draw), without the row's logits; None when the row must be sampled from
    them (top-k / top-p draws)."""
    top = pre.top
    _check_finite(top, position)
    if pre.token is not None and not params.greedy:
        logprob = pre.token_logprob if pre.token_logprob is not None else float(pre.logprobs[pre.token])
        return Sample(token_id=pre.token, logprob=logprob, top=top[: params.logprobs or 0])
    if params.greedy:
        return Sample(token_id=top[0][0], logprob=top[0][1], top=top[: params.logprobs or 0])
    return None


def _check_finite(top: TopLogprobs, position: int) -> None:
    # NOTE: a NaN row's top list is empty or NaN (no value reaches a NaN threshold): refuse it by name rather
    # than emit an arbitrary token or fail on an empty list
    if not top or not math_isfinite(top[0][1]):
        raise NonFiniteLogits(position)


def _masked(
    row: torch.Tensor,
    allowed: torch.Tensor,
    logprobs: torch.Tensor,
    top: TopLogprobs,
    params: SamplingParams,
    seed: int,
    position: int,
    math: RowMath,
) -> Sample:
    """The choice among allowed ids: the greedy maximum (ties to the lowest id, as unmasked) or the seeded
    draw from the masked distribution (forbidden ids get probability 0, the rest renormalise)."""
    masked = row.masked_fill(~allowed, float("-inf"))
    if params.greedy:
        token = int(torch.argmax(masked))  # the first maximum: the lowest id among equals
    else:
        token = _draw(masked, params, seed, position, math)
    return Sample(token_id=token, logprob=float(logprobs[token]), top=top[: params.logprobs or 0])


def prompt_logprob_rows(
    logits: torch.Tensor, next_tokens: list[int], k: int, math: RowMath | None = None
) -> list[TopLogprobs]:
    """Top-k lists for prompt positions; the actual next token is always included."""
    math = math or RowMath()
    out = []
    for i, token in enumerate(next_tokens):
        logprobs = math.log_softmax(logits[i].view(1, -1))[0]
        top = top_logprobs(logprobs, k)[:k]
        if all(t != token for t, _ in top):
            top.append((token, float(logprobs[token])))
        out.append(top)
    return out


def _draw(logits: torch.Tensor, params: SamplingParams, seed: int, position: int, math: RowMath) -> int:
    return math.draw(logits, params, seed, position)
