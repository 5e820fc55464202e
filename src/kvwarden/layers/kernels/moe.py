"""Sparse MoE on the device: routing, dispatch, expert GEMMs and the rank-order combine, no host round-trip.

The router's softmax, top-k and renormalisation are one kernel (one program
per token). A step's (token, rank) pairs are sorted by expert (a stable sort:
ties keep pair order) and cut into tiles of ``BLOCK_M`` pairs of one expert
(one small kernel finds each tile's expert and pairs by binary search in the
sorted list); a fixed-size grid (enough tiles for any routing of the step's
pairs) runs two kernels over them - ``gate | up`` with the SwiGLU in the epilogue, then ``down`` with the
routing weight - and a third sums each token's ranks in rank order, adding the
gated shared expert. Every shape is fixed by the number of rows, so a decode
step is replayable from a CUDA graph (nothing is read back to the host).

NOTE(invariance), by construction:

* An expert GEMM's tile configuration (``BLOCK_M``, ``BLOCK_N``, ``BLOCK_K``)
  is a function of the expert's weight shape and dtype only. A pair's output
  element is the fixed sequence of ``tl.dot`` steps over its own row of ``x``
  and the expert's column, ``K`` walked from 0 in ``BLOCK_K`` steps, in float32:
  the matrix instruction computes every row of its tile alike, so neither the
  other pairs in the tile (how many tokens chose the expert, which ones) nor the
  tile's position matter - the argument of ``kernels/gemm.py``.
* FP8 experts (``layers/fp8.py``): each weight tile is dequantized in registers
  exactly as the dense path dequantizes at load (``gemm.dequant_tile``), from
  the expert's own block scales; the pair's arithmetic is the dense model's.
* Rounding points are those of the unfused layers: ``gate`` and ``up`` rounded to
  the model dtype, then SwiGLU as ``kernels/pointwise.py`` computes it; the down
  projection rounded, then times the routing weight, rounded; ranks added
  ``((r0 + r1) + r2) + ...`` in the model dtype, then the shared expert (times
  the sigmoid of its gate, rounded). No atomics, no scattered accumulation.
* Routing is row-wise: one program per token computes its softmax (one block
  of the expert count) and picks the ``k`` largest probabilities, ties to the
  lowest expert index (what a stable descending sort gives), then renormalises
  them - the same for any batch.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from kvwarden.layers.fp8 import BlockFp8
from kvwarden.layers.kernels.gemm import INTERPRETED, dequant_tile, dot_acc

STEPS = 24  # binary-search steps: enough for 16M pairs (a constant: no recompiles as the batch changes)


def block_m(dtype: torch.dtype) -> int:
    """Pairs per tile: a function of the dtype only (fixed for the life of the model)."""
    return 32 if dtype == torch.float32 else 64


def _block_nk(n: int, k: int, dtype: torch.dtype) -> tuple[int, int]:
    bk = 64 if k >= 64 else max(16, triton.next_power_of_2(k))
    bn = 64 if n >= 64 else max(16, triton.next_power_of_2(n))
    if dtype == torch.float32:
        bk = min(bk, 32)
    return bn, bk


@triton.jit
def _tile(block_expert_ptr, block_first_ptr, nrows, order_ptr, BM: tl.constexpr):
    """The tile's expert, and each of its rows' sorted index, pair and validity."""
    b = tl.program_id(0)
    e = tl.load(block_expert_ptr + b)
    first = tl.load(block_first_ptr + b)
    rm = tl.arange(0, BM)
    valid = rm < nrows
    pair = tl.load(order_ptr + first + rm, mask=valid, other=0)
    return e, first + rm, pair, valid


@triton.jit(do_not_specialize=["num_pairs"])
def _gate_up_kernel(
    x_ptr, x_stride, w_ptr, act_ptr, order_ptr, block_expert_ptr, block_first_ptr, block_rows_ptr, num_pairs,
    s_ptr, s_stride_e, s_stride_n,
    INTER: tl.constexpr, H: tl.constexpr, TOPK: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    BY_SUM: tl.constexpr, IEEE: tl.constexpr, SCALED: tl.constexpr, QBN: tl.constexpr, QBK: tl.constexpr,
):  # fmt: skip
    nrows = tl.load(block_rows_ptr + tl.program_id(0))
    if nrows > 0:  # the fixed grid's spare tiles stop here
        e, sorted_idx, pair, valid = _tile(block_expert_ptr, block_first_ptr, nrows, order_ptr, BM)
        rn = tl.program_id(1) * BN + tl.arange(0, BN)
        nmask = rn < INTER
        token = (pair // TOPK).to(tl.int64)
        w_base = w_ptr + e.to(tl.int64) * (2 * INTER * H)
        s_base = s_ptr + e.to(tl.int64) * s_stride_e
        sg = s_base + (rn[None, :] // QBN) * s_stride_n  # each column's row of block scales (FP8 only)
        su = s_base + ((INTER + rn[None, :]) // QBN) * s_stride_n
        acc_g = tl.zeros((BM, BN), dtype=tl.float32)
        acc_u = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, H, BK):
            rk = k0 + tl.arange(0, BK)
            kmask = rk < H
            x = tl.load(
                x_ptr + token[:, None] * x_stride + rk[None, :], mask=valid[:, None] & kmask[None, :], other=0.0
            )
            wmask = nmask[None, :] & kmask[:, None]
            wg = tl.load(w_base + rn[None, :] * H + rk[:, None], mask=wmask, other=0.0)
            wu = tl.load(w_base + (INTER + rn[None, :]) * H + rk[:, None], mask=wmask, other=0.0)
            if SCALED:
                wg = dequant_tile(wg, sg, rk[:, None], wmask, QBK, x.dtype)
                wu = dequant_tile(wu, su, rk[:, None], wmask, QBK, x.dtype)
            acc_g = dot_acc(x, wg, acc_g, BY_SUM, IEEE)
            acc_u = dot_acc(x, wu, acc_u, BY_SUM, IEEE)
        out_ty = act_ptr.dtype.element_ty
        gate = acc_g.to(out_ty).to(tl.float32)
        up = acc_u.to(out_ty)
        act = (gate / (1.0 + tl.exp(-gate))).to(out_ty)
        y = (act.to(tl.float32) * up.to(tl.float32)).to(out_ty)
        tl.store(act_ptr + sorted_idx[:, None] * INTER + rn[None, :], y, mask=valid[:, None] & nmask[None, :])


@triton.jit(do_not_specialize=["num_pairs"])
def _down_kernel(
    act_ptr, w_ptr, weight_ptr, out_ptr, order_ptr, block_expert_ptr, block_first_ptr, block_rows_ptr, num_pairs,
    s_ptr, s_stride_e, s_stride_n,
    INTER: tl.constexpr, H: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    BY_SUM: tl.constexpr, IEEE: tl.constexpr, SCALED: tl.constexpr, QBN: tl.constexpr, QBK: tl.constexpr,
):  # fmt: skip
    nrows = tl.load(block_rows_ptr + tl.program_id(0))
    if nrows > 0:  # the fixed grid's spare tiles stop here
        e, sorted_idx, pair, valid = _tile(block_expert_ptr, block_first_ptr, nrows, order_ptr, BM)
        rn = tl.program_id(1) * BN + tl.arange(0, BN)
        nmask = rn < H
        w_base = w_ptr + e.to(tl.int64) * (H * INTER)
        s_rows = s_ptr + e.to(tl.int64) * s_stride_e + (rn[None, :] // QBN) * s_stride_n
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, INTER, BK):
            rk = k0 + tl.arange(0, BK)
            kmask = rk < INTER
            a = tl.load(
                act_ptr + sorted_idx[:, None] * INTER + rk[None, :], mask=valid[:, None] & kmask[None, :], other=0.0
            )
            wmask = nmask[None, :] & kmask[:, None]
            w = tl.load(w_base + rn[None, :] * INTER + rk[:, None], mask=wmask, other=0.0)
            if SCALED:
                w = dequant_tile(w, s_rows, rk[:, None], wmask, QBK, a.dtype)
            acc = dot_acc(a, w, acc, BY_SUM, IEEE)
        out_ty = out_ptr.dtype.element_ty
        rw = tl.load(weight_ptr + pair, mask=valid, other=0.0).to(tl.float32)
        y = (acc.to(out_ty).to(tl.float32) * rw[:, None]).to(out_ty)
        tl.store(out_ptr + pair.to(tl.int64)[:, None] * H + rn[None, :], y, mask=valid[:, None] & nmask[None, :])


@triton.jit(do_not_specialize=["rows"])
def _combine_kernel(
    per_rank_ptr, shared_ptr, gate_ptr, y_ptr, rows, H,
    TOPK: tl.constexpr, HAS_SHARED: tl.constexpr, HAS_GATE: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < H
    out_ty = y_ptr.dtype.element_ty
    y = tl.load(per_rank_ptr + r * TOPK * H + cols, mask=mask, other=0.0)
    for rank in tl.static_range(1, TOPK):
        nxt = tl.load(per_rank_ptr + (r * TOPK + rank) * H + cols, mask=mask, other=0.0)
        y = (y.to(tl.float32) + nxt.to(tl.float32)).to(out_ty)
    if HAS_SHARED:
        s = tl.load(shared_ptr + r * H + cols, mask=mask, other=0.0)
        if HAS_GATE:
            g = tl.load(gate_ptr + r).to(tl.float32)
            sg = (1.0 / (1.0 + tl.exp(-g))).to(out_ty)
            s = (s.to(tl.float32) * sg.to(tl.float32)).to(out_ty)
        y = (y.to(tl.float32) + s.to(tl.float32)).to(out_ty)
    tl.store(y_ptr + r * H + cols, y, mask=mask)


@triton.jit(do_not_specialize=["rows"])
def _route_kernel(
    logits_ptr, weights_ptr, chosen_ptr, rows, E, TOPK: tl.constexpr, NORM: tl.constexpr, TOPK_FIRST: tl.constexpr,
    BE: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BE)
    mask = cols < E
    x = tl.load(logits_ptr + r * E + cols, mask=mask, other=float("-inf")).to(tl.float32)
    if TOPK_FIRST:  # Granite: the k largest logits, then a softmax over them
        p = tl.where(mask, x, float("-inf"))
    else:  # Qwen: the softmax over every expert (as kernels/rows.py computes it), then the k largest
        e = tl.where(mask, tl.exp(x - tl.max(x, axis=0)), 0.0)
        p = tl.where(mask, e / tl.sum(e, axis=0), -1.0)
    kk = tl.arange(0, BK)
    picked = tl.zeros((BK,), dtype=tl.float32)
    for i in tl.static_range(TOPK):
        best = tl.max(p, axis=0)
        idx = tl.min(tl.where(p == best, cols, BE), axis=0)  # ties: the lowest expert index
        tl.store(chosen_ptr + r * TOPK + i, idx.to(tl.int64))
        picked = tl.where(kk == i, best, picked)
        p = tl.where(cols == idx, float("-inf") if TOPK_FIRST else -2.0, p)
    if TOPK_FIRST:
        top = tl.where(kk < TOPK, picked, float("-inf"))
        ex = tl.where(kk < TOPK, tl.exp(top - tl.max(top, axis=0)), 0.0)
        picked = ex / tl.sum(ex, axis=0)
    elif NORM:
        picked = picked / tl.sum(picked, axis=0)
    tl.store(weights_ptr + r * TOPK + kk, picked.to(weights_ptr.dtype.element_ty), mask=kk < TOPK)


def route(
    logits: torch.Tensor, topk: int, normalize: bool, dtype: torch.dtype, topk_first: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights [rows, k]`` in ``dtype``, ``chosen [rows, k]`` int64), ties to the lowest index: softmax then
    top-k (renormalised when ``normalize``), or with ``topk_first`` the top-k logits then their softmax."""
    rows, e = logits.shape
    weights = torch.empty((rows, topk), dtype=dtype, device=logits.device)
    chosen = torch.empty((rows, topk), dtype=torch.int64, device=logits.device)
    if rows:
        be = max(16, triton.next_power_of_2(e))
        _route_kernel[(rows,)](
            logits.contiguous(), weights, chosen, rows, e,
            TOPK=topk, NORM=normalize, TOPK_FIRST=topk_first, BE=be, BK=max(2, triton.next_power_of_2(topk)),
            num_warps=4 if be >= 1024 else 1,
        )  # fmt: skip
    return weights, chosen


