"""Rotary position embedding (NeoX "rotate half", partial rotary allowed) from a cos/sin table.

NOTE(invariance), by construction: one program per (token, head) row; element
``d`` is ``x[d] * cos[p, d] + sign * x[partner(d)] * sin[p, d]`` with ``p`` the
token's absolute position looked up in a table computed once. Each product and
the sum are rounded to the model dtype in the same order as the CPU path
(``x * cos + rotate_half(x) * sin`` on tables cast to that dtype), and nothing
depends on which other tokens share the launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["rows"])
def _rope_kernel(
    x_ptr, pos_ptr, cos_ptr, sin_ptr, y_ptr, rows, HEADS, D, ROT, BLOCK_D: tl.constexpr
):  # fmt: skip
    pid = tl.program_id(0)
    token = pid // HEADS
    d = tl.arange(0, BLOCK_D)
    in_row = d < D
    base = pid * D
    x = tl.load(x_ptr + base + d, mask=in_row, other=0.0)
    half = ROT // 2
    rotated = d < ROT
    partner = tl.where(d < half, d + half, d - half)
    other = tl.load(x_ptr + base + partner, mask=rotated, other=0.0)
    pos = tl.load(pos_ptr + token)
    c = tl.load(cos_ptr + pos * ROT + d, mask=rotated, other=1.0).to(x.dtype).to(tl.float32)
    s = tl.load(sin_ptr + pos * ROT + d, mask=rotated, other=0.0).to(x.dtype).to(tl.float32)
    sign = tl.where(d < half, -1.0, 1.0)
    a = (x.to(tl.float32) * c).to(x.dtype).to(tl.float32)
    b = ((sign * other.to(tl.float32)) * s).to(x.dtype).to(tl.float32)
    y = tl.where(rotated, (a + b).to(x.dtype), x)
    tl.store(y_ptr + base + d, y, mask=in_row)


def apply_rotary(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [tokens, heads, head_dim]``; ``cos``/``sin`` are ``[max_positions, rotary_dim]`` float32."""
    x = x.contiguous()
    tokens, heads, d = x.shape
    y = torch.empty_like(x)
    if tokens:
        rot = cos.shape[1]
        _rope_kernel[(tokens * heads,)](
            x, positions, cos, sin, y, tokens, heads, d, rot, BLOCK_D=max(16, triton.next_power_of_2(d))
        )
    return y
