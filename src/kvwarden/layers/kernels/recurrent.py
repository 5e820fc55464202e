"""Recurrent scans on the GPU: the gated delta rule (Qwen3-Next) and Mamba2 (Granite), token by token.

NOTE(invariance), by construction: each program owns a slice of one head's
state in float32 registers and applies the per-token update to it, token after
token, in position order. A token's update is the same instruction sequence
whether it is the 900th token of a prefill chunk or a 1-token decode step, and
the state between calls is stored and reloaded in float32 (exact). So the
state after position ``p`` - and every output - is a function of the tokens up
to ``p`` only: no chunk grid to align, and decode equals prefill bit for bit.
The state at every block boundary the call crosses is written out from inside
the loop (``CAP`` offsets), for the prefix cache.

The state's value columns are independent in both updates (gated delta: column
``j`` of ``S`` only reads ``v[j]``; Mamba2: row ``p`` of ``S`` only reads
``x[p]``), so programs split the state by those columns: a column's arithmetic
does not depend on how many columns a program holds. Reductions run over the
key / state dimension of one head, as one block of fixed shape.

Chunked (tensor-core) forms are faster for long prefills; using them would need
decode to recompute the partial chunk as the CPU path does
(:mod:`kvwarden.layers.chunked_scan`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_COLS = 16  # value columns per program


@triton.jit
def _capture(cap_ptr, cap_at_ptr, c, ncap, t, state, offs, mask, stride):
    """Copy the state out after token ``t`` if ``t`` is the next capture point; returns the next point."""
    if c < ncap:  # noqa: SIM102 - Triton cannot short-circuit a load behind `and`
        if tl.load(cap_at_ptr + c) == t:
            tl.store(cap_ptr + c * stride + offs, state, mask=mask)
            c += 1
    return c


@triton.jit(do_not_specialize=["n", "ncap"])
def _gated_delta_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, out_ptr, cap_ptr, cap_at_ptr, n, ncap,
    HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):  # fmt: skip
    h = tl.program_id(0)
    vb = tl.program_id(1)
    kk = tl.arange(0, BK)
    jj = vb * BV + tl.arange(0, BV)
    kmask = kk < DK
    jmask = jj < DV
    smask = kmask[:, None] & jmask[None, :]
    s_off = h * DK * DV + kk[:, None] * DV + jj[None, :]
    state = tl.load(state_ptr + s_off, mask=smask, other=0.0)
    c = 0
    for t in range(0, n):
        g = tl.load(g_ptr + t * HV + h)
        beta = tl.load(beta_ptr + t * HV + h)
        k = tl.load(k_ptr + (t * HV + h) * DK + kk, mask=kmask, other=0.0)
        q = tl.load(q_ptr + (t * HV + h) * DK + kk, mask=kmask, other=0.0)
        v = tl.load(v_ptr + (t * HV + h) * DV + jj, mask=jmask, other=0.0)
        state = state * tl.exp(g)
        kv_mem = tl.sum(state * k[:, None], axis=0)
        delta = (v - kv_mem) * beta
        state = state + k[:, None] * delta[None, :]
        out = tl.sum(state * q[:, None], axis=0)
        tl.store(out_ptr + (t * HV + h) * DV + jj, out, mask=jmask)
        c = _capture(cap_ptr, cap_at_ptr, c, ncap, t, state, s_off, smask, HV * DK * DV)
    tl.store(state_ptr + s_off, state, mask=smask)


def gated_delta(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    capture_at: list[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run ``n`` tokens of the gated delta rule; ``state`` is updated in place.

    Args:
        q, k: ``[n, Hv, dk]`` float32 (l2-normalised, q scaled); v: ``[n, Hv, dv]``.
        g (log decay), beta: ``[n, Hv]`` float32.
        state: ``[Hv, dk, dv]`` float32, the state before token 0.
        capture_at: ascending token indices after which to copy the state out.

    Returns:
        ``(out [n, Hv, dv], captured [len(capture_at), Hv, dk, dv])``.
    """
    n, hv, dk = q.shape
    dv = v.shape[-1]
    out = torch.empty((n, hv, dv), dtype=torch.float32, device=q.device)
    caps = torch.empty((max(len(capture_at), 1), hv, dk, dv), dtype=torch.float32, device=q.device)
    cap_at = torch.tensor(capture_at or [-1], dtype=torch.int32).to(q.device, non_blocking=True)
    if n:
        grid = (hv, triton.cdiv(dv, BLOCK_COLS))
        _gated_delta_kernel[grid](
            q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous(), state, out,
            caps, cap_at, n, len(capture_at),
            HV=hv, DK=dk, DV=dv, BK=max(16, triton.next_power_of_2(dk)), BV=BLOCK_COLS,
        )  # fmt: skip
    return out, caps[: len(capture_at)]


