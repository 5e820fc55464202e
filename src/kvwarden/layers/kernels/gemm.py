"""Row-invariant GEMM: ``y = x @ w.T (+ bias)`` for a linear layer's weight ``w [N, K]``.

NOTE(invariance), by construction:

* The tile configuration (``BLOCK_M``, ``BLOCK_N``, ``BLOCK_K``, warps,
  stages) and the split of ``K`` are functions of the weight's shape
  ``(N, K)``, the dtype and the GPU model only (:func:`gemm_config`: a
  measured table, ``gemm_tuned.json``, else a fixed rule; :func:`split_blocks`).
  The number of rows ``M`` changes the grid, never the arithmetic: a row
  computed in a 1-row decode and in a 4000-row prefill runs the same sequence
  of operations (``M`` is not specialised). A launch of at most one tile of
  rows may own fewer columns per program and pipeline deeper (``BLOCK_N`` and
  stages from the table's few-rows entries, :func:`launch_config`): neither
  enters an element's arithmetic, and the split of K stays the weight's.
* ``K`` is cut into splits at fixed boundaries (``SPLIT_BLOCKS`` blocks of
  ``BLOCK_K`` from 0 upwards). Each split's partial sum starts at zero and
  walks its blocks in order with ``tl.dot``, accumulating in float32; the
  partials are then added to a zero total in split order. Output element
  ``(i, j)`` is therefore a fixed sequence of ``tl.dot`` steps over row ``i``
  of ``x`` and row ``j`` of ``w`` and a fixed chain of float32 adds; the matrix
  instruction computes every element of its tile the same way, so rows never
  interact and a row's position inside its tile does not matter.
* The splits run in one of two forms, a speed choice only (the same bits):
  *walked*, one program per output tile going through every split in turn
  (many tiles: prefill and large batches), or *parallel*, one program per
  (tile, split) storing its float32 partial, the last of a tile's programs to
  finish (an atomic counter) adding them up in split order (few tiles: a
  GEMV-shaped decode step, where one program per tile would leave most of the
  GPU idle). Both compute a split's partial the same way (from an exact zero,
  its blocks in order through the same ``_mac``) and fold with the same
  formula; which program happens to fold changes nothing, since it reads every
  partial from memory in split order. (cuBLAS splits K too, but chooses the
  split from the whole problem shape, ``M`` included, and split-K kernels that
  fold with atomic adds sum in arrival order: either makes a row depend on the
  batch.)
* float32 models use ``input_precision="ieee"`` (no TF32 rounding of the
  inputs), bfloat16 models the tensor cores' bf16 x bf16 -> fp32 path.
* FP8 block-quantized weights (W8A16, ``models/quant.py``): each weight tile
  is dequantized in registers, element by element, exactly as the CPU
  dequantizes at load (``float32(q) * scale``, rounded once to the model's
  dtype), then enters the same ``tl.dot`` steps. A scale belongs to the
  weight, never to the batch, so the product of a row is the dense model's
  on the dequantized weights, bit for bit, with the same tiles and splits.
  Activations are not quantized: per-token activation scales (W8A8) would be
  row-local too, but change the answer against the dequantized model.

cuBLAS may choose split-K or another algorithm by problem size (and, for
float32, row results were measured to differ for M <= 256 on an H200): it only
backs ``numerics="shape-dependent"``.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from kvwarden.intmath import cdiv
from kvwarden.layers.fp8 import BlockFp8
from kvwarden.layers.kernels.gemm_config import (  # noqa: F401 (re-exported: gemm.gemm_config, gemm.GemmConfig, ...)
    GemmConfig,
    gemm_config,
    launch_config,
    split_blocks,
    splits_in_parallel,
    tuned_key,
    tuned_table,
)

# Under Triton's CPU interpreter tl.dot is numpy's BLAS, whose result for a row depends on the row's
# position in the tile; there the product is an element-wise multiply and an in-order sum instead,
# so that CI checks the kernel's structure (tiles, masks, K order) with row-invariant arithmetic.
# Compiled on a GPU, the matrix instruction treats every row of its tile alike.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

COUNTERS = 1024  # per-tile arrival counters a caller keeps zeroed (:func:`new_counters`)


def new_counters(device: torch.device | str) -> torch.Tensor:
    """Arrival counters for the parallel form: zero, and every launch leaves them zero."""
    return torch.zeros(COUNTERS, dtype=torch.int32, device=device)


@triton.jit
def dot_acc(x, w, acc, BY_SUM: tl.constexpr, IEEE: tl.constexpr):
    """``acc + x @ w`` in float32: the one accumulation step of every row-invariant product (this GEMM,
    the MoE experts'). Under the interpreter an in-order multiply-and-sum (see INTERPRETED)."""
    if BY_SUM:
        acc += tl.sum(x.to(tl.float32)[:, :, None] * w.to(tl.float32)[None, :, :], axis=1)
    elif IEEE:
        acc = tl.dot(x, w, acc, input_precision="ieee")
    else:
        acc = tl.dot(x, w, acc)
    return acc


@triton.jit
def dequant_tile(w, s_rows, rk, mask, QBK: tl.constexpr, out_ty: tl.constexpr):
    """An FP8 weight tile ``w`` (columns ``rk``) as ``(float32(w) * scale).to(out_ty)``: ``s_rows`` points at
    each column's row of block scales (``[1, BN]``), the block of column ``k`` is ``k // QBK``. This is
    models/quant.py's ``dequantize`` element by element (the same IEEE multiply, one rounding), so the tile
    holds the dequantized checkpoint's bits and the product after it is the dense model's."""
    s = tl.load(s_rows + rk // QBK, mask=mask, other=1.0)
    return (w.to(tl.float32) * s).to(out_ty)


@triton.jit
def _mac(acc, x_ptr, w_ptr, rm, rn, k0, M, N, K, stride_xm, stride_wn, IEEE, BY_SUM, BLOCK_K: tl.constexpr,
         s_rows, SCALED: tl.constexpr, QBK: tl.constexpr):  # fmt: skip
    """``acc += x[rm, k0:k0+BLOCK_K] @ w[rn, k0:k0+BLOCK_K].T``, in float32; ``SCALED``: ``w`` is FP8 and
    ``s_rows`` its columns' block-scale rows (:func:`dequant_tile`)."""
    rk = k0 + tl.arange(0, BLOCK_K)
    x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
    wmask = (rn[None, :] < N) & (rk[:, None] < K)
    w = tl.load(w_ptr + rn[None, :] * stride_wn + rk[:, None], mask=wmask, other=0.0)
    if SCALED:
        w = dequant_tile(w, s_rows, rk[:, None], wmask, QBK, x.dtype)
    return dot_acc(x, w, acc, BY_SUM, IEEE)


@triton.jit
def _store(total, total_up, b_ptr, y_ptr, rm, rn, M, N, stride_ym, HAS_BIAS, GLU: tl.constexpr):
    """The output tile: ``total`` (+ bias), or with ``GLU`` ``silu(gate) * up`` of the gate and up totals."""
    if HAS_BIAS:
        total = total + tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        if GLU:
            total_up = total_up + tl.load(b_ptr + N + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    if GLU:  # NOTE(invariance): the rounding points of the unfused path (kernels/pointwise.py, silu_mul): the
        # gate and up outputs rounded to the model's dtype, silu rounded, the product rounded
        g = total.to(y_ptr.dtype.element_ty).to(tl.float32)
        up = total_up.to(y_ptr.dtype.element_ty).to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(y_ptr.dtype.element_ty).to(tl.float32)
        total = act * up
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], total.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M"])
def _linear_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, part_ptr, count_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
    stride_xh, stride_wh, stride_yh, s_ptr, stride_sn,
    HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, BY_SUM: tl.constexpr, SPLIT_BLOCKS: tl.constexpr,
    PARALLEL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GLU: tl.constexpr, SCALED: tl.constexpr, QBN: tl.constexpr, QBK: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    # axis 1 walks (head, output tile): a head-batched launch (linear_heads) is one GEMM per head, each
    # through its own x / w / y slices with the very same arithmetic as its own launch would run
    n_tiles = tl.cdiv(N, BLOCK_N)
    head = tl.program_id(1) // n_tiles
    pid_n = tl.program_id(1) % n_tiles
    x_ptr += head * stride_xh
    w_ptr += head * stride_wh
    y_ptr += head * stride_yh
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # GLU (linear_swiglu): a weight of 2N rows, gate then up; this program also runs the up rows' columns
    # (rn + N) through the very same steps, so each output keeps its unfused bits, and the epilogue fuses SwiGLU
    u_ptr = w_ptr + N * stride_wn
    # FP8 weights (never head-batched): each column's row of block scales, the gate's rows counted from 0
    # and the up rows from N of the stored weight (so a block may hold gate and up rows alike)
    sg = s_ptr + ((rn[None, :] // QBN) * stride_sn).to(tl.int64)
    su = s_ptr + (((N + rn[None, :]) // QBN) * stride_sn).to(tl.int64)
    if SPLIT_BLOCKS == 0:  # one split (all of K): the partial is the total, walked with the loop pipelined
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            acc = _mac(acc, x_ptr, w_ptr, rm, rn, k0, M, N, K, stride_xm, stride_wn, IEEE, BY_SUM, BLOCK_K,
                       sg, SCALED, QBK)  # fmt: skip
            if GLU:
                acc_u = _mac(acc_u, x_ptr, u_ptr, rm, rn, k0, M, N, K, stride_xm, stride_wn, IEEE, BY_SUM, BLOCK_K,
                             su, SCALED, QBK)  # fmt: skip
        _store(acc, acc_u, b_ptr, y_ptr, rm, rn, M, N, stride_ym, HAS_BIAS, GLU)
    elif not PARALLEL:  # walked: one loop over K (pipelined); a split's partial joins the total where it ends
        total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        total_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            acc = _mac(acc, x_ptr, w_ptr, rm, rn, k0, M, N, K, stride_xm, stride_wn, IEEE, BY_SUM, BLOCK_K,
                       sg, SCALED, QBK)  # fmt: skip
            end = ((k0 + BLOCK_K) % (SPLIT_BLOCKS * BLOCK_K) == 0) | (k0 + BLOCK_K >= K)
            total = tl.where(end, total + acc, total)
            acc = tl.where(end, 0.0, acc)  # the next split's partial starts from zero, as in its own program
            if GLU:
                acc_u = _mac(acc_u, x_ptr, u_ptr, rm, rn, k0, M, N, K, stride_xm, stride_wn, IEEE, BY_SUM, BLOCK_K,
                             su, SCALED, QBK)  # fmt: skip
                total_u = tl.where(end, total_u + acc_u, total_u)
                acc_u = tl.where(end, 0.0, acc_u)
        _store(total, total_u, b_ptr, y_ptr, rm, rn, M, N, stride_ym, HAS_BIAS, GLU)
    else:  # parallel: this program's split, stored; the tile's last program to arrive folds them in order
        split = tl.program_id(2)
        nsplit = tl.num_programs(2)
        k_lo = split * (SPLIT_BLOCKS * BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(k_lo, tl.minimum(k_lo + SPLIT_BLOCKS * BLOCK_K, K), BLOCK_K):
            acc = _mac(acc, x_ptr, w_ptr, rm, rn, k0, M, N, K, stride_xm, stride_wn, IEEE, BY_SUM, BLOCK_K,
                       sg, SCALED, QBK)  # fmt: skip
            if GLU:
                acc_u = _mac(acc_u, x_ptr, u_ptr, rm, rn, k0, M, N, K, stride_xm, stride_wn, IEEE, BY_SUM, BLOCK_K,
                             su, SCALED, QBK)  # fmt: skip
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        row_n = rm[:, None].to(tl.int64) * N + rn[None, :]
        part_ptr += head * nsplit * M * N
        up_part = part_ptr + nsplit * M * N  # GLU: the up partials after the gate's
        tl.store(part_ptr + split * M * N + row_n, acc, mask=mask)  # split * M * N: bounded (splits_in_parallel)
        if GLU:
            tl.store(up_part + split * M * N + row_n, acc_u, mask=mask)
        tl.debug_barrier()  # every thread's partial is stored before the counter says so (release below)
        tile = pid_m * tl.num_programs(1) + tl.program_id(1)
        arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel")
        if arrived == nsplit - 1:
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            total_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for j in range(0, nsplit):  # split order, whichever program folds
                part = tl.load(part_ptr + j * M * N + row_n, mask=mask, other=0.0, cache_modifier=".cg")
                total = total + part
                if GLU:
                    part_u = tl.load(up_part + j * M * N + row_n, mask=mask, other=0.0, cache_modifier=".cg")
                    total_u = total_u + part_u
            tl.atomic_xchg(count_ptr + tile, 0)  # zero again for the next launch (a CUDA graph replays it)
            _store(total, total_u, b_ptr, y_ptr, rm, rn, M, N, stride_ym, HAS_BIAS, GLU)


@functools.cache
def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else ""


def launch(
    x: torch.Tensor,
    weight: torch.Tensor | BlockFp8,
    bias: torch.Tensor | None,
    cfg: GemmConfig,
    parallel: bool = False,
    counters: torch.Tensor | None = None,
    blocks: int | None = None,
    glu: bool = False,
) -> torch.Tensor:
    """One GEMM with an explicit configuration (``linear`` chooses it; ``kvwarden bench tune_gemm`` tries them).

    ``x [M, K]`` and ``weight [N, K]`` give ``[M, N]``; ``x [M, H, K]`` and ``weight [H, N, K]`` give
    ``[M, H, N]``, head ``h``'s columns from its own weight (:func:`linear_heads`); ``glu``: ``weight
    [2N, K]`` (gate rows, then up rows) gives ``silu(gate) * up`` ``[M, N]`` (:func:`linear_swiglu`), its
    tiles half as wide so that a program does the unfused one's work. ``blocks`` overrides
    :func:`split_blocks` of ``cfg``: the engine passes the weight's own split with few-rows tiles
    (:func:`launch_config`); any other value changes the bits (``kvwarden bench gemm_split`` times the
    unsplit kernel with it).
    """
    scale, qbn, qbk = None, 1, 1
    if isinstance(weight, BlockFp8):
        if x.dim() == 3:
            raise ValueError("a head-batched GEMM takes no FP8 weight (dequantize it at load)")
        weight, scale, (qbn, qbk) = weight.q, weight.scale, weight.block
    heads = x.shape[1] if x.dim() == 3 else 1
    m, k = x.shape[0], x.shape[-1]
    n = weight.shape[-2]  # the weight's rows: the splits and the form follow them, fused or not
    if heads > 1 and (bias is not None or glu):
        raise ValueError("a head-batched GEMM takes no bias and no SwiGLU")
    n_out, block_n = (n // 2, cfg.block_n // 2) if glu else (n, cfg.block_n)
    y = torch.empty((m, heads, n_out) if x.dim() == 3 else (m, n_out), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    blocks = split_blocks(n, k, cfg) if blocks is None else blocks
    nsplit = cdiv(cdiv(k, cfg.block_k), blocks)
    blocks = blocks if nsplit > 1 else 0  # 0: one split, the kernel's plain loop
    grid: tuple[int, ...] = (triton.cdiv(m, cfg.block_m), triton.cdiv(n_out, block_n) * heads)
    parallel = parallel and nsplit > 1
    part = y  # unused unless parallel
    if parallel:
        if grid[0] * grid[1] > COUNTERS:
            raise ValueError(f"a parallel split GEMM of {grid[0] * grid[1]} tiles exceeds {COUNTERS} counters")
        counters = new_counters(x.device) if counters is None else counters
        part = torch.empty((heads * nsplit * (2 if glu else 1), m, n_out), dtype=torch.float32, device=x.device)
        grid = (*grid, nsplit)
    batched = x.dim() == 3  # per-head strides; 0 for a plain GEMM (head is always 0 there)
    _linear_kernel[grid](
        x, weight, bias if bias is not None else y, y, part, counters if counters is not None else y,
        m, n_out, k, x.stride(0), weight.stride(-2), y.stride(0),
        x.stride(1) if batched else 0, weight.stride(0) if batched else 0, y.stride(1) if batched else 0,
        scale if scale is not None else y, scale.stride(0) if scale is not None else 0,
        HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32, BY_SUM=INTERPRETED, SPLIT_BLOCKS=blocks,
        PARALLEL=parallel, BLOCK_M=cfg.block_m, BLOCK_N=block_n, BLOCK_K=cfg.block_k, GLU=glu,
        SCALED=scale is not None, QBN=qbn, QBK=qbk,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return y


def linear(
    x: torch.Tensor,
    weight: torch.Tensor | BlockFp8,
    bias: torch.Tensor | None = None,
    counters: torch.Tensor | None = None,
    parallel: bool | None = None,
) -> torch.Tensor:
    """``x [M, K] @ weight[N, K].T (+ bias)`` in ``x``'s dtype, row-invariant by construction.

    Args:
        counters: zeroed arrival counters (:func:`new_counters`) that let a launch with few output
            tiles run its splits of K in parallel; without them the splits are walked.
        parallel: force the form (tests); ``None`` chooses by the launch. The bits are the same.
    """
    if x.stride(-1) != 1:
        x = x.contiguous()
    if not isinstance(weight, BlockFp8) and weight.stride(-1) != 1:
        weight = weight.contiguous()
    m, k = x.shape
    n = weight.shape[0]
    cfg, blocks = launch_config(m, n, k, x.dtype, device_name(x.device))
    if parallel is None:
        parallel = counters is not None and splits_in_parallel(m, n, k, cfg, x.element_size(), blocks)
    return launch(x, weight, bias, cfg, parallel, counters, blocks)
