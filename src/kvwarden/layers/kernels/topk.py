"""Deterministic top-k over rows of scores (the sparse-attention indexer's key selection).

NOTE(invariance), by construction: the selected set *and* its order are a function
of one row's scores alone. The set: one total order ranks a row's (score, column)
pairs - score descending, then column ascending (ties go to the lower column) -
and the first ``k`` are selected. The order they are returned in: column order
(ascending key position), which is a function of the set. Nothing depends on the
number of rows in the launch, on how a row's work is split, on which program ran
first, or on thread timing:

1. Radix select of the threshold. Each score becomes a 32-bit key whose integer
   order is the float order (``-0.0`` first made ``+0.0``, as the comparison
   treats them). Four passes count, in integer histograms, how many keys share
   each value of the next 8 bits (or three passes of 11, 11 and 10) among the
   keys that match the prefix found so far; the bin where the count from the
   top reaches ``k`` extends the prefix. After the passes the prefix *is* the
   ``k``-th largest key ``T``, and ``need`` says how many keys equal to ``T``
   the selection takes. Counting is exact integer arithmetic: its result does
   not depend on the order the counts are added in, on the block size, or on
   how many programs share a row (each writes its own histogram; every reader
   sums them in split order).
2. Compaction in column order: a key above ``T`` is selected; a key equal to
   ``T`` is selected when fewer than ``need`` equal keys come before it in the
   row. Its output slot is the number of selected keys before it in the row:
   running counts over the blocks one program walks in column order, plus, when
   several programs share a row, the exact counts of the splits before its own
   (read off the passes' per-split histograms). Exactly ``k`` keys are selected.

Why column order and not rank order: the set is what decides the answer, and a
sorted order costs a bitonic sort of ``k`` pairs per row (about 60 us of a
4,096-key row's 90 us on the H200); the attention over the selection then folds
its keys in position order, as dense attention does.

A shortcut to the threshold, the same answer (one program per row): a sweep finds
the row's finite minimum ``lo`` and its maximum ``hi``; a second counts the
scores in 255 equal-width buckets of ``[lo, hi]`` - bucket
``1 + min(floor((s - lo) * 255 / (hi - lo)), 254)``, ``-inf`` alone in bucket 0.
The bucket is a non-decreasing function of the score for *any* ``lo`` and
``scale >= 0`` (each IEEE operation in it rounds monotonically, and it is clamped
at both ends), so a score in a higher bucket is strictly larger than every score
in a lower one, and the ``k``-th largest key lies in the bucket ``b`` where the
count from the top reaches ``k``. ``b = 0`` means fewer than ``k`` finite
scores: the threshold is ``-inf``. When ``b`` and the buckets above it hold at
most ``2k`` columns, a third sweep lists them, in column order, and the radix
passes and the compaction run over that list only: every key at or above the
threshold is in it, so its ``k``-th largest key, its count of equal keys before
each column and its selection are the row's. A crowded ``b`` (one score far
above the rest: an attention sink) is cut again into 255 sub-buckets of its
nominal range by one more sweep over the scores in ``b`` (the clamped bucket
function again, so monotone whatever rounding did to that range); the list then
holds the columns at or above ``(b, sub-bucket)``. A row that still does not fit
(heavy ties) or whose range rules buckets out (an infinite score, a range past
float32) takes the passes over the whole row. ``lo``, ``hi``, the range and
every count are the row's own, so the path taken, like the answer, is a function
of the row alone.

Two launch shapes, the same answer: one program per row (many rows), or, for a
few long rows, ``split`` programs per row, one per chunk of columns - four
histogram launches and one compaction, each program re-deriving the prefix from
the per-split histograms of the passes before (no atomics, no grid-wide sync).

No output slot is ever handed out by arrival: the fault of a kernel that hands
out slots by an atomic counter is exactly that its order, and under ties its
set, follows thread timing.

``-inf`` marks a column that may not be chosen (beyond the query's causal
range): its key ranks after every finite one, so a row with fewer than ``k``
finite scores is filled with the lowest such columns (with a causal mask those
lie past every visible one, so they come last in column order). NaN is not a
score (it has no place in the order): callers must not produce it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvwarden.layers.kernels.topk_radix import (
    _bucket_count,
    _choose,
    _compact,
    _gather,
    _passes,
    _range,
    _unsigned_key,
)
from kvwarden.layers.kernels.topk_split import split_buckets, split_radix
from kvwarden.layers.sparse_attention import column_order

# The kernel's shape: a speed choice only (any shape gives the same answer). Chosen by measurement with
# `kvwarden bench topk --device cuda --variants --graphs` (its table is in docs/sparse-attention.md, the history in
# CHANGELOG.md): 8-bit digits, one program per row in blocks of 2,048 on 8 warps; a row split over programs of
# chunks of 2,048 (up to 16K keys) or 4,096 columns for few rows, while the split makes at most SPLIT_PROGRAMS
# programs (it costs 5 launches: decode replays it from CUDA graphs, where only device time counts); and up to
# BUCKET_SPLIT_ROWS rows of BUCKET_SPLIT_FROM keys or more the bucket shortcut split over chunks of 16,384.
BLOCK, WARPS = 2048, 8
# One program per row over rows of more than LONG_ROW keys: 4 warps (scheduling only: the counts are exact
# integers, so the answer is the same on any warps; `kvwarden bench topk --variants --graphs` measures both on the GPU).
LONG_ROW, LONG_ROW_WARPS = 32768, 4
RADIX = 8  # bits per radix pass: 8 (four passes of 256 bins) or 11 (three of 2,048)
MASKED = False  # the histogram's mask argument (Triton >= 3.3) rather than bin 0
SPLIT_FROM, SPLIT_PROGRAMS = 8192, 512  # rows of at least SPLIT_FROM keys, rows x chunks <= SPLIT_PROGRAMS
SPLIT_SHAPES = ((16384, 2048, 4), (None, 4096, 8))  # (up to this many keys, chunk = block, warps)
SPLIT_BLOCK = 4096  # the split form's largest block (a chunk is walked in blocks of min(chunk, this))
BUCKETS = True  # one program per row: the bucket shortcut to the threshold (see the docstring)
SPLIT_BUCKETS = False  # an explicit ``split`` with ``buckets=None``: the radix passes over a row's chunks
# the bucket split: rows of BUCKET_SPLIT_FROM to BUCKET_SPLIT_TO keys (the range measured: each program sums
# every chunk's histograms of its row, a cost growing with the square of the chunks), this few rows
BUCKET_SPLIT_FROM, BUCKET_SPLIT_TO, BUCKET_SPLIT_ROWS = 65536, 131072, 128
BUCKET_SPLIT_SHAPE = (16384, 8)  # its (chunk, warps); a chunk is walked in blocks of SPLIT_BLOCK


@triton.jit(do_not_specialize=["n", "k", "stride", "cap"])
def _radix_select_kernel(s_ptr, idx_ptr, val_ptr, cols_ptr, n, k, stride, cap, BLOCK: tl.constexpr,
                         RADIX: tl.constexpr, MASKED: tl.constexpr, BUCKETS: tl.constexpr):  # fmt: skip
    """One program per row: the threshold (through the buckets where they narrow the row to ``cap``
    columns or fewer, else the passes over the row), then the compaction."""
    row = tl.program_id(0)
    base = s_ptr + row.to(tl.int64) * stride
    out = row.to(tl.int64) * k
    cols = cols_ptr + row.to(tl.int64) * cap
    prefix = tl.zeros([], dtype=tl.int32)
    need = k
    mode = 0  # 0: the passes over the row; 1: the threshold is -inf; 2: the columns listed at ``cols``
    listed = 0
    if BUCKETS:
        lo, hi = _range(base, n, BLOCK)
        width = hi - lo  # +inf with an infinite score or an overflow; -inf when every score is -inf
        scale = tl.where(width > 0.0, 255.0 / tl.where(width > 0.0, width, 1.0), 0.0)
        if (width < 3.0e38) & (scale < 3.0e38):
            hist = _bucket_count(base, n, lo, scale, 0, lo, scale, False, BLOCK)
            _, need1, b1 = _choose(hist, prefix, need, 8)
            m = tl.sum(tl.where(tl.arange(0, 256) == b1, hist, 0), axis=0)
            above = k - need1  # keys in the buckets above b1
            b2 = 1  # every score's sub-bucket is >= 1: (b1, 1) is all of bucket b1
            lo2 = lo
            scale2 = scale
            if b1 == 0:  # fewer than k finite scores: the threshold is -inf, its lowest columns fill the rest
                prefix = _unsigned_key(tl.full([], -float("inf"), tl.float32))
                need = need1
                mode = 1
            else:
                if above + m > cap:  # bucket b1 is crowded: its 255 sub-buckets, one sweep more
                    lo2 = lo + (b1 - 1).to(tl.float32) / scale
                    hi2 = tl.where(b1 == 255, hi, lo + b1.to(tl.float32) / scale)
                    width2 = hi2 - lo2
                    scale2 = tl.where(width2 > 0.0, 255.0 / tl.where(width2 > 0.0, width2, 1.0), 0.0)
                    if scale2 < 3.0e38:
                        hist = _bucket_count(base, n, lo, scale, b1, lo2, scale2, True, BLOCK)
                        _, need2, b2 = _choose(hist, prefix, need1, 8)
                        m = tl.sum(tl.where(tl.arange(0, 256) == b2, hist, 0), axis=0)
                        above = k - need2
                if above + m <= cap:
                    listed = _gather(
                        base, 0, n, lo, scale, b1, lo2, scale2, b2, cols, tl.zeros([], dtype=tl.int32), BLOCK
                    )
                    tl.debug_barrier()  # the list, stored by some threads, is read by others
                    prefix, need = _passes(base, cols, listed, k, BLOCK, RADIX, MASKED, True)
                    mode = 2
    if mode == 0:
        prefix, need = _passes(base, cols, n, k, BLOCK, RADIX, MASKED, False)
    threshold = ~(prefix ^ 0x7FFFFFFF)  # back to the signed key
    zero = tl.zeros([], dtype=tl.int32)
    if mode == 2:  # every key at or above the threshold is listed, in column order
        _compact(base, cols, idx_ptr + out, val_ptr + out, 0, listed, threshold, need, zero, zero, BLOCK, True)
    else:
        _compact(base, cols, idx_ptr + out, val_ptr + out, 0, n, threshold, need, zero, zero, BLOCK, False)


def topk_triton(
    scores: torch.Tensor,
    k: int,
    *,
    radix: int = RADIX,
    block: int | None = None,
    num_warps: int | None = None,
    masked: bool = MASKED,
    split: int | None = None,
    buckets: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of ``scores [rows, n]``: the ``k`` best (values as float32, column indices as int64), in
    column order.

    ``radix``, ``block``, ``num_warps``, ``masked`` (the histogram's mask argument, or non-matching keys
    counted into bin 0 and taken back out), ``split`` (columns per program when several share a row; 0:
    one program per row; None: by the shape, ``split_plan``), ``buckets`` (the bucket shortcut to the
    threshold, in one program per row or split over a row's chunks; None: ``split_plan``'s choice, or with
    an explicit ``split`` ``SPLIT_BUCKETS``): the kernel's shape - any gives the same answer
    (``kvwarden bench topk --variants`` times them). Split launches use 8-bit digits: ``radix=11`` runs one
    program per row, and with a ``split`` is refused."""
    rows, n = _check(scores, k)
    if radix not in (8, 11):
        raise ValueError(f"top-k: radix must be 8 or 11 bits, got {radix}")
    if split is None:  # the split forms run 8-bit digits only: 11-bit ones keep one program per row
        split, buckets = split_plan(rows, n, buckets) if radix == 8 else (0, buckets)
    if split < 0:
        raise ValueError(f"top-k: split must be >= 0 columns, got {split}")
    if split and radix != 8:
        raise ValueError(f"top-k: radix {radix} runs in one program per row (split=0); a split uses 8-bit digits")
    scores = scores.contiguous()
    idx = torch.empty(rows, k, dtype=torch.int64, device=scores.device)
    val = torch.empty(rows, k, dtype=torch.float32, device=scores.device)
    if not rows or not k:
        return val, idx
    if split:
        block = min(block or SPLIT_BLOCK, split)
        if split % block:
            raise ValueError(f"top-k: split ({split}) must be a multiple of block ({block})")
        use_buckets = SPLIT_BUCKETS if buckets is None else buckets
        warps = num_warps or (BUCKET_SPLIT_SHAPE[1] if use_buckets else _split_shape(n)[1])
        (split_buckets if use_buckets else split_radix)(scores, k, idx, val, split, block, warps, masked)
        return val, idx
    block = block or BLOCK
    num_warps = num_warps or (LONG_ROW_WARPS if n > LONG_ROW else WARPS)
    # the bucket shortcut lists at most 2k columns a row; a row that short is cheaper through the passes
    cap = 2 * k if (BUCKETS if buckets is None else buckets) and n > 2 * k else 0
    cols = torch.empty(rows if cap else 1, max(cap, 1), dtype=torch.int32, device=scores.device)
    _radix_select_kernel[(rows,)](
        scores, idx, val, cols, n, k, scores.stride(0), cap, BLOCK=block, RADIX=radix, MASKED=masked,
        BUCKETS=cap > 0, num_warps=num_warps,
    )  # fmt: skip
    return val, idx


