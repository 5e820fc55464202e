"""Deterministic top-k over rows of scores (the sparse-attention indexer's key selection).

NOTE(invariance), by construction: the selected set *and* its order are a function
of one row's scores alone. One total order ranks a row's (score, column) pairs:
score descending, then column ascending (ties go to the lower column). One
program owns one row and does everything for it, so nothing depends on the
number of rows in the launch, on which program ran first, or on thread timing:

1. Radix select of the threshold. Each score becomes a 32-bit key whose integer
   order is the float order (``-0.0`` first made ``+0.0``, as the comparison
   treats them). Four passes over the row count, in integer histograms, how
   many keys share each value of the next 8 bits (or three passes of 11, 11
   and 10) among the keys that match the prefix found so far; the bin where
   the count from the top reaches ``k`` extends the prefix. After the passes the prefix *is* the
   ``k``-th largest key ``T``, and ``need`` says how many keys equal to ``T``
   the selection takes. Counting is exact integer arithmetic: its result does
   not depend on the order the counts are added in or on the block size.
2. Compaction in column order: a key above ``T`` is selected; a key equal to
   ``T`` is selected when fewer than ``need`` equal keys come before it in the
   row (a running count over the blocks, which the program walks in column
   order). Exactly ``k`` keys are selected.
3. Order: the ``k`` selected pairs, packed as ``key << 32 | ~column`` (one
   signed 64-bit integer whose order is the total order, every pair distinct),
   are sorted in the program's registers (``order="sort"``), or each is written
   to the slot its exact count of larger packed keys names (``order="rank"``).
   A set of distinct keys has one sorted order, whatever order the compaction
   wrote them in, and either way reaches it.

No atomics and no output slot handed out by arrival: the fault of a kernel that
hands out output slots by an atomic counter is exactly that its order, and under
ties its set, follows thread timing.

``-inf`` marks a column that may not be chosen (beyond the query's causal
range): its key ranks after every finite one, among themselves by column, so a
row with fewer than ``k`` finite scores still gets a deterministic fill. NaN is
not a score (it has no place in the order): callers must not produce it.

Cost: five passes over the row (four histograms, one compaction) and one
bitonic sort of ``k`` (padded to a power of two); ``k`` past ``MAX_SORT`` runs
the stable-sort reference instead, which has the same answer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# The kernel's shape, measured on the H200 (bench/topk.py --variants, 2026-12-03; any shape gives the same
# answer): 8-bit digits beat 11-bit ones 1.6-3.7x (a histogram's cost grows with its bins); few rows want
# long blocks and 16 warps (one program per row, latency-bound), many rows 4,096 and 8 warps.
BLOCK, WARPS = 8192, 16  # up to FEW_ROWS rows
BLOCK_MANY, WARPS_MANY = 4096, 8
FEW_ROWS = 64
RADIX = 8  # bits per radix pass: 8 (four passes of 256 bins) or 11 (three of 2,048)
ORDER = "sort"  # how the selected are put in rank order: "sort" or "rank" (see topk_triton)
MASKED = False  # the histogram's mask argument (Triton >= 3.3) rather than bin 0
RANK_BLOCK = 128  # selected pairs per ranking tile
_ORDERS = {"none": 0, "sort": 1, "rank": 2}
MAX_SORT = 4096  # the largest k sorted in one program's registers


@triton.jit
def _keys(base, offs, n):
    """Signed 32-bit keys in the scores' float order and the in-range mask."""
    valid = offs < n
    s = tl.load(base + offs, mask=valid, other=0.0).to(tl.float32)
    s = tl.where(s == 0.0, 0.0, s)  # -0.0 == 0.0 in the order: one key for both
    bits = s.to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF), valid  # negative floats: reverse the magnitude bits


@triton.jit
def _refine(base, n, prefix, need, SHIFT: tl.constexpr, WIDTH: tl.constexpr, BLOCK: tl.constexpr, MASKED: tl.constexpr):
    """One radix pass: among keys whose bits above ``SHIFT + WIDTH`` equal ``prefix``, the ``WIDTH`` bits
    holding the ``need``-th largest; returns the longer prefix and what is still needed inside it."""
    NB: tl.constexpr = 1 << WIDTH
    hist = tl.zeros([NB], dtype=tl.int32)
    missed = 0
    for j0 in range(0, n, BLOCK):
        offs = j0 + tl.arange(0, BLOCK)
        key, valid = _keys(base, offs, n)
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
    hist -= tl.where(bins == 0, missed, 0)
    above = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0)  # keys in higher bins than each bin
    hit = (above < need) & (above + hist >= need)  # exactly one bin (it holds the need-th key)
    b = tl.max(tl.where(hit, bins, -1), axis=0)
    need -= tl.sum(tl.where(bins == b, above, 0), axis=0)
    return (prefix << WIDTH) | b, need


