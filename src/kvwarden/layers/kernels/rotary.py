"""Rotary position embedding (NeoX "rotate half", partial rotary allowed) from a cos/sin table.

NOTE(invariance), by construction: one program per (token, head) row; element
``d`` is ``x[d] * cos[p, d] + sign * x[partner(d)] * sin[p, d]`` with ``p`` the
token's absolute position looked up in a table computed once. Each product and
the sum are rounded to the model dtype in the same order as the CPU path
(``x * cos + rotate_half(x) * sin`` on tables cast to that dtype), and nothing
depends on which other tokens share the launch. ``rope_write_kv`` runs the
same row function (``_rotate``) and writes K and V straight into their
cache slots, so fusing the write changes launches, not bits.

Qwen3's per-head q/k RMSNorm can ride in the same launch (``qk_norm``): each
(token, head) program reduces its own row (one block of ``next_power_of_2(D)``
lanes, one warp, one ``tl.sum``: an order fixed by the head size and this
kernel, whatever the launch holds), then normalises the element and its rotary
partner with the row kernel's element-wise formula and rounding points before
the rotation. Every attention step of a model runs this one kernel (a traced
step too), so its bits are the model's bits. They equal the separate row
kernel's then rotary's at head size 128 on the H200, but not always: Triton may
lay this program's row out differently and sum it in another order (seen at
head size 16 in float32), so the two are equal within rounding, not by
construction.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _partner(ROT, BLOCK_D: tl.constexpr):
    """Each lane's element and its rotate-half partner (lanes past ``ROT`` are not rotated)."""
    d = tl.arange(0, BLOCK_D)
    half = ROT // 2
    return d, tl.where(d < half, d + half, d - half)


@triton.jit
def _rotate_row(row_ptr, pos, cos_ptr, sin_ptr, D, ROT, BLOCK_D: tl.constexpr):
    """One (token, head) row rotated at absolute position ``pos``."""
    d, partner = _partner(ROT, BLOCK_D)
    x = tl.load(row_ptr + d, mask=d < D, other=0.0)
    other = tl.load(row_ptr + partner, mask=d < ROT, other=0.0)
    return _rotate(x, other, pos, cos_ptr, sin_ptr, ROT, BLOCK_D)


@triton.jit
def _normed_row(row_ptr, w_ptr, eps, D, ROT, W_F32: tl.constexpr, BLOCK_D: tl.constexpr):
    """One (token, head) row RMS-normalised, element and partner, in the row's dtype: the row kernel's
    element-wise formula and rounding points; the row's sum in this program's own fixed order (module note)."""
    d, partner = _partner(ROT, BLOCK_D)
    x = tl.load(row_ptr + d, mask=d < D, other=0.0)
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / D + eps)
    other = tl.load(row_ptr + partner, mask=d < ROT, other=0.0)
    w = tl.load(w_ptr + d, mask=d < D, other=0.0).to(tl.float32)
    w_other = tl.load(w_ptr + partner, mask=d < ROT, other=0.0).to(tl.float32)
    if W_F32:  # Qwen3-Next: scale in float32, round once
        y = w * (xf * inv)
        y_other = w_other * (other.to(tl.float32) * inv)
    else:  # Qwen3: round the normalised row to the input dtype, then scale by the weight
        y = w * (xf * inv).to(x.dtype).to(tl.float32)
        y_other = w_other * (other.to(tl.float32) * inv).to(x.dtype).to(tl.float32)
    return y.to(x.dtype), y_other.to(x.dtype)


@triton.jit
def _rotate(x, other, pos, cos_ptr, sin_ptr, ROT, BLOCK_D: tl.constexpr):
    """A row's elements ``x`` and their partners ``other`` rotated at absolute position ``pos`` (the only
    rotary arithmetic there is)."""
    d = tl.arange(0, BLOCK_D)
    half = ROT // 2
    rotated = d < ROT
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


@triton.jit
def _head_row(row_ptr, w_ptr, pos, cos_ptr, sin_ptr, eps, D, ROT, NORM: tl.constexpr, W_F32: tl.constexpr,
              BLOCK_D: tl.constexpr):  # fmt: skip
    if NORM:
        x, other = _normed_row(row_ptr, w_ptr, eps, D, ROT, W_F32, BLOCK_D)
        return _rotate(x, other, pos, cos_ptr, sin_ptr, ROT, BLOCK_D)
    return _rotate_row(row_ptr, pos, cos_ptr, sin_ptr, D, ROT, BLOCK_D)


