"""Deterministic top-k over rows of scores (the sparse-attention indexer's key selection).

NOTE(invariance), by construction: the selected set *and* its order are a function
of one row's scores alone. Every (score, column) pair of a row has a rank in one
total order - score descending, then column ascending (ties go to the lower
column) - computed by counting, for element ``i``, the elements that come before
it: ``#{j : s_j > s_i} + #{j < i : s_j == s_i}``. Counting is exact integer
arithmetic, so the rank does not depend on the order the counts are added in,
on the tile sizes, on which program ran first or on what other rows share the
launch. The ranks of a row are a permutation of ``0..n-1``; the element of rank
``r < k`` is written to output slot ``r`` by the one program that owns it - no
atomics, no arrival order (the fault of a kernel that hands out output slots by
atomic counter is exactly that its order, and under ties its set, follows
thread timing).

Scores are compared as float32. ``-inf`` marks a column that may not be chosen
(beyond the query's causal range): such columns rank after every finite one,
among themselves by column, so a row with fewer than ``k`` finite scores still
gets a deterministic fill. NaN is not a score (it compares false both ways and
would break the total order): callers must not produce it.

Cost: ``n`` comparisons per element, ``n^2`` per row - simple and exact, fine for
the lengths the presets reach; a radix select with the same total order is the
way to long contexts, and must keep this file's argument.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_I = 64  # candidates per program
BLOCK_J = 128  # competitors per loop step


@triton.jit(do_not_specialize=["n", "k", "stride"])
def _rank_select_kernel(s_ptr, idx_ptr, val_ptr, n, k, stride, BI: tl.constexpr, BJ: tl.constexpr):
    row = tl.program_id(0)
    offs_i = tl.program_id(1) * BI + tl.arange(0, BI)
    mask_i = offs_i < n
    base = s_ptr + row.to(tl.int64) * stride
    s_i = tl.load(base + offs_i, mask=mask_i, other=float("-inf")).to(tl.float32)
    rank = tl.zeros([BI], dtype=tl.int32)
    for j0 in range(0, n, BJ):
        offs_j = j0 + tl.arange(0, BJ)
        mask_j = offs_j < n
        s_j = tl.load(base + offs_j, mask=mask_j, other=float("-inf")).to(tl.float32)
        before = (s_j[None, :] > s_i[:, None]) | ((s_j[None, :] == s_i[:, None]) & (offs_j[None, :] < offs_i[:, None]))
        rank += tl.sum((before & mask_j[None, :]).to(tl.int32), axis=1)
    keep = mask_i & (rank < k)
    out = row.to(tl.int64) * k + rank
    tl.store(idx_ptr + out, offs_i.to(tl.int64), mask=keep)
    tl.store(val_ptr + out, s_i, mask=keep)


def topk_triton(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of ``scores [rows, n]``: the ``k`` best (values as float32, column indices as int64), in rank order."""
    rows, n = _check(scores, k)
    scores = scores.contiguous()
    idx = torch.empty(rows, k, dtype=torch.int64, device=scores.device)
    val = torch.empty(rows, k, dtype=torch.float32, device=scores.device)
    if rows and k:
        grid = (rows, triton.cdiv(n, BLOCK_I))
        _rank_select_kernel[grid](scores, idx, val, n, k, scores.stride(0), BI=BLOCK_I, BJ=BLOCK_J)
    return val, idx


def topk_reference(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same selection and order through a stable sort (the CPU path).

    A stable descending sort keeps equal scores in column order, which is this
    file's total order; ``torch.topk`` promises neither the order of ties nor
    which of several equal scores it returns.
    """
    _check(scores, k)
    order = torch.sort(scores.float(), dim=-1, descending=True, stable=True)
    return order.values[:, :k].contiguous(), order.indices[:, :k].contiguous()


def _check(scores: torch.Tensor, k: int) -> tuple[int, int]:
    if scores.dim() != 2:
        raise ValueError(f"top-k: scores must be [rows, n], got shape {tuple(scores.shape)}")
    rows, n = scores.shape
    if not 0 <= k <= n:
        raise ValueError(f"top-k: k must be in [0, {n}] for rows of {n} scores, got {k}")
    return rows, n