def split_plan(rows: int, n: int, buckets: bool | None = None) -> tuple[int, bool]:
    """``(columns per program, bucket shortcut)`` for ``rows`` rows of ``n`` keys; 0 columns: one program
    per row. ``buckets`` (the caller's choice of the shortcut, None: free) limits the forms to those with
    it (True: the bucket split or one program with the shortcut) or without (False: the radix split or
    one program through the passes). A speed choice only: every form gives the same answer (see
    ``SPLIT_SHAPES`` and ``BUCKET_SPLIT_FROM``)."""
    chunk = _split_shape(n)[0]
    if buckets is not True and n >= SPLIT_FROM and rows * triton.cdiv(n, chunk) <= SPLIT_PROGRAMS:
        return chunk, False
    long_rows = BUCKET_SPLIT_FROM <= n <= BUCKET_SPLIT_TO and rows <= BUCKET_SPLIT_ROWS
    if buckets is not False and long_rows:
        return BUCKET_SPLIT_SHAPE[0], True
    return 0, BUCKETS if buckets is None else buckets


def _split_shape(n: int) -> tuple[int, int]:
    """``(chunk, warps)`` of the split form for rows of ``n`` keys (``SPLIT_SHAPES``)."""
    return next((chunk, warps) for top, chunk, warps in SPLIT_SHAPES if top is None or n <= top)


def topk_reference(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same selection and order through a stable sort (the CPU path's answer, and the tests').

    A stable descending sort keeps equal scores in column order, which is this file's total order, so
    its first ``k`` are the set; they are then put in column order. ``torch.topk`` promises neither the
    order of ties nor which of several equal scores it returns.
    """
    _check(scores, k)
    ranked = torch.sort(scores.float(), dim=-1, descending=True, stable=True)
    return column_order(ranked.values[:, :k], ranked.indices[:, :k])


def _check(scores: torch.Tensor, k: int) -> tuple[int, int]:
    if scores.dim() != 2:
        raise ValueError(f"top-k: scores must be [rows, n], got shape {tuple(scores.shape)}")
    rows, n = scores.shape
    if not 0 <= k <= n:
        raise ValueError(f"top-k: k must be in [0, {n}] for rows of {n} scores, got {k}")
    return rows, n
