"""Recurrent scans on the GPU, batched over a step's requests: gated delta rule (Qwen3-Next) and Mamba2.

One launch per layer covers every request of the step: program ``(s, h, b)``
owns columns ``b`` of head ``h`` of request ``s``'s state, found through the
step's :class:`~kvwarden.layers.recurrent_plan.RecurrentMeta` (its rows in the
batch and its working-state slot). The gates (``sigmoid``, ``softplus``,
``exp``), the q/k L2 norms and GQA's head sharing run inside the loop, so a
decode step of a layer is one kernel (plus the conv), as vLLM's fused
``fused_sigmoid_gating_delta_rule_update`` is, and a decode graph replays it.

NOTE(invariance), by construction: the program keeps its slice of the state in
float32 registers and applies the per-token update token after token, in
position order. A token's update is the same instruction sequence whether it is
the 900th token of a prefill chunk, a 1-token decode step or a draft in a verify
step: the loop bound is data (not a specialised constant), block shapes are
model dimensions, and the state between calls is stored and reloaded in float32
(exact). So the state after position ``p``, and every output, is a function of
the tokens up to ``p`` only; decode equals prefill bit for bit, and no chunk grid
needs aligning. The state at every block boundary crossed is copied out from
inside the loop (``cap_at``), for the prefix cache. Value columns are
independent in both updates (gated delta: column ``j`` of ``S`` reads only
``v[j]``; Mamba2: row ``p`` of ``S`` reads only ``x[p]``), so programs split the
state by them; reductions run over one head's key / state dimension as one block
of fixed shape. Which other requests share the launch changes only the grid.

Who runs these: the fast path, and the canonical backend by default.
``numerics.recurrent_scan="chunked"`` swaps the canonical backend's scans for
the chunked ones of :mod:`kvwarden.layers.kernels.recurrent_grid` (gated delta)
and :mod:`kvwarden.layers.kernels.ssd_grid` (Mamba2) (faster prefill, dearer
decode): a chunk's output there uses other arithmetic than this token-by-token
update, so an engine runs one or the other, never both. flash-linear-attention's
``fused_recurrent_gated_delta_rule`` is this loop; it has no state slots and no
boundary captures, and specialises its length argument.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvwarden.layers.kernels.gemm import INTERPRETED
from kvwarden.layers.recurrent_plan import RecurrentMeta

# Columns of a head's state per program and warps per program: constants (never chosen by the batch), so a
# column's reduction tree is fixed. Gated delta: 8 columns on one warp, as flash-linear-attention's
# fused_recurrent kernel (its reductions over the key dimension stay inside the warp: the loop is latency-bound).
# Under Triton's CPU interpreter (CI) a program costs Python time per token: whole heads per program there.
GDN_COLS, GDN_WARPS = (64 if INTERPRETED else 8), 1
BLOCK_COLS = 16  # Mamba2: head-dim rows per program


@triton.jit
def _gated_delta_kernel(
    x_ptr, x_stride, ba_ptr, ba_stride, neg_a_ptr, dt_bias_ptr, state_ptr, out_ptr, cap_ptr,
    row0_ptr, len_ptr, slot_ptr, cap_first_ptr, cap_count_ptr, cap_at_ptr, scale,
    HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):  # fmt: skip
    s = tl.program_id(0)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    REP: tl.constexpr = HV // HK
    kh = h // REP
    kk = tl.arange(0, BK)
    jj = vb * BV + tl.arange(0, BV)
    kmask = kk < DK
    jmask = jj < DV
    smask = kmask[:, None] & jmask[None, :]
    s_off = h * DK * DV + kk[:, None] * DV + jj[None, :]
    slot = tl.load(slot_ptr + s).to(tl.int64)
    n = tl.load(len_ptr + s)
    row = tl.load(row0_ptr + s).to(tl.int64)
    c = tl.load(cap_first_ptr + s)
    c_end = c + tl.load(cap_count_ptr + s)
    state = tl.load(state_ptr + slot * (HV * DK * DV) + s_off, mask=smask, other=0.0)
    neg_a = tl.load(neg_a_ptr + h)
    dt_bias = tl.load(dt_bias_ptr + h)
    q_col = kh * DK + kk
    k_col = HK * DK + kh * DK + kk
    v_col = 2 * HK * DK + h * DV + jj
    b_col = kh * 2 * REP + h % REP
    # Token t+1's inputs are loaded while token t computes (register double buffering): the loop is
    # latency-bound, and the loads do not depend on the state.
    live = n > 0
    # (vector masks as bounds: the interpreter cannot `&` a vector mask with a scalar one)
    q = tl.load(x_ptr + row * x_stride + q_col, mask=kk < DK * live.to(tl.int32), other=0.0)
    k = tl.load(x_ptr + row * x_stride + k_col, mask=kk < DK * live.to(tl.int32), other=0.0)
    v = tl.load(x_ptr + row * x_stride + v_col, mask=jj < DV * live.to(tl.int32), other=0.0)
    b = tl.load(ba_ptr + row * ba_stride + b_col, mask=live, other=0.0)
    a = tl.load(ba_ptr + row * ba_stride + b_col + REP, mask=live, other=0.0)
    for t in range(0, n):
        nxt = t + 1 < n
        r1 = row + 1
        q1 = tl.load(x_ptr + r1 * x_stride + q_col, mask=kk < DK * nxt.to(tl.int32), other=0.0)
        k1 = tl.load(x_ptr + r1 * x_stride + k_col, mask=kk < DK * nxt.to(tl.int32), other=0.0)
        v1 = tl.load(x_ptr + r1 * x_stride + v_col, mask=jj < DV * nxt.to(tl.int32), other=0.0)
        b1 = tl.load(ba_ptr + r1 * ba_stride + b_col, mask=nxt, other=0.0)
        a1 = tl.load(ba_ptr + r1 * ba_stride + b_col + REP, mask=nxt, other=0.0)
        qf = q.to(tl.float32)
        kf = k.to(tl.float32)
        qf = qf / tl.sqrt(tl.sum(qf * qf, axis=0) + 1e-6) * scale
        kf = kf / tl.sqrt(tl.sum(kf * kf, axis=0) + 1e-6)
        beta = 1.0 / (1.0 + tl.exp(-b.to(tl.float32)))
        # softplus as torch (beta 1, threshold 20) and kernels/pointwise.py compute it; written out here,
        # as is the capture below: the interpreter re-patches the language on every nested jit call
        ax = a.to(tl.float32) + dt_bias
        g = neg_a * tl.where(ax > 20.0, ax, tl.log(1.0 + tl.exp(tl.minimum(ax, 20.0))))
        state = state * tl.exp(g)
        kv_mem = tl.sum(state * kf[:, None], axis=0)
        delta = (v.to(tl.float32) - kv_mem) * beta
        state = state + kf[:, None] * delta[None, :]
        out = tl.sum(state * qf[:, None], axis=0)
        tl.store(out_ptr + (row * HV + h) * DV + jj, out.to(out_ptr.dtype.element_ty), mask=jmask)
        if c < c_end:  # noqa: SIM102 - Triton cannot short-circuit a load behind `and`
            if tl.load(cap_at_ptr + c) == t:  # the state after token t is the next boundary's
                tl.store(cap_ptr + c.to(tl.int64) * (HV * DK * DV) + s_off, state, mask=smask)
                c += 1
        q, k, v, b, a, row = q1, k1, v1, b1, a1, r1
    tl.store(state_ptr + slot * (HV * DK * DV) + s_off, state, mask=smask)


def gated_delta(
    x: torch.Tensor,
    ba: torch.Tensor,
    neg_a: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    meta: RecurrentMeta,
    num_key_heads: int,
    *,
    cols: int = GDN_COLS,
    warps: int = GDN_WARPS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule for every request of a step; working states are updated in place.

    Args:
        x: ``[rows, conv_dim]`` the conv's output, ``q | k | v`` (key heads of ``dk``, value heads of ``dv``).
        ba: ``[rows, Hk * 2 * rep]`` the raw ``b`` (beta's logit) then ``a`` (the decay's) of each key head.
        neg_a: ``-exp(A_log)``, dt_bias: ``[Hv]`` float32.
        state: ``[slots, Hv, dk, dv]`` float32, the state pool's tensor for this layer.
        meta: the step's requests.
        cols, warps: the launch shape (benchmarks compare others; the engine always runs the defaults).

    Returns:
        ``(out [rows, Hv, dv]`` in ``x``'s dtype, ``captured [meta.num_capture_rows, Hv, dk, dv])``.
    """
    _, hv, dk, dv = state.shape
    rows = x.shape[0]
    out = torch.empty((rows, hv, dv), dtype=x.dtype, device=x.device)
    caps = torch.empty((max(meta.num_capture_rows, 1), hv, dk, dv), dtype=torch.float32, device=x.device)
    if meta.num_seqs:
        cols = min(cols, max(8, triton.next_power_of_2(dv)))
        grid = (meta.num_seqs, hv, triton.cdiv(dv, cols))
        _gated_delta_kernel[grid](
            x, x.stride(0), ba, ba.stride(0), neg_a, dt_bias, state, out, caps,
            meta.seq_row0, meta.seq_len, meta.seq_slot, meta.cap_first, meta.cap_count, meta.cap_at, dk**-0.5,
            HK=num_key_heads, HV=hv, DK=dk, DV=dv, BK=max(16, triton.next_power_of_2(dk)), BV=cols, num_warps=warps,
        )  # fmt: skip
    return out, caps[: meta.num_capture_rows]


