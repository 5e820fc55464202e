"""Element-wise kernels: SwiGLU (``silu(gate) * up``), silu, sigmoid, softplus, exp.

NOTE(invariance), by construction: element ``i`` of the output is computed
from element ``i`` of the inputs by one straight-line instruction sequence,
the same for every element of every launch (no vector-width or tail variants,
no reductions). Inputs are widened to float32, the result rounded once to the
output dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024
OPS = ("silu", "sigmoid", "softplus", "exp")


@triton.jit
def _apply(x, OP: tl.constexpr):
    if OP == 0:  # silu
        y = x / (1.0 + tl.exp(-x))
    elif OP == 1:  # sigmoid
        y = 1.0 / (1.0 + tl.exp(-x))
    elif OP == 2:  # softplus with torch's threshold of 20 (beta 1)
        y = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
    else:  # exp
        y = tl.exp(x)
    return y


@triton.jit(do_not_specialize=["n"])
def _unary_kernel(x_ptr, y_ptr, n, OP: tl.constexpr, BLOCK_: tl.constexpr):
    offs = tl.program_id(0) * BLOCK_ + tl.arange(0, BLOCK_)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, _apply(x, OP).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["n", "cols", "g_row", "u_row"])
def _silu_mul_kernel(g_ptr, u_ptr, y_ptr, n, cols, g_row, u_row, BLOCK_: tl.constexpr):
    """Element ``i`` of the ``[n / cols, cols]`` output from row ``i // cols`` of ``gate`` and ``up``, which may
    be strided views (the two halves of a fused gate/up projection: no copies)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK_ + tl.arange(0, BLOCK_)
    mask = offs < n
    row, col = offs // cols, offs % cols
    g = tl.load(g_ptr + row * g_row + col, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * u_row + col, mask=mask, other=0.0)
    # silu rounded to the model dtype first, then the product rounded again: as the CPU path computes it
    act = (g / (1.0 + tl.exp(-g))).to(u.dtype)
    tl.store(y_ptr + offs, (act.to(tl.float32) * u.to(tl.float32)).to(y_ptr.dtype.element_ty), mask=mask)


def unary(op: str, x: torch.Tensor) -> torch.Tensor:
    """``op(x)`` element-wise (``op`` in :data:`OPS`), in ``x``'s dtype."""
    x = x.contiguous()
    y = torch.empty_like(x)
    n = x.numel()
    if n:
        _unary_kernel[(triton.cdiv(n, BLOCK),)](x, y, n, OP=OPS.index(op), BLOCK_=BLOCK)
    return y


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` (SwiGLU), in ``up``'s dtype; ``[rows, cols]`` views with strided rows are read in
    place (the two halves of a fused gate/up projection)."""
    shape = up.shape
    if not (gate.dim() == up.dim() == 2 and gate.stride(1) == up.stride(1) == 1):
        gate, up = gate.contiguous().view(-1, max(shape[-1], 1)), up.contiguous().view(-1, max(shape[-1], 1))
    y = torch.empty(shape, dtype=up.dtype, device=up.device)
    n = up.numel()
    if n:
        cols = up.shape[1]
        _silu_mul_kernel[(triton.cdiv(n, BLOCK),)](gate, up, y, n, cols, gate.stride(0), up.stride(0), BLOCK_=BLOCK)
    return y