@triton.jit(do_not_specialize=["pairs", "grid"])
def _dispatch_kernel(
    sorted_ptr, pairs, expert_ptr, first_ptr, rows_ptr, grid,
    E: tl.constexpr, BE: tl.constexpr, BM: tl.constexpr, STEPS: tl.constexpr, BG: tl.constexpr,
):  # fmt: skip
    ee = tl.arange(0, BE)
    emask = ee < E
    # each expert's first and end position in the sorted pairs: lower bounds by a branchless binary search
    lo = tl.zeros((BE,), dtype=tl.int32)
    hi = tl.zeros((BE,), dtype=tl.int32) + pairs
    lo2 = tl.zeros((BE,), dtype=tl.int32)
    hi2 = tl.zeros((BE,), dtype=tl.int32) + pairs
    for _ in tl.static_range(STEPS):
        mid = (lo + hi) // 2
        less = tl.load(sorted_ptr + mid, mask=lo < hi, other=0) < ee
        lo = tl.where((lo < hi) & less, mid + 1, lo)
        hi = tl.where((lo < hi) & ~less, mid, hi)
        mid2 = (lo2 + hi2) // 2
        less2 = tl.load(sorted_ptr + mid2, mask=lo2 < hi2, other=0) < ee + 1
        lo2 = tl.where((lo2 < hi2) & less2, mid2 + 1, lo2)
        hi2 = tl.where((lo2 < hi2) & ~less2, mid2, hi2)
    counts = tl.where(emask, lo2 - lo, 0)
    tiles = (counts + BM - 1) // BM
    tile_end = tl.cumsum(tiles, axis=0)
    tile_begin = tile_end - tiles
    for g0 in range(0, grid, BG):
        bb = g0 + tl.arange(0, BG)
        ex = tl.sum(((tile_end[None, :] <= bb[:, None]) & emask[None, :]).to(tl.int32), axis=1)
        sel = ee[None, :] == ex[:, None]
        local = bb - tl.sum(tl.where(sel, tile_begin[None, :], 0), axis=1)
        first = tl.sum(tl.where(sel, lo[None, :], 0), axis=1) + local * BM
        n = tl.minimum(tl.maximum(tl.sum(tl.where(sel, counts[None, :], 0), axis=1) - local * BM, 0), BM)
        keep = bb < grid
        tl.store(expert_ptr + bb, tl.minimum(ex, E - 1), mask=keep)
        tl.store(first_ptr + bb, first, mask=keep)
        tl.store(rows_ptr + bb, tl.where(ex < E, n, 0), mask=keep)