@triton.jit
def _mamba2_kernel(
    x_ptr, x_stride, dt_ptr, dt_stride, dt_bias_ptr, a_ptr, d_ptr, state_ptr, y_ptr, cap_ptr,
    row0_ptr, len_ptr, slot_ptr, cap_first_ptr, cap_count_ptr, cap_at_ptr, dt_lo, dt_hi,
    H: tl.constexpr, G: tl.constexpr, P: tl.constexpr, N: tl.constexpr, BP: tl.constexpr, BN_: tl.constexpr,
    CLAMP: tl.constexpr,
):  # fmt: skip
    s = tl.program_id(0)
    h = tl.program_id(1)
    pb = tl.program_id(2)
    pp = pb * BP + tl.arange(0, BP)
    nn = tl.arange(0, BN_)
    pmask = pp < P
    nmask = nn < N
    smask = pmask[:, None] & nmask[None, :]
    s_off = h * P * N + pp[:, None] * N + nn[None, :]
    slot = tl.load(slot_ptr + s).to(tl.int64)
    n = tl.load(len_ptr + s)
    row = tl.load(row0_ptr + s).to(tl.int64)
    c = tl.load(cap_first_ptr + s)
    c_end = c + tl.load(cap_count_ptr + s)
    state = tl.load(state_ptr + slot * (H * P * N) + s_off, mask=smask, other=0.0)
    a = tl.load(a_ptr + h)
    dskip = tl.load(d_ptr + h)
    dt_bias = tl.load(dt_bias_ptr + h)
    grp = h // (H // G)
    x_col = h * P + pp
    b_col = H * P + grp * N + nn
    c_col = H * P + G * N + grp * N + nn
    live = n > 0
    x = tl.load(x_ptr + row * x_stride + x_col, mask=pp < P * live.to(tl.int32), other=0.0)
    bb = tl.load(x_ptr + row * x_stride + b_col, mask=nn < N * live.to(tl.int32), other=0.0)
    cc = tl.load(x_ptr + row * x_stride + c_col, mask=nn < N * live.to(tl.int32), other=0.0)
    dt = tl.load(dt_ptr + row * dt_stride + h, mask=live, other=0.0)
    for t in range(0, n):
        nxt = t + 1 < n
        r1 = row + 1
        x1 = tl.load(x_ptr + r1 * x_stride + x_col, mask=pp < P * nxt.to(tl.int32), other=0.0)
        bb1 = tl.load(x_ptr + r1 * x_stride + b_col, mask=nn < N * nxt.to(tl.int32), other=0.0)
        cc1 = tl.load(x_ptr + r1 * x_stride + c_col, mask=nn < N * nxt.to(tl.int32), other=0.0)
        dt1 = tl.load(dt_ptr + r1 * dt_stride + h, mask=nxt, other=0.0)
        dx = dt.to(tl.float32) + dt_bias
        step = tl.where(dx > 20.0, dx, tl.log(1.0 + tl.exp(tl.minimum(dx, 20.0))))
        if CLAMP:
            step = tl.minimum(tl.maximum(step, dt_lo), dt_hi)
        xf = x.to(tl.float32)
        da = tl.exp(step * a)
        state = state * da + (step * xf)[:, None] * bb.to(tl.float32)[None, :]
        y = tl.sum(state * cc.to(tl.float32)[None, :], axis=1) + xf * dskip
        tl.store(y_ptr + (row * H + h) * P + pp, y, mask=pmask)
        if c < c_end:  # noqa: SIM102
            if tl.load(cap_at_ptr + c) == t:
                tl.store(cap_ptr + c.to(tl.int64) * (H * P * N) + s_off, state, mask=smask)
                c += 1
        x, bb, cc, dt, row = x1, bb1, cc1, dt1, r1
    tl.store(state_ptr + slot * (H * P * N) + s_off, state, mask=smask)


