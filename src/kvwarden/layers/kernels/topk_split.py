"""The top-k's split forms: several programs share a row, one per chunk of its columns.

The invariance argument is ``topk.py``'s opening comment. Both forms give the one-program answer because
every program of a row derives the same choices from the same exact integer histograms (summed in split
order), and places its chunk's selection at the slot the exact counts of the chunks before it name. No
atomics, no grid-wide sync: a launch boundary orders each step after the one it reads.

* ``split_radix``: the four 8-bit radix passes, one launch each, every program re-deriving the prefix from
  all chunks' histograms of the passes before, then the compaction (five launches).
* ``split_buckets``: the bucket shortcut of ``topk.py`` spread over the chunks (five launches): each chunk's
  score range; its bucket histogram over the row's range; where the threshold's bucket is crowded, its
  sub-bucket histogram; each chunk lists its columns at or above the threshold's (bucket, sub-bucket) at
  the offset its earlier chunks' counts name (or, when the threshold is ``-inf``, compacts its chunk
  directly); then one program a row runs the radix passes and the compaction over the list of ``<= cap``
  columns, or over the whole row where the buckets did not narrow it (heavy ties, an infinite score).
  Every program re-derives the row's range from the per-chunk minima and maxima (``min``/``max`` are exact
  in any order) and its choices from at most two sums of histograms, where the radix form's last launch
  re-reads all four passes'.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvwarden.layers.kernels.topk_radix import (
    _bucket_count,
    _choose,
    _compact,
    _count,
    _gather,
    _passes,
    _range,
    _unsigned_key,
)


@triton.jit
def _replay(hist_row, S, split, k, PASSES: tl.constexpr):
    """The prefix and ``need`` after ``PASSES`` 8-bit passes, summed from the per-split histograms
    ``hist_row [4, S, 256]`` in split order; also, for the splits before ``split``, how many of their
    keys lie above the prefix so far and (after the last pass) equal it."""
    bins = tl.arange(0, 256)
    prefix = tl.zeros([], dtype=tl.int32)
    need = k
    above_before = 0
    equal_before = 0
    for p in tl.static_range(PASSES):
        total = tl.zeros([256], dtype=tl.int32)
        before = tl.zeros([256], dtype=tl.int32)
        for s in range(S):
            h = tl.load(hist_row + (p * S + s) * 256 + bins)
            total += h
            before += tl.where(s < split, h, 0)
        prefix, need, b = _choose(total, prefix, need, 8)
        above_before += tl.sum(tl.where(bins > b, before, 0), axis=0)
        equal_before = tl.sum(tl.where(bins == b, before, 0), axis=0)
    return prefix, need, above_before, equal_before


@triton.jit(do_not_specialize=["n", "k", "stride", "S"])
def _split_count_kernel(s_ptr, hist_ptr, n, k, stride, S, PASS: tl.constexpr, CHUNK: tl.constexpr,
                        BLOCK: tl.constexpr, MASKED: tl.constexpr):  # fmt: skip
    """Pass ``PASS`` for one chunk of a row: its histogram of the next 8 bits under the prefix so far."""
    row, split = tl.program_id(0), tl.program_id(1)
    base = s_ptr + row.to(tl.int64) * stride
    hist_row = hist_ptr + row.to(tl.int64) * 4 * S * 256
    prefix, _, _, _ = _replay(hist_row, S, split, k, PASS)
    lo = split * CHUNK
    hist = _count(base, base, lo, tl.minimum(lo + CHUNK, n), prefix, 24 - 8 * PASS, 8, BLOCK, MASKED, False)
    tl.store(hist_row + (PASS * S + split) * 256 + tl.arange(0, 256), hist)


@triton.jit(do_not_specialize=["n", "k", "stride", "S"])
def _split_compact_kernel(s_ptr, hist_ptr, idx_ptr, val_ptr, n, k, stride, S, CHUNK: tl.constexpr,
                          BLOCK: tl.constexpr):  # fmt: skip
    """The compaction of one chunk of a row, from the slot its earlier chunks' exact counts name."""
    row, split = tl.program_id(0), tl.program_id(1)
    base = s_ptr + row.to(tl.int64) * stride
    hist_row = hist_ptr + row.to(tl.int64) * 4 * S * 256
    prefix, need, above_before, equal_before = _replay(hist_row, S, split, k, 4)
    threshold = ~(prefix ^ 0x7FFFFFFF)
    written = above_before + tl.minimum(equal_before, need)  # equal keys go to the lowest columns first
    out = row.to(tl.int64) * k
    lo = split * CHUNK
    _compact(base, base, idx_ptr + out, val_ptr + out, lo, tl.minimum(lo + CHUNK, n), threshold, need,
             equal_before, written, BLOCK, False)  # fmt: skip