def dispatch(chosen: torch.Tensor, num_experts: int, bm: int) -> tuple[torch.Tensor, ...]:
    """Tiles of ``bm`` pairs of one expert, on the device with fixed shapes (no host read-back).

    Returns ``(order, block_expert, block_first, block_rows)``: pairs sorted by expert (ties by pair
    index), then per tile of the fixed grid its expert, first sorted index and number of pairs (0 for
    the grid's spare tiles).
    """
    flat = chosen.reshape(-1)
    pairs = flat.shape[0]
    ordered, order = torch.sort(flat, stable=True)
    grid = triton.cdiv(pairs, bm) + num_experts  # enough tiles for any routing
    meta = torch.empty((3, grid), dtype=torch.int32, device=flat.device)
    _dispatch_kernel[(1,)](
        ordered, pairs, meta[0], meta[1], meta[2], grid,
        E=num_experts, BE=max(16, triton.next_power_of_2(num_experts)), BM=bm,
        STEPS=STEPS, BG=32, num_warps=4,
    )  # fmt: skip
    return order.to(torch.int32), meta[0], meta[1], meta[2]


def _scaled(w: torch.Tensor | BlockFp8, placeholder: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any], tuple]:
    """``(weight, FP8 constexprs, (scale, expert stride, row stride))`` of a stacked expert weight."""
    if not isinstance(w, BlockFp8):
        return w, {"SCALED": False, "QBN": 1, "QBK": 1}, (placeholder, 0, 0)
    s = w.scale.contiguous()
    return w.q, {"SCALED": True, "QBN": w.block[0], "QBK": w.block[1]}, (s, s.stride(0), s.stride(1))