def mamba2(
    x: torch.Tensor,
    dt: torch.Tensor,
    dt_bias: torch.Tensor,
    a: torch.Tensor,
    d: torch.Tensor,
    state: torch.Tensor,
    meta: RecurrentMeta,
    num_groups: int,
    dt_limit: tuple[float, float],
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Mamba2 recurrence for every request of a step; working states are updated in place.

    Args:
        x: ``[rows, conv_dim]`` the conv's output, ``x | B | C`` (``B``, ``C`` per group).
        dt: ``[rows, >= H]`` raw time steps (softplus with ``dt_bias`` and the clamp happen here).
        a (``-exp(A_log)``), d, dt_bias: ``[H]`` float32.
        state: ``[slots, H, P, N]`` float32.

    Returns:
        ``(y [rows, H, P]`` float32, ``captured [meta.num_capture_rows, H, P, N])``.
    """
    _, h, p, nstate = state.shape
    rows = x.shape[0]
    y = torch.empty((rows, h, p), dtype=torch.float32, device=x.device)
    caps = torch.empty((max(meta.num_capture_rows, 1), h, p, nstate), dtype=torch.float32, device=x.device)
    lo, hi = dt_limit
    if meta.num_seqs:
        grid = (meta.num_seqs, h, triton.cdiv(p, BLOCK_COLS))
        _mamba2_kernel[grid](
            x, x.stride(0), dt, dt.stride(0), dt_bias, a, d, state, y, caps,
            meta.seq_row0, meta.seq_len, meta.seq_slot, meta.cap_first, meta.cap_count, meta.cap_at,
            float(lo), float(hi) if hi != float("inf") else 3.0e38,
            H=h, G=num_groups, P=p, N=nstate, BP=BLOCK_COLS, BN_=max(16, triton.next_power_of_2(nstate)),
            CLAMP=lo > 0.0 or hi != float("inf"),
        )  # fmt: skip
    return y, caps[: meta.num_capture_rows]