def split_radix(scores: torch.Tensor, k: int, idx: torch.Tensor, val: torch.Tensor, chunk: int, block: int,
                warps: int, masked: bool) -> None:  # fmt: skip
    """The radix split form into ``idx``/``val`` (``topk_triton`` checked the arguments)."""
    rows, n = scores.shape
    s = triton.cdiv(n, chunk)
    hist = torch.empty(rows, 4, s, 256, dtype=torch.int32, device=scores.device)
    for p in range(4):
        _split_count_kernel[(rows, s)](
            scores, hist, n, k, scores.stride(0), s, PASS=p, CHUNK=chunk, BLOCK=block, MASKED=masked,
            num_warps=warps,
        )  # fmt: skip
    _split_compact_kernel[(rows, s)](
        scores, hist, idx, val, n, k, scores.stride(0), s, CHUNK=chunk, BLOCK=block, num_warps=warps
    )


@triton.jit
def _row_scale(rng_row, S, SP: tl.constexpr):
    """The row's range from its chunks' (finite minimum, maximum) pairs: ``lo``, ``hi``, the buckets'
    ``scale`` and whether buckets apply (the one-program kernel's test, on the same values)."""
    i = tl.arange(0, SP)
    lo = tl.min(tl.load(rng_row + 2 * i, mask=i < S, other=float("inf")), axis=0)
    hi = tl.max(tl.load(rng_row + 2 * i + 1, mask=i < S, other=-float("inf")), axis=0)
    width = hi - lo  # +inf with an infinite score or an overflow; -inf when every score is -inf
    scale = tl.where(width > 0.0, 255.0 / tl.where(width > 0.0, width, 1.0), 0.0)
    return lo, hi, scale, (width < 3.0e38) & (scale < 3.0e38)


@triton.jit
def _sum_chunks(h_row, S, split):
    """A row's histogram summed over its ``S`` chunks in split order, and the part of it that the chunks
    before ``split`` hold (integer sums: exact in any order)."""
    bins = tl.arange(0, 256)
    total = tl.zeros([256], dtype=tl.int32)
    before = tl.zeros([256], dtype=tl.int32)
    for s in range(S):
        h = tl.load(h_row + s * 256 + bins)
        total += h
        before += tl.where(s < split, h, 0)
    return total, before


@triton.jit
def _plan(h1_row, h2_row, S, split, k, cap, lo, hi, scale, SUB: tl.constexpr):
    """A row's choices from its chunks' bucket histograms ``h1_row [S, 256]`` (and, with ``SUB``, the
    sub-bucket histograms ``h2_row`` of a crowded bucket), summed in split order: the threshold's bucket
    ``b1`` and what is still needed inside it, the sub-buckets' range, ``b2``, how many columns the list
    holds, how many of them lie in the chunks before ``split``, whether ``b1`` is crowded, and how many
    ``-inf`` scores the chunks before ``split`` hold."""
    bins = tl.arange(0, 256)
    total, before = _sum_chunks(h1_row, S, split)
    _, need1, b1 = _choose(total, tl.zeros([], dtype=tl.int32), k, 8)
    m = tl.sum(tl.where(bins == b1, total, 0), axis=0)
    above = k - need1  # scores in the buckets above b1
    listed = above + m
    at = tl.sum(tl.where(bins >= b1, before, 0), axis=0)
    crowded = (b1 > 0) & (above + m > cap)
    lo2 = lo
    scale2 = scale
    b2 = tl.full([], 1, tl.int32)  # every score's sub-bucket is >= 1: (b1, 1) is all of bucket b1
    if crowded:  # the sub-buckets of b1's nominal range, as the one-program kernel cuts them
        lo2 = lo + (b1 - 1).to(tl.float32) / scale
        hi2 = tl.where(b1 == 255, hi, lo + b1.to(tl.float32) / scale)
        width2 = hi2 - lo2
        scale2 = tl.where(width2 > 0.0, 255.0 / tl.where(width2 > 0.0, width2, 1.0), 0.0)
        if SUB:  # noqa: SIM102 - a compile-time branch around a run-time one (Triton has no `and` of the two)
            if scale2 < 3.0e38:
                total2, before2 = _sum_chunks(h2_row, S, split)
                _, need2, b2 = _choose(total2, tl.zeros([], dtype=tl.int32), need1, 8)
                listed = k - need2 + tl.sum(tl.where(bins == b2, total2, 0), axis=0)
                at = tl.sum(tl.where(bins > b1, before, 0), axis=0) + tl.sum(tl.where(bins >= b2, before2, 0), axis=0)
    return b1, need1, lo2, scale2, b2, listed, at, crowded, tl.sum(tl.where(bins == 0, before, 0), axis=0)