def experts(
    x: torch.Tensor,
    chosen: torch.Tensor,
    weights: torch.Tensor,
    w_gate_up: torch.Tensor | BlockFp8,
    w_down: torch.Tensor | BlockFp8,
) -> torch.Tensor:
    """Every (token, rank) pair through its expert: ``[rows, topk, H]``, each already times its routing weight.

    Args:
        x: ``[rows, H]``; chosen: ``[rows, topk]`` expert ids; weights: ``[rows, topk]`` in ``x``'s dtype.
        w_gate_up: ``[E, 2I, H]`` (gate rows, then up rows); w_down: ``[E, H, I]``; either FP8 with block
            scales (``layers/fp8.py``).
    """
    rows, h = x.shape
    num_experts, two_i, _ = w_gate_up.shape
    inter, topk = two_i // 2, chosen.shape[1]
    pairs = rows * topk
    out = torch.empty((rows, topk, h), dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    x = x.contiguous()
    bm = block_m(x.dtype)
    order, expert, first, nrows = dispatch(chosen, num_experts, bm)
    act = torch.empty((pairs, inter), dtype=x.dtype, device=x.device)
    ieee = x.dtype == torch.float32
    bn, bk = _block_nk(inter, h, x.dtype)
    w, fp8, scales = _scaled(w_gate_up, out)
    _gate_up_kernel[(expert.shape[0], triton.cdiv(inter, bn))](
        x, x.stride(0), w, act, order, expert, first, nrows, pairs, *scales,
        INTER=inter, H=h, TOPK=topk, BM=bm, BN=bn, BK=bk, BY_SUM=INTERPRETED, IEEE=ieee, **fp8,
    )  # fmt: skip
    bn, bk = _block_nk(h, inter, x.dtype)
    w, fp8, scales = _scaled(w_down, out)
    _down_kernel[(expert.shape[0], triton.cdiv(h, bn))](
        act, w, weights.contiguous(), out, order, expert, first, nrows, pairs, *scales,
        INTER=inter, H=h, BM=bm, BN=bn, BK=bk, BY_SUM=INTERPRETED, IEEE=ieee, **fp8,
    )  # fmt: skip
    return out


def combine(per_rank: torch.Tensor, shared: torch.Tensor | None, shared_gate: torch.Tensor | None) -> torch.Tensor:
    """``((r0 + r1) + ...) + shared * sigmoid(gate)`` per token, rounded to the model dtype after each add."""
    rows, topk, h = per_rank.shape
    y = torch.empty((rows, h), dtype=per_rank.dtype, device=per_rank.device)
    if rows:
        block = 1024
        _combine_kernel[(rows, triton.cdiv(h, block))](
            per_rank, shared if shared is not None else y, shared_gate if shared_gate is not None else y, y, rows, h,
            TOPK=topk, HAS_SHARED=shared is not None, HAS_GATE=shared_gate is not None, BLOCK=block,
        )  # fmt: skip
    return y