@triton.jit(do_not_specialize=["rows"])
def _rope_write_kernel(
    q_ptr, k_ptr, v_ptr, pos_ptr, cos_ptr, sin_ptr, slot_ptr, qo_ptr, kc_ptr, vc_ptr, qw_ptr, kw_ptr, eps, rows,
    sq_tok, sq_head, sk_tok, sk_head, sv_tok, sv_head, HQ, HKV, D, ROT,
    NORM: tl.constexpr, W_F32: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """One program per (token, head): q heads (RMS-normalised first with ``NORM``) rotated into ``qo``; K heads
    likewise and V heads copied, straight into their cache slot (no rotated K in between)."""
    token = tl.program_id(0)
    head = tl.program_id(1)
    pos = tl.load(pos_ptr + token)
    d = tl.arange(0, BLOCK_D)
    in_row = d < D
    tok = token.to(tl.int64)
    if head < HQ:
        row = q_ptr + tok * sq_tok + head * sq_head
        y = _head_row(row, qw_ptr, pos, cos_ptr, sin_ptr, eps, D, ROT, NORM, W_F32, BLOCK_D)
        tl.store(qo_ptr + (tok * HQ + head) * D + d, y, mask=in_row)
    else:
        h = head - HQ
        slot = tl.load(slot_ptr + token).to(tl.int64)
        row = k_ptr + tok * sk_tok + h * sk_head
        y = _head_row(row, kw_ptr, pos, cos_ptr, sin_ptr, eps, D, ROT, NORM, W_F32, BLOCK_D)
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
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> torch.Tensor:
    """Rotate ``q`` (returned) and ``k``, and write rotated K and V at ``slots`` of the caches, in one launch.

    ``q [tokens, Hq, D]``, ``k``/``v [tokens, Hkv, D]`` may be strided views (of a fused projection);
    the bits are those of :func:`apply_rotary` then a slot write (the same ``_rotate``). ``qk_norm``:
    ``(q_weight, k_weight, eps)`` of a per-head RMSNorm applied first, each row reduced in one fixed order
    (module docstring; :func:`fusable_norm` says which norms fit).
    """
    tokens, hq, d = q.shape
    hkv = k.shape[1]
    assert q.stride(2) == k.stride(2) == v.stride(2) == 1, "head rows must be contiguous"
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    assert qk_norm is None or fusable_norm(q, *qk_norm[:2]), "a norm the kernel cannot fuse (see fusable_norm)"
    q_out = torch.empty((tokens, hq, d), dtype=q.dtype, device=q.device)
    if tokens:
        q_w, k_w, eps = qk_norm if qk_norm is not None else (q, k, 0.0)
        w_f32 = q_w.dtype == torch.float32 and q.dtype != torch.float32
        # NOTE(invariance): one warp per (token, head) row, whatever the launch: a row's sum has one order
        _rope_write_kernel[(tokens, hq + hkv)](
            q, k, v, positions, cos, sin, slots, q_out, k_cache, v_cache, q_w, k_w, eps, tokens,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            hq, hkv, d, cos.shape[1], NORM=qk_norm is not None, W_F32=w_f32,
            BLOCK_D=max(16, triton.next_power_of_2(d)), num_warps=1,
        )  # fmt: skip
    return q_out


def fusable_norm(x: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor) -> bool:
    """Whether a per-head RMSNorm of ``x`` by these weights fits in :func:`rope_write_kv`: both weights of one
    dtype, the norm's output in the rows' own dtype (``rows.rms_norm``: a float32 weight scales in float32 and
    keeps it; another promotes), and a head short enough for one warp's block."""
    w_f32 = q_weight.dtype == torch.float32 and x.dtype != torch.float32
    out = x.dtype if w_f32 else torch.promote_types(x.dtype, q_weight.dtype)
    return q_weight.dtype == k_weight.dtype and out == x.dtype and triton.next_power_of_2(x.shape[-1]) < 1024


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