@triton.jit(do_not_specialize=["n", "stride", "S"])
def _bucket_range_kernel(s_ptr, rng_ptr, n, stride, S, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """One chunk's smallest finite score and its largest."""
    row, split = tl.program_id(0), tl.program_id(1)
    start = split * CHUNK
    lo, hi = _range(s_ptr + row.to(tl.int64) * stride + start, tl.minimum(CHUNK, n - start), BLOCK)
    at = rng_ptr + (row.to(tl.int64) * S + split) * 2
    tl.store(at, lo)
    tl.store(at + 1, hi)


@triton.jit(do_not_specialize=["n", "k", "stride", "S", "cap"])
def _bucket_count_kernel(s_ptr, rng_ptr, h1_ptr, h2_ptr, n, k, stride, S, cap, SUB: tl.constexpr,
                         CHUNK: tl.constexpr, BLOCK: tl.constexpr, SP: tl.constexpr):  # fmt: skip
    """One chunk's histogram of the row's 255 buckets or, with ``SUB``, of the threshold's crowded bucket's
    sub-buckets (nothing written where the row needs none: no later program reads it)."""
    row, split = tl.program_id(0), tl.program_id(1)
    start = split * CHUNK
    base = s_ptr + row.to(tl.int64) * stride + start
    cnt = tl.minimum(CHUNK, n - start)
    at = (row.to(tl.int64) * S + split) * 256 + tl.arange(0, 256)
    lo, hi, scale, ok = _row_scale(rng_ptr + row.to(tl.int64) * S * 2, S, SP)
    if ok:
        if SUB:
            h1_row = h1_ptr + row.to(tl.int64) * S * 256
            b1, _, lo2, scale2, _, _, _, crowded, _ = _plan(h1_row, h1_row, S, split, k, cap, lo, hi, scale, False)
            if crowded & (scale2 < 3.0e38):
                tl.store(h2_ptr + at, _bucket_count(base, cnt, lo, scale, b1, lo2, scale2, True, BLOCK))
        else:
            tl.store(h1_ptr + at, _bucket_count(base, cnt, lo, scale, 0, lo, scale, False, BLOCK))


@triton.jit(do_not_specialize=["n", "k", "stride", "S", "cap"])
def _bucket_list_kernel(s_ptr, rng_ptr, h1_ptr, h2_ptr, cols_ptr, idx_ptr, val_ptr, n, k, stride, S, cap,
                        CHUNK: tl.constexpr, BLOCK: tl.constexpr, SP: tl.constexpr):  # fmt: skip
    """One chunk's share of the row's list, at the offset its earlier chunks' counts name; where the
    threshold is ``-inf`` (fewer than ``k`` finite scores), its selection written directly instead."""
    row, split = tl.program_id(0), tl.program_id(1)
    base = s_ptr + row.to(tl.int64) * stride
    start = split * CHUNK
    end = tl.minimum(start + CHUNK, n)
    h1_row = h1_ptr + row.to(tl.int64) * S * 256
    h2_row = h2_ptr + row.to(tl.int64) * S * 256
    lo, hi, scale, ok = _row_scale(rng_ptr + row.to(tl.int64) * S * 2, S, SP)
    if ok:
        b1, need1, lo2, scale2, b2, listed, at, _, neg = _plan(h1_row, h2_row, S, split, k, cap, lo, hi, scale, True)
        if b1 == 0:  # every finite score is selected, then the lowest need1 columns of -inf in column order
            threshold = ~(_unsigned_key(tl.full([], -float("inf"), tl.float32)) ^ 0x7FFFFFFF)
            out = row.to(tl.int64) * k
            written = at - neg + tl.minimum(neg, need1)  # ``at``: every column of the chunks before (b1 = 0)
            _compact(base, base, idx_ptr + out, val_ptr + out, start, end, threshold, need1, neg, written,
                     BLOCK, False)  # fmt: skip
        elif listed <= cap:
            _gather(base, start, end, lo, scale, b1, lo2, scale2, b2, cols_ptr + row.to(tl.int64) * cap, at, BLOCK)


@triton.jit(do_not_specialize=["n", "k", "stride", "S", "cap"])
def _bucket_select_kernel(s_ptr, rng_ptr, h1_ptr, h2_ptr, cols_ptr, idx_ptr, val_ptr, n, k, stride, S, cap,
                          BLOCK: tl.constexpr, SP: tl.constexpr, MASKED: tl.constexpr):  # fmt: skip
    """One program a row: the passes and the compaction over its list, or over the whole row where the
    buckets did not narrow it (nothing left to do where the threshold is ``-inf``)."""
    row = tl.program_id(0)
    base = s_ptr + row.to(tl.int64) * stride
    cols = cols_ptr + row.to(tl.int64) * cap
    out = row.to(tl.int64) * k
    h1_row = h1_ptr + row.to(tl.int64) * S * 256
    h2_row = h2_ptr + row.to(tl.int64) * S * 256
    lo, hi, scale, ok = _row_scale(rng_ptr + row.to(tl.int64) * S * 2, S, SP)
    mode = 0  # 0: the passes over the row; 1: done (the threshold is -inf); 2: the columns listed at ``cols``
    listed = 0
    if ok:
        b1, _, _, _, _, listed, _, _, _ = _plan(h1_row, h2_row, S, 0, k, cap, lo, hi, scale, True)
        if b1 == 0:
            mode = 1
        elif listed <= cap:
            mode = 2
    zero = tl.zeros([], dtype=tl.int32)
    if mode == 2:  # every key at or above the threshold is listed, in column order
        prefix, need = _passes(base, cols, listed, k, BLOCK, 8, MASKED, True)
        threshold = ~(prefix ^ 0x7FFFFFFF)
        _compact(base, cols, idx_ptr + out, val_ptr + out, 0, listed, threshold, need, zero, zero, BLOCK, True)
    elif mode == 0:
        prefix, need = _passes(base, cols, n, k, BLOCK, 8, MASKED, False)
        threshold = ~(prefix ^ 0x7FFFFFFF)
        _compact(base, cols, idx_ptr + out, val_ptr + out, 0, n, threshold, need, zero, zero, BLOCK, False)


def split_buckets(scores: torch.Tensor, k: int, idx: torch.Tensor, val: torch.Tensor, chunk: int, block: int,
                  warps: int, masked: bool) -> None:  # fmt: skip
    """The bucket split form into ``idx``/``val`` (``topk_triton`` checked the arguments)."""
    rows, n = scores.shape
    s = triton.cdiv(n, chunk)
    sp = max(2, triton.next_power_of_2(s))
    cap = 2 * k  # the list's length, as the one-program kernel's
    dev = scores.device
    rng = torch.empty(rows, s, 2, dtype=torch.float32, device=dev)
    h1 = torch.empty(rows, s, 256, dtype=torch.int32, device=dev)
    h2 = torch.empty(rows, s, 256, dtype=torch.int32, device=dev)  # written only for crowded rows, read only there
    cols = torch.empty(rows, max(cap, 1), dtype=torch.int32, device=dev)
    stride, grid = scores.stride(0), (rows, s)
    _bucket_range_kernel[grid](scores, rng, n, stride, s, CHUNK=chunk, BLOCK=block, num_warps=warps)
    for sub in (False, True):
        _bucket_count_kernel[grid](
            scores, rng, h1, h2, n, k, stride, s, cap, SUB=sub, CHUNK=chunk, BLOCK=block, SP=sp, num_warps=warps
        )
    _bucket_list_kernel[grid](
        scores, rng, h1, h2, cols, idx, val, n, k, stride, s, cap, CHUNK=chunk, BLOCK=block, SP=sp, num_warps=warps
    )
    _bucket_select_kernel[(rows,)](
        scores, rng, h1, h2, cols, idx, val, n, k, stride, s, cap, BLOCK=block, SP=sp, MASKED=masked, num_warps=warps
    )
