"""Rotary position embedding (NeoX "rotate half", partial rotary allowed) from a cos/sin table.

NOTE(invariance), by construction: one program per (token, head) row; element
``d`` is ``x[d] * cos[p, d] + sign * x[partner(d)] * sin[p, d]`` with ``p`` the
token's absolute position looked up in a table computed once. Each product and
the sum are rounded to the model dtype in the same order as the CPU path
(``x * cos + rotate_half(x) * sin`` on tables cast to that dtype), and nothing
depends on which other tokens share the launch. ``rope_write_kv`` runs the
same row function (``_rotate_row``) and writes K and V straight into their
cache slots, so fusing the write changes launches, not bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_row(row_ptr, pos, cos_ptr, sin_ptr, D, ROT, BLOCK_D: tl.constexpr):
    """One (token, head) row rotated at absolute position ``pos`` (the only rotary arithmetic there is)."""
    d = tl.arange(0, BLOCK_D)
    in_row = d < D
    x = tl.load(row_ptr + d, mask=in_row, other=0.0)
    half = ROT // 2
    rotated = d < ROT
    partner = tl.where(d < half, d + half, d - half)
    other = tl.load(row_ptr + partner, mask=rotated, other=0.0)
    c = tl.load(cos_ptr + pos * ROT + d, mask=rotated, other=1.0).to(x.dtype).to(tl.float32)
    s = tl.load(sin_ptr + pos * ROT + d, mask=rotated, other=0.0).to(x.dtype).to(tl.float32)
    sign = tl.where(d < half, -1.0, 1.0)
    a = (x.to(tl.float32) * c).to(x.dtype).to(tl.float32)
    b = ((sign * other.to(tl.float32)) * s).to(x.dtype).to(tl.float32)
    return tl.where(rotated, (a + b).to(x.dtype), x)


@triton.jit(do_not_specialize=["rows"])
def _rope_kernel(
    x_ptr, pos_ptr, cos_ptr, sin_ptr, y_ptr, rows, HEADS, D, ROT, BLOCK_D: tl.constexpr
):  # fmt: skip
    pid = tl.program_id(0)
    pos = tl.load(pos_ptr + pid // HEADS)
    d = tl.arange(0, BLOCK_D)
    y = _rotate_row(x_ptr + pid * D, pos, cos_ptr, sin_ptr, D, ROT, BLOCK_D)
    tl.store(y_ptr + pid * D + d, y, mask=d < D)


@triton.jit(do_not_specialize=["rows"])
def _rope_write_kernel(
    q_ptr, k_ptr, v_ptr, pos_ptr, cos_ptr, sin_ptr, slot_ptr, qo_ptr, kc_ptr, vc_ptr, rows,
    sq_tok, sq_head, sk_tok, sk_head, sv_tok, sv_head, HQ, HKV, D, ROT, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """One program per (token, head): q heads rotated into ``qo``; K heads rotated and V heads copied
    straight into their cache slot (no rotated K in between)."""
    token = tl.program_id(0)
    head = tl.program_id(1)
    pos = tl.load(pos_ptr + token)
    d = tl.arange(0, BLOCK_D)
    in_row = d < D
    tok = token.to(tl.int64)
    if head < HQ:
        y = _rotate_row(q_ptr + tok * sq_tok + head * sq_head, pos, cos_ptr, sin_ptr, D, ROT, BLOCK_D)
        tl.store(qo_ptr + (tok * HQ + head) * D + d, y, mask=in_row)
    else:
        h = head - HQ
        slot = tl.load(slot_ptr + token).to(tl.int64)
        y = _rotate_row(k_ptr + tok * sk_tok + h * sk_head, pos, cos_ptr, sin_ptr, D, ROT, BLOCK_D)
        tl.store(kc_ptr + (slot * HKV + h) * D + d, y, mask=in_row)
        v = tl.load(v_ptr + tok * sv_tok + h * sv_head + d, mask=in_row, other=0.0)
        tl.store(vc_ptr + (slot * HKV + h) * D + d, v, mask=in_row)


def rope_write_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """Rotate ``q`` (returned) and ``k``, and write rotated K and V at ``slots`` of the caches, in one launch.

    ``q [tokens, Hq, D]``, ``k``/``v [tokens, Hkv, D]`` may be strided views (of a fused projection);
    the bits are those of :func:`apply_rotary` then a slot write (the same ``_rotate_row``).
    """
    tokens, hq, d = q.shape
    hkv = k.shape[1]
    assert q.stride(2) == k.stride(2) == v.stride(2) == 1, "head rows must be contiguous"
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    q_out = torch.empty((tokens, hq, d), dtype=q.dtype, device=q.device)
    if tokens:
        _rope_write_kernel[(tokens, hq + hkv)](
            q, k, v, positions, cos, sin, slots, q_out, k_cache, v_cache, tokens,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            hq, hkv, d, cos.shape[1], BLOCK_D=max(16, triton.next_power_of_2(d)),
        )  # fmt: skip
    return q_out


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