@triton.jit(do_not_specialize=["n", "ncap"])
def _mamba2_kernel(
    x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, state_ptr, y_ptr, cap_ptr, cap_at_ptr, n, ncap,
    H: tl.constexpr, P: tl.constexpr, N: tl.constexpr, BP: tl.constexpr, BN_: tl.constexpr,
):  # fmt: skip
    h = tl.program_id(0)
    pb = tl.program_id(1)
    pp = pb * BP + tl.arange(0, BP)
    nn = tl.arange(0, BN_)
    pmask = pp < P
    nmask = nn < N
    smask = pmask[:, None] & nmask[None, :]
    s_off = h * P * N + pp[:, None] * N + nn[None, :]
    state = tl.load(state_ptr + s_off, mask=smask, other=0.0)
    a = tl.load(a_ptr + h)
    dskip = tl.load(d_ptr + h)
    c = 0
    for t in range(0, n):
        dt = tl.load(dt_ptr + t * H + h)
        x = tl.load(x_ptr + (t * H + h) * P + pp, mask=pmask, other=0.0)
        bb = tl.load(b_ptr + (t * H + h) * N + nn, mask=nmask, other=0.0)
        cc = tl.load(c_ptr + (t * H + h) * N + nn, mask=nmask, other=0.0)
        da = tl.exp(dt * a)
        state = state * da + (dt * x)[:, None] * bb[None, :]
        y = tl.sum(state * cc[None, :], axis=1) + x * dskip
        tl.store(y_ptr + (t * H + h) * P + pp, y, mask=pmask)
        c = _capture(cap_ptr, cap_at_ptr, c, ncap, t, state, s_off, smask, H * P * N)
    tl.store(state_ptr + s_off, state, mask=smask)


def mamba2(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    d: torch.Tensor,
    state: torch.Tensor,
    capture_at: list[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run ``n`` tokens of the Mamba2 recurrence; ``state [H, P, N]`` is updated in place.

    Args:
        x: ``[n, H, P]``; dt: ``[n, H]`` (after softplus and clamp); a, d: ``[H]``;
            b, c: ``[n, H, N]`` (groups expanded to heads). All float32.

    Returns:
        ``(y [n, H, P], captured [len(capture_at), H, P, N])``.
    """
    n, h, p = x.shape
    nstate = b.shape[-1]
    y = torch.empty((n, h, p), dtype=torch.float32, device=x.device)
    caps = torch.empty((max(len(capture_at), 1), h, p, nstate), dtype=torch.float32, device=x.device)
    cap_at = torch.tensor(capture_at or [-1], dtype=torch.int32).to(x.device, non_blocking=True)
    if n:
        grid = (h, triton.cdiv(p, BLOCK_COLS))
        _mamba2_kernel[grid](
            x.contiguous(), dt.contiguous(), a.contiguous(), b.contiguous(), c.contiguous(), d.contiguous(),
            state, y, caps, cap_at, n, len(capture_at),
            H=h, P=p, N=nstate, BP=BLOCK_COLS, BN_=max(16, triton.next_power_of_2(nstate)),
        )  # fmt: skip
    return y, caps[: len(capture_at)]
