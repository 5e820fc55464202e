"""The radix select's pieces (Triton device functions), shared by ``topk.py``'s kernels.

The invariance argument is ``topk.py``'s opening comment: every count here is an exact integer
histogram or running sum of one row's keys, and every choice is a function of those counts.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _keys(base, cols, offs, end, INDIRECT: tl.constexpr):
    """Signed 32-bit keys in the scores' float order, the in-range mask (entries before ``end``) and the
    keys' columns: ``offs`` itself, or with ``INDIRECT`` the columns listed at ``cols[offs]``."""
    valid = offs < end
    if INDIRECT:
        offs = tl.load(cols + offs, mask=valid, other=0)
    s = tl.load(base + offs, mask=valid, other=0.0).to(tl.float32)
    s = tl.where(s == 0.0, 0.0, s)  # -0.0 == 0.0 in the order: one key for both
    bits = s.to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF), valid, offs  # negative floats: reverse the magnitude bits


@triton.jit
def _unsigned_key(s):
    """The unsigned form of a score's key (what the passes build their prefix in)."""
    bits = s.to(tl.int32, bitcast=True)
    return ~((bits ^ ((bits >> 31) & 0x7FFFFFFF)) ^ 0x7FFFFFFF)


@triton.jit
def _count(base, cols, lo, hi, prefix, SHIFT: tl.constexpr, WIDTH: tl.constexpr, BLOCK: tl.constexpr,
           MASKED: tl.constexpr, INDIRECT: tl.constexpr):  # fmt: skip
    """Histogram of the ``WIDTH`` bits at ``SHIFT`` of the keys in columns ``[lo, hi)`` (with ``INDIRECT``:
    entries ``[lo, hi)`` of ``cols``) whose bits above them equal ``prefix`` (an exact integer count)."""
    NB: tl.constexpr = 1 << WIDTH
    hist = tl.zeros([NB], dtype=tl.int32)
    missed = 0
    for j0 in range(lo, hi, BLOCK):
        offs = j0 + tl.arange(0, BLOCK)
        key, valid, _ = _keys(base, cols, offs, hi, INDIRECT)
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
def _refine(base, cols, n, prefix, need, SHIFT: tl.constexpr, WIDTH: tl.constexpr, BLOCK: tl.constexpr,
            MASKED: tl.constexpr, INDIRECT: tl.constexpr):  # fmt: skip
    """One radix pass over a whole row (or the ``n`` columns listed at ``cols``)."""
    hist = _count(base, cols, 0, n, prefix, SHIFT, WIDTH, BLOCK, MASKED, INDIRECT)
    prefix, need, _ = _choose(hist, prefix, need, WIDTH)
    return prefix, need


@triton.jit
def _compact(base, cols, out_idx, out_val, lo, hi, threshold, need, equal_before, written, BLOCK: tl.constexpr,
             INDIRECT: tl.constexpr):  # fmt: skip
    """Write the selected keys of columns ``[lo, hi)`` (with ``INDIRECT``: of the columns listed at
    ``cols[lo:hi]``, in column order) in column order, from slot ``written`` on (``equal_before``: keys
    equal to the threshold in the row before them)."""
    for j0 in range(lo, hi, BLOCK):
        offs = j0 + tl.arange(0, BLOCK)
        key, valid, col = _keys(base, cols, offs, hi, INDIRECT)
        eq = valid & (key == threshold)
        eq_rank = equal_before + tl.cumsum(eq.to(tl.int32), axis=0) - 1
        sel = (valid & (key > threshold)) | (eq & (eq_rank < need))
        at = written + tl.cumsum(sel.to(tl.int32), axis=0) - 1
        bits = key ^ ((key >> 31) & 0x7FFFFFFF)  # the float's bits again (-0.0 came back as +0.0)
        tl.store(out_idx + at, col.to(tl.int64), mask=sel)
        tl.store(out_val + at, bits.to(tl.float32, bitcast=True), mask=sel)
        equal_before += tl.sum(eq.to(tl.int32), axis=0)
        written += tl.sum(sel.to(tl.int32), axis=0)


