"""Two more forms of the row-invariant GEMM (``kernels/gemm.py``), each one launch with the plain GEMM's bits:
``linear_heads`` (one GEMM per head over a strided view: MLA's absorbed projections) and ``linear_swiglu``
(the fused gate/up projection with SwiGLU in its epilogue: no ``silu_mul`` launch between the MLP's GEMMs).
"""

from __future__ import annotations

import torch

from kvwarden.intmath import cdiv
from kvwarden.layers.fp8 import BlockFp8
from kvwarden.layers.kernels import gemm, pointwise

MIN_BLOCK_N = 16  # a matrix product's smallest tile side: linear_swiglu halves the fused weight's tiles


def linear_heads(x: torch.Tensor, weight: torch.Tensor, counters: torch.Tensor | None = None) -> torch.Tensor:
    """``y[:, h] = x[:, h] @ weight[h].T`` for every head ``h`` in one launch: ``x [M, H, K]`` (rows may
    be strided, as a view of a wider projection), ``weight [H, N, K]``, ``y [M, H, N]``.

    NOTE(invariance): head ``h``'s output has the bits ``gemm.linear`` gives ``x[:, h]`` and ``weight[h]``:
    the configuration and splits come from the per-head shape ``(N, K)`` and each head's programs run
    the plain GEMM's arithmetic on their own slices (MLA's absorbed projections: one launch, not one per head).
    """
    if x.dim() != 3 or weight.dim() != 3 or x.shape[1] != weight.shape[0] or x.shape[2] != weight.shape[2]:
        raise ValueError(
            f"linear_heads: x {tuple(x.shape)} and weight {tuple(weight.shape)} are not [M, H, K], [H, N, K]"
        )
    if x.stride(-1) != 1:
        x = x.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    m, heads, k = x.shape
    n = weight.shape[1]
    cfg, blocks = gemm.launch_config(m, n, k, x.dtype, gemm.device_name(x.device))
    parallel = counters is not None and gemm.splits_in_parallel(m, n, k, cfg, x.element_size(), blocks)
    return gemm.launch(
        x,
        weight,
        None,
        cfg,
        parallel and cdiv(m, cfg.block_m) * cdiv(n, cfg.block_n) * heads <= gemm.COUNTERS,
        counters,
        blocks,
    )


def linear_swiglu(
    x: torch.Tensor,
    weight: torch.Tensor | BlockFp8,
    bias: torch.Tensor | None = None,
    counters: torch.Tensor | None = None,
) -> torch.Tensor:
    """``silu(gate) * up`` of ``x @ weight.T (+ bias)`` for a fused ``[gate; up]`` weight ``[2N, K]``, in one
    launch: ``[M, N]`` in ``x``'s dtype.

    NOTE(invariance): the bits of ``gemm.linear`` followed by ``pointwise.silu_mul``. The configuration and
    the splits are the fused weight's (``(2N, K)``), each output tile runs its gate and its up columns
    through the unfused kernel's steps, and the epilogue rounds where the unfused path stores.
    """
    if x.stride(-1) != 1:
        x = x.contiguous()
    if not isinstance(weight, BlockFp8) and weight.stride(-1) != 1:
        weight = weight.contiguous()
    m, k = x.shape
    n = weight.shape[0]
    if n % 2:
        raise ValueError(f"linear_swiglu: a [gate; up] weight has an even row count, got {n}")
    name = gemm.device_name(x.device)
    cfg, blocks = gemm.launch_config(m, n, k, x.dtype, name)
    if cfg.block_n < 2 * MIN_BLOCK_N:  # few-rows tiles too narrow to halve: the weight's own (the same bits)
        cfg = gemm.gemm_config(n, k, x.dtype, name)
    if cfg.block_n < 2 * MIN_BLOCK_N:  # too narrow to halve: the two launches (the same bits)
        gate_up = gemm.linear(x, weight, bias, counters)
        return pointwise.silu_mul(gate_up[:, : n // 2], gate_up[:, n // 2 :])
    parallel = counters is not None and gemm.splits_in_parallel(m, n, k, cfg, x.element_size(), blocks)
    return gemm.launch(x, weight, bias, cfg, parallel, counters, blocks, glu=True)
