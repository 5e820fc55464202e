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

from kvwarden.layers.sparse_attention import column_order

# The kernel's shape, measured on the H200 (bench/topk.py --variants, device time; any shape gives the same
# answer): 8-bit digits beat 11-bit ones 1.6-3.7x (a histogram's cost grows with its bins); one program per
# row is best with blocks of 4,096 and 8 warps (0.025 ms at 4K keys against 0.054 with 8,192 and 16), the
# histogram's mask argument and the bin-0 form time within 3 % of each other; up to 16 rows of 16K-64K keys
# a row split over programs of 4,096 columns takes 0.045-0.062 ms where one program takes 0.08-0.28 (at
# 256 rows the split is 10-45 % slower: the rows already fill the GPU). The split costs 5 launches: at 16K
# keys and one row its 0.03 ms of device time saved were less than the extra launches' host time (0.16 ms
# against one program's 0.11, launch included), so it starts at 32K.
BLOCK, WARPS = 4096, 8
RADIX = 8  # bits per radix pass: 8 (four passes of 256 bins) or 11 (three of 2,048)
MASKED = False  # the histogram's mask argument (Triton >= 3.3) rather than bin 0
# Up to FEW_ROWS rows of at least SPLIT_FROM keys: one program per SPLIT_CHUNK columns (5 launches, not 1).
SPLIT_CHUNK, SPLIT_BLOCK, SPLIT_WARPS = 4096, 4096, 8
SPLIT_FROM, FEW_ROWS = 32768, 64


@triton.jit
def _keys(base, offs, end):
    """Signed 32-bit keys in the scores' float order and the in-range mask (columns before ``end``)."""
    valid = offs < end
    s = tl.load(base + offs, mask=valid, other=0.0).to(tl.float32)
    s = tl.where(s == 0.0, 0.0, s)  # -0.0 == 0.0 in the order: one key for both
    bits = s.to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF), valid  # negative floats: reverse the magnitude bits


@triton.jit
def _count(base, lo, hi, prefix, SHIFT: tl.constexpr, WIDTH: tl.constexpr, BLOCK: tl.constexpr, MASKED: tl.constexpr):
    """Histogram of the ``WIDTH`` bits at ``SHIFT`` of the keys in columns ``[lo, hi)`` whose bits above
    them equal ``prefix`` (an exact integer count)."""
    NB: tl.constexpr = 1 << WIDTH
    hist = tl.zeros([NB], dtype=tl.int32)
    missed = 0
    for j0 in range(lo, hi, BLOCK):
        offs = j0 + tl.arange(0, BLOCK)
        key, valid = _keys(base, offs, hi)
        ukey = ~(key ^ 0x7FFFFFFF)  # the sign bit flipped: unsigned order in the same 32 bits
        if SHIFT + WIDTH < 32:
            match = valid & (((ukey >> (SHIFT + WIDTH)) & ((1 << (32 - SHIFT - WIDTH)) - 1)) == prefix)
        else:
            match = valid
        digit = (ukey >> SHIFT) & (NB - 1)
        if MASKED:  # non-matching keys are left out of the count
            hist += tl.histogram(digit, NB, mask=match)
        else:  # no mask argument: non-matching keys go to bin 0 and are taken back out (they contend there)
            hist += tl.histogram(tl.where(match, digit, 0), NB)
            missed += tl.sum((~match).to(tl.int32), axis=0)
    bins = tl.arange(0, NB)
    return hist - tl.where(bins == 0, missed, 0)


@triton.jit
def _choose(hist, prefix, need, WIDTH: tl.constexpr):
    """The bin of ``hist`` holding the ``need``-th largest key: the longer prefix, what is still needed
    inside that bin, and the bin."""
    bins = tl.arange(0, 1 << WIDTH)
    above = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0)  # keys in higher bins than each bin
    hit = (above < need) & (above + hist >= need)  # exactly one bin (it holds the need-th key)
    b = tl.max(tl.where(hit, bins, -1), axis=0)
    need -= tl.sum(tl.where(bins == b, above, 0), axis=0)
    return (prefix << WIDTH) | b, need, b


@triton.jit
def _refine(base, n, prefix, need, SHIFT: tl.constexpr, WIDTH: tl.constexpr, BLOCK: tl.constexpr, MASKED: tl.constexpr):
    """One radix pass over a whole row."""
    hist = _count(base, 0, n, prefix, SHIFT, WIDTH, BLOCK, MASKED)
    prefix, need, _ = _choose(hist, prefix, need, WIDTH)
    return prefix, need