@triton.jit
def _passes(base, cols, n, need, BLOCK: tl.constexpr, RADIX: tl.constexpr, MASKED: tl.constexpr,
            INDIRECT: tl.constexpr):  # fmt: skip
    """All radix passes over columns ``[0, n)`` (or the ``n`` listed at ``cols``): the ``need``-th largest
    key (unsigned form) and how many keys equal to it are taken."""
    prefix = tl.zeros([], dtype=tl.int32)
    if RADIX == 8:
        prefix, need = _refine(base, cols, n, prefix, need, 24, 8, BLOCK, MASKED, INDIRECT)
        prefix, need = _refine(base, cols, n, prefix, need, 16, 8, BLOCK, MASKED, INDIRECT)
        prefix, need = _refine(base, cols, n, prefix, need, 8, 8, BLOCK, MASKED, INDIRECT)
        prefix, need = _refine(base, cols, n, prefix, need, 0, 8, BLOCK, MASKED, INDIRECT)
    else:
        prefix, need = _refine(base, cols, n, prefix, need, 21, 11, BLOCK, MASKED, INDIRECT)
        prefix, need = _refine(base, cols, n, prefix, need, 10, 11, BLOCK, MASKED, INDIRECT)
        prefix, need = _refine(base, cols, n, prefix, need, 0, 10, BLOCK, MASKED, INDIRECT)
    return prefix, need


@triton.jit
def _range(base, n, BLOCK: tl.constexpr):
    """The row's smallest finite score and its largest score."""
    lo = tl.full([], float("inf"), tl.float32)
    hi = tl.full([], -float("inf"), tl.float32)
    for j0 in range(0, n, BLOCK):
        offs = j0 + tl.arange(0, BLOCK)
        valid = offs < n
        s = tl.load(base + offs, mask=valid, other=-float("inf")).to(tl.float32)
        hi = tl.maximum(hi, tl.max(s, axis=0))
        lo = tl.minimum(lo, tl.min(tl.where(s > -float("inf"), s, float("inf")), axis=0))
    return lo, hi


@triton.jit
def _bucket(s, lo, scale):
    """The bucket (0-255) of scores ``s`` for the range starting at ``lo``: non-decreasing in the score
    whatever ``lo`` and ``scale >= 0`` are (clamped at both ends; see ``topk.py``)."""
    b = tl.where(s > lo, (s - lo) * scale, 0.0)  # lo and below (and -0.0 against 0.0): bottom of bucket 1
    return tl.where(s > -float("inf"), 1 + tl.minimum(b.to(tl.int32), 254), 0)  # truncation: floor of b >= 0


@triton.jit
def _bucket_count(base, n, lo, scale, outer, lo2, scale2, SUB: tl.constexpr, BLOCK: tl.constexpr):
    """Histogram of the buckets of a row's scores or, with ``SUB``, of the sub-buckets (``lo2``,
    ``scale2``) of the scores in bucket ``outer`` (the others are counted into bin 0 and taken out)."""
    hist = tl.zeros([256], dtype=tl.int32)
    missed = 0
    for j0 in range(0, n, BLOCK):
        offs = j0 + tl.arange(0, BLOCK)
        valid = offs < n
        s = tl.load(base + offs, mask=valid, other=0.0).to(tl.float32)
        if SUB:
            match = valid & (_bucket(s, lo, scale) == outer)
            hist += tl.histogram(tl.where(match, _bucket(s, lo2, scale2), 0), 256)
            missed += tl.sum((~match).to(tl.int32), axis=0)
        else:
            hist += tl.histogram(tl.where(valid, _bucket(s, lo, scale), 0), 256)
            missed += tl.sum((~valid).to(tl.int32), axis=0)
    return hist - tl.where(tl.arange(0, 256) == 0, missed, 0)


@triton.jit
def _gather(base, start, end, lo, scale, b1, lo2, scale2, b2, out, written, BLOCK: tl.constexpr):
    """List at ``out``, in column order from entry ``written`` on, the columns in ``[start, end)`` whose
    (bucket, sub-bucket) is at least ``(b1, b2)``; returns ``written`` plus their count (the caller checked
    they fit)."""
    for j0 in range(start, end, BLOCK):
        offs = j0 + tl.arange(0, BLOCK)
        valid = offs < end
        s = tl.load(base + offs, mask=valid, other=0.0).to(tl.float32)
        outer = _bucket(s, lo, scale)
        hit = valid & ((outer > b1) | ((outer == b1) & (_bucket(s, lo2, scale2) >= b2)))
        tl.store(out + written + tl.cumsum(hit.to(tl.int32), axis=0) - 1, offs, mask=hit)
        written += tl.sum(hit.to(tl.int32), axis=0)
    return written