@triton.jit(do_not_specialize=["n", "k", "stride"])
def _radix_select_kernel(s_ptr, buf_ptr, idx_ptr, val_ptr, n, k, stride, BLOCK: tl.constexpr, RADIX: tl.constexpr,
                         KP: tl.constexpr, ORDER: tl.constexpr, MASKED: tl.constexpr, RB: tl.constexpr):  # fmt: skip
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
    buf = buf_ptr + row.to(tl.int64) * KP
    equal_before = 0
    written = 0
    for j0 in range(0, n, BLOCK):
        offs = j0 + tl.arange(0, BLOCK)
        key, valid = _keys(base, offs, n)
        eq = valid & (key == threshold)
        eq_rank = equal_before + tl.cumsum(eq.to(tl.int32), axis=0) - 1
        sel = (valid & (key > threshold)) | (eq & (eq_rank < need))
        at = written + tl.cumsum(sel.to(tl.int32), axis=0) - 1
        packed = (key.to(tl.int64) << 32) | (4294967295 - offs.to(tl.int64))
        tl.store(buf + at, packed, mask=sel)
        equal_before += tl.sum(eq.to(tl.int32), axis=0)
        written += tl.sum(sel.to(tl.int32), axis=0)
    tl.debug_barrier()  # the compaction's stores, by any thread, before the ordering's loads
    if ORDER == 2:  # rank by counting among the k selected (distinct packed keys: ranks are a permutation)
        for i0 in range(0, k, RB):
            oi = i0 + tl.arange(0, RB)
            mi = oi < k
            pi = tl.load(buf + oi, mask=mi, other=-9223372036854775808)
            rank = tl.zeros([RB], dtype=tl.int32)
            for j0 in range(0, k, RB):
                oj = j0 + tl.arange(0, RB)
                pj = tl.load(buf + oj, mask=oj < k, other=-9223372036854775808)
                rank += tl.sum(((pj[None, :] > pi[:, None]) & (oj[None, :] < k)).to(tl.int32), axis=1)
            _store_packed(idx_ptr, val_ptr, row.to(tl.int64) * k + rank, pi, mi)
    else:
        slots = tl.arange(0, KP)
        packed = tl.load(buf + slots, mask=slots < k, other=-9223372036854775808)
        if ORDER == 1:  # (0 only times the passes alone in bench/topk.py: the order is then the columns')
            packed = tl.sort(packed, descending=True)
        _store_packed(idx_ptr, val_ptr, row.to(tl.int64) * k + slots, packed, slots < k)


@triton.jit
def _store_packed(idx_ptr, val_ptr, out, packed, mask):
    """Unpack ``key << 32 | ~column`` into the column and its float score and store them at ``out``."""
    col = 4294967295 - (packed & 4294967295)
    key = (packed >> 32).to(tl.int32)
    bits = key ^ ((key >> 31) & 0x7FFFFFFF)
    tl.store(idx_ptr + out, col, mask=mask)
    tl.store(val_ptr + out, bits.to(tl.float32, bitcast=True), mask=mask)


def topk_triton(
    scores: torch.Tensor,
    k: int,
    *,
    radix: int = RADIX,
    block: int | None = None,
    num_warps: int | None = None,
    order: str = ORDER,
    masked: bool = MASKED,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of ``scores [rows, n]``: the ``k`` best (values as float32, column indices as int64), in rank order.

    ``radix``, ``block``, ``num_warps``, ``order`` (``"sort"``: a bitonic sort of the selected in registers;
    ``"rank"``: each one's rank counted among the selected), ``masked`` (the histogram's mask argument, or
    non-matching keys counted into bin 0 and taken back out): the kernel's shape - any gives the same answer
    (``bench/topk.py --variants`` times them). ``order="none"`` leaves the selection in column order (timing
    only)."""
    rows, n = _check(scores, k)
    if k > MAX_SORT:  # too many to sort in registers: the same answer through the stable sort
        return topk_reference(scores, k)
    if radix not in (8, 11):
        raise ValueError(f"top-k: radix must be 8 or 11 bits, got {radix}")
    if order not in _ORDERS:
        raise ValueError(f"top-k: order must be one of {sorted(_ORDERS)}, got {order!r}")
    scores = scores.contiguous()
    few = rows <= FEW_ROWS
    block = block or (BLOCK if few else BLOCK_MANY)
    num_warps = num_warps or (WARPS if few else WARPS_MANY)
    idx = torch.empty(rows, k, dtype=torch.int64, device=scores.device)
    val = torch.empty(rows, k, dtype=torch.float32, device=scores.device)
    if rows and k:
        kp = triton.next_power_of_2(k)
        buf = torch.empty(rows, kp, dtype=torch.int64, device=scores.device)
        _radix_select_kernel[(rows,)](
            scores, buf, idx, val, n, k, scores.stride(0), BLOCK=block, RADIX=radix, KP=kp, ORDER=_ORDERS[order],
            MASKED=masked, RB=RANK_BLOCK, num_warps=num_warps,
        )  # fmt: skip
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
