"""Row-invariant GEMM: ``y = x @ w.T (+ bias)`` for a linear layer's weight ``w [N, K]``.

NOTE(invariance), by construction:

* The tile configuration (``BLOCK_M``, ``BLOCK_N``, ``BLOCK_K``, warps,
  stages) is a function of the weight's shape ``(N, K)``, the dtype and the
  GPU model only (:func:`gemm_config`: a measured table, ``gemm_tuned.json``,
  else a fixed rule). The number of rows ``M`` changes the grid, never the
  kernel: a row computed in a 1-row decode and in a 4000-row prefill runs the
  same compiled code (``M`` is not specialised).
* No split-K: one program owns an output tile and walks ``K`` from 0 upwards in
  ``BLOCK_K`` steps, accumulating in float32 in that order. Output element
  ``(i, j)`` is therefore a fixed sequence of ``tl.dot`` steps over row ``i``
  of ``x`` and row ``j`` of ``w``; the matrix instruction computes every
  element of its tile the same way, so rows never interact and a row's
  position inside its tile does not matter.
* float32 models use ``input_precision="ieee"`` (no TF32 rounding of the
  inputs), bfloat16 models the tensor cores' bf16 x bf16 -> fp32 path.

cuBLAS may choose split-K or another algorithm by problem size (and, for
float32, row results were measured to differ for M <= 256 on an H200): it only
backs ``numerics="shape-dependent"``.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl

# Under Triton's CPU interpreter tl.dot is numpy's BLAS, whose result for a row depends on the row's
# position in the tile; there the product is an element-wise multiply and an in-order sum instead,
# so that CI checks the kernel's structure (tiles, masks, K order) with row-invariant arithmetic.
# Compiled on a GPU, the matrix instruction treats every row of its tile alike.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def tuned_key(n: int, k: int, dtype: torch.dtype) -> str:
    return f"{n}x{k}:{str(dtype).removeprefix('torch.')}"


@functools.cache
def tuned_table(device_name: str) -> dict[str, GemmConfig]:
    """Tile configurations measured for one GPU model (``bench/tune_gemm.py`` writes them).

    Read once per process from ``KVWARDEN_GEMM_TABLE`` or the packaged ``gemm_tuned.json``: a table
    fixed for the life of the engine keeps every weight's configuration fixed.
    """
    path = Path(os.environ.get("KVWARDEN_GEMM_TABLE") or Path(__file__).with_name("gemm_tuned.json"))
    if not path.is_file():
        return {}
    entries = json.loads(path.read_text()).get(device_name, {}).get("shapes", {})
    return {key: GemmConfig(**cfg) for key, cfg in entries.items()}


def gemm_config(n: int, k: int, dtype: torch.dtype, device_name: str = "") -> GemmConfig:
    """The one tile configuration for a weight of shape ``[n, k]`` (never depends on the row count):
    the tuned one for this GPU model when ``gemm_tuned.json`` has it, else a fixed rule."""
    tuned = tuned_table(device_name).get(tuned_key(n, k, dtype)) if device_name else None
    if tuned is not None:
        return tuned
    block_k = 64 if k >= 64 else max(16, triton.next_power_of_2(k))
    block_n = 128 if n >= 4096 else 64 if n >= 64 else max(16, triton.next_power_of_2(n))
    if dtype == torch.float32:  # ieee fp32 dots need more registers per element
        return GemmConfig(32, min(block_n, 64), min(block_k, 32), 4, 2)
    return GemmConfig(64, block_n, block_k, 4, 3)


@triton.jit(do_not_specialize=["M"])
def _linear_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    HAS_BIAS: tl.constexpr,
    IEEE: tl.constexpr,
    BY_SUM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(
            x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0
        )
        w = tl.load(
            w_ptr + rn[None, :] * stride_wn + rk[:, None], mask=(rn[None, :] < N) & (rk[:, None] < K), other=0.0
        )
        if BY_SUM:  # the interpreter (see INTERPRETED)
            acc += tl.sum(x.to(tl.float32)[:, :, None] * w.to(tl.float32)[None, :, :], axis=1)
        elif IEEE:
            acc = tl.dot(x, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w, acc)
    if HAS_BIAS:
        acc = acc + tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=mask)


@functools.cache
def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else ""


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K] @ weight[N, K].T (+ bias)`` in ``x``'s dtype, row-invariant by construction."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    cfg = gemm_config(n, k, x.dtype, _device_name(x.device))
    grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n))
    _linear_kernel[grid](
        x,
        weight,
        bias if bias is not None else y,
        y,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        y.stride(0),
        HAS_BIAS=bias is not None,
        IEEE=x.dtype == torch.float32,
        BY_SUM=INTERPRETED,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return y