@triton.jit
def _compact(base, out_idx, out_val, lo, hi, threshold, need, equal_before, written, BLOCK: tl.constexpr):
    """Write the selected keys of columns ``[lo, hi)`` in column order, from slot ``written`` on
    (``equal_before``: keys equal to the threshold in the row before ``lo``)."""
    for j0 in range(lo, hi, BLOCK):
        offs = j0 + tl.arange(0, BLOCK)
        key, valid = _keys(base, offs, hi)
        eq = valid & (key == threshold)
        eq_rank = equal_before + tl.cumsum(eq.to(tl.int32), axis=0) - 1
        sel = (valid & (key > threshold)) | (eq & (eq_rank < need))
        at = written + tl.cumsum(sel.to(tl.int32), axis=0) - 1
        bits = key ^ ((key >> 31) & 0x7FFFFFFF)  # the float's bits again (-0.0 came back as +0.0)
        tl.store(out_idx + at, offs.to(tl.int64), mask=sel)
        tl.store(out_val + at, bits.to(tl.float32, bitcast=True), mask=sel)
        equal_before += tl.sum(eq.to(tl.int32), axis=0)
        written += tl.sum(sel.to(tl.int32), axis=0)


@triton.jit(do_not_specialize=["n", "k", "stride"])
def _radix_select_kernel(s_ptr, idx_ptr, val_ptr, n, k, stride, BLOCK: tl.constexpr, RADIX: tl.constexpr,
                         MASKED: tl.constexpr):  # fmt: skip
    """One program per row: the passes, then the compaction."""
    row = tl.program_id(0)
    base = s_ptr + row.to(tl.int64) * stride
    prefix = tl.zeros([], dtype=tl.int32)
    need = k
    if RADIX == 8:
        prefix, need = _refine(base, n, prefix, need, 24, 8, BLOCK, MASKED)
        prefix, need = _refine(base, n, prefix, need, 16, 8, BLOCK, MASKED)
        prefix, need = _refine(base, n, prefix, need, 8, 8, BLOCK, MASKED)
        prefix, need = _refine(base, n, prefix, need, 0, 8, BLOCK, MASKED)
    else:
        prefix, need = _refine(base, n, prefix, need, 21, 11, BLOCK, MASKED)
        prefix, need = _refine(base, n, prefix, need, 10, 11, BLOCK, MASKED)
        prefix, need = _refine(base, n, prefix, need, 0, 10, BLOCK, MASKED)
    threshold = ~(prefix ^ 0x7FFFFFFF)  # back to the signed key
    out = row.to(tl.int64) * k
    zero = tl.zeros([], dtype=tl.int32)
    _compact(base, idx_ptr + out, val_ptr + out, 0, n, threshold, need, zero, zero, BLOCK)


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
    hist = _count(base, lo, tl.minimum(lo + CHUNK, n), prefix, 24 - 8 * PASS, 8, BLOCK, MASKED)
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
    _compact(base, idx_ptr + out, val_ptr + out, lo, tl.minimum(lo + CHUNK, n), threshold, need, equal_before,
             written, BLOCK)  # fmt: skip


def topk_triton(
    scores: torch.Tensor,
    k: int,
    *,
    radix: int = RADIX,
    block: int | None = None,
    num_warps: int | None = None,
    masked: bool = MASKED,
    split: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of ``scores [rows, n]``: the ``k`` best (values as float32, column indices as int64), in
    column order.

    ``radix``, ``block``, ``num_warps``, ``masked`` (the histogram's mask argument, or non-matching keys
    counted into bin 0 and taken back out), ``split`` (columns per program when several share a row; 0:
    one program per row; None: by the shape, see ``SPLIT_FROM``): the kernel's shape - any gives the same
    answer (``bench/topk.py --variants`` times them). Split launches use 8-bit digits."""
    rows, n = _check(scores, k)
    if radix not in (8, 11):
        raise ValueError(f"top-k: radix must be 8 or 11 bits, got {radix}")
    if split is None:
        split = SPLIT_CHUNK if rows <= FEW_ROWS and n >= SPLIT_FROM else 0
    if split < 0:
        raise ValueError(f"top-k: split must be >= 0 columns, got {split}")
    scores = scores.contiguous()
    idx = torch.empty(rows, k, dtype=torch.int64, device=scores.device)
    val = torch.empty(rows, k, dtype=torch.float32, device=scores.device)
    if not rows or not k:
        return val, idx
    if split:
        block = min(block or SPLIT_BLOCK, split)
        if split % block:
            raise ValueError(f"top-k: split ({split}) must be a multiple of block ({block})")
        s = triton.cdiv(n, split)
        hist = torch.empty(rows, 4, s, 256, dtype=torch.int32, device=scores.device)
        warps = num_warps or SPLIT_WARPS
        for p in range(4):
            _split_count_kernel[(rows, s)](
                scores, hist, n, k, scores.stride(0), s, PASS=p, CHUNK=split, BLOCK=block, MASKED=masked,
                num_warps=warps,
            )  # fmt: skip
        _split_compact_kernel[(rows, s)](
            scores, hist, idx, val, n, k, scores.stride(0), s, CHUNK=split, BLOCK=block, num_warps=warps
        )
        return val, idx
    block = block or BLOCK
    num_warps = num_warps or WARPS
    _radix_select_kernel[(rows,)](
        scores, idx, val, n, k, scores.stride(0), BLOCK=block, RADIX=radix, MASKED=masked, num_warps=num_warps
    )
    return val, idx


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
