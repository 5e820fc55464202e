"""The gated delta rule as a chunked scan on tensor cores, its chunk grid fixed to absolute positions.

The canonical GPU backend's Qwen3-Next scan with ``numerics.recurrent_scan="chunked"``
(the default is the token-by-token loop of :mod:`kvwarden.layers.kernels.recurrent`:
on the H200 this scan halves the prefill's scan time and cuts the 16K cold TTFT of
the 0.6b hybrid from 0.375 s to 0.250 s, but its decode step, which recomputes
the grid chunk, costs 2.6x the loop's, 16 % fewer tokens/s at batch 64;
docs/performance.md has the table). It follows the rule of the CPU
path (:func:`kvwarden.layers.chunked_scan.canonical_scan`): positions are cut
into chunks of ``C`` at multiples of ``C``, and a request's working state is the
recurrent state at its last grid point plus the raw inputs of the positions
since (the *pending* rows, a ring of ``2C`` rows per request in the state pool).
Every call recomputes each grid chunk it touches from that state with one
fixed-shape chunk computation (the UT transform: ``T = (I + A)^-1`` for the
chunk's strictly lower ``A = beta k k^T * decay``, then ``W = T (beta k e^g)``,
``U = T (beta v)``, ``V' = U - W S``, ``O = (q e^g) S + (q k^T * decay) V'``,
and at a full chunk ``S' = S e^{g_last} + (k e^{g_last - g})^T V'``), so a
chunk costs a handful of ``C``-row tensor-core dots instead of ``C`` dependent
token updates. Two launches per layer, as flash-linear-attention splits its
chunk kernels: phase 1 computes, for every grid chunk of every request at once,
everything that does not need the state (``W``, ``U``, the masked ``P``, the
decayed ``q`` and ``k``) into a scratch buffer; phase 2 walks each request's
chunks in order with four dots per chunk against the state. Decode (one row)
recomputes its grid chunk - the same code, the same shapes.

NOTE(invariance), by construction:

* A row's output depends only on the state at its grid point and the rows of
  its chunk up to itself: the decay mask and ``A`` are strictly or weakly lower
  triangular (``tl.where``: exact zeros above the diagonal), ``T`` is a product
  of lower-triangular matrices (``(I - A)(I + A^2)(I + A^4)...``, whose upper
  parts stay exact zeros), the in-chunk cumulative decay is a prefix scan (an
  element never reads a later one), and every dot's entry ``(i, j)`` reads row
  ``i`` of one side and column ``j`` of the other, through a product that is an
  exact zero wherever the mask put one. Rows past a position are real tokens in
  a prefill and zero padding in a decode step: they meet its row only as
  ``0 * finite``. So decode equals prefill bit for bit, for any split of a
  prompt, and the state at a grid point is the same however it was reached.
* Shapes never follow the batch: ``C``, the key block (one head's ``dk``), the
  value-column block (a constant; value columns are independent in the delta
  rule) and the warps are constants; the loop over a request's chunks has a
  data bound; which other requests share the launch changes only the grid.
* The pending rows are stored in float32, copies of the raw (model-dtype)
  inputs, so a row read back from the ring is the value the step itself read;
  the scratch between the phases is float32 too (stored and reloaded exactly).
* The state at a block boundary (a grid point: ``block_size % C == 0``, checked
  at start-up) is copied out from inside the loop for the prefix cache. A
  verify step's "state after token t" is the state at ``t``'s grid point (its
  pending rows are its tokens, addressed by position), which is what the return
  to the last accepted token restores.

Precision: every dot is float32 in, float32 accumulated; ``tf32x3`` (three TF32
tensor-core products, about float32's accuracy) on the GPU. The state and the
gates stay float32, as in transformers' reference scan.

Why not flash-linear-attention's ``chunk_gated_delta_rule``: its grid starts at
each call's first token and its decode kernel is a different (token-by-token)
computation, so a prompt cut differently, or a decode step after a prefill,
changes the bits (measured in ``kvwarden bench fla_compare``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvwarden.layers.kernels.gemm import INTERPRETED
from kvwarden.layers.kernels.ring import read_column, read_rows, write_ring
from kvwarden.layers.recurrent_plan import RecurrentMeta

# Value columns per program: a constant (never chosen by the batch). Under the interpreter (CI) a program costs
# Python time: whole heads there.
GRID_COLS, GRID_WARPS = (128 if INTERPRETED else 32), 4
DOT_PRECISION = "tf32x3"  # float32 operands on tensor cores, about float32's accuracy
CHUNKS = (16, 32, 64)  # tl.dot needs 16 rows; a power of two for the inverse's doubling (engine/memory.py)
_NO_CAPTURE = tl.constexpr(1 << 30)  # a capture index past any step


@triton.jit
def _unit_lower_inverse(a, ii, jj, LOG2C: tl.constexpr, PREC: tl.constexpr):
    """``(I + a)^-1`` for strictly lower ``a`` (nilpotent): ``(I - a)(I + a^2)(I + a^4)...``."""
    eye = tl.where(ii == jj, 1.0, 0.0)
    power = -a
    inv = eye + power
    for _ in tl.static_range(LOG2C - 1):
        power = tl.dot(power, power, input_precision=PREC)
        inv = tl.dot(inv, eye + power, input_precision=PREC)
    return inv


@triton.jit
def _gdn_chunk_kernel(
    x_ptr, x_stride, ba_ptr, ba_stride, neg_a_ptr, dt_bias_ptr, ring_ptr, scratch_ptr,
    len_ptr, row0_ptr, start_ptr, slot_ptr, chunk0_ptr, scale,
    HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BVF: tl.constexpr,
    C: tl.constexpr, LOG2C: tl.constexpr, XW: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """Phase 1, every grid chunk of every request at once: what does not need the state at the chunk's start.

    Program ``(s, j, h)`` writes chunk ``j`` of request ``s``, head ``h`` to its scratch row: ``W`` and ``Q e^g``
    and ``K e^{g_last - g}`` ``[C, dk]``, ``U`` ``[C, dv]``, the masked ``P = q k^T * decay`` ``[C, C]``, ``g_last``.
    """
    s = tl.program_id(0)
    j = tl.program_id(1)
    h = tl.program_id(2)
    n = tl.load(len_ptr + s)
    start = tl.load(start_ptr + s)
    touched = tl.where(n > 0, start % C + n, 0)  # rows from the chunk grid point (none: a padding request)
    if j * C < touched:  # a chunk the request's rows touch
        REP: tl.constexpr = HV // HK
        F: tl.constexpr = XW + 2 * HV  # a ring row: the conv's output q | k | v, then b | a
        ROW: tl.constexpr = 3 * C * BK + C * BVF + C * C + 1  # a (chunk, head)'s scratch floats
        kh = h // REP
        kk = tl.arange(0, BK)
        vv = tl.arange(0, BVF)
        rr = tl.arange(0, C)
        kmask = kk < DK
        vmask = vv < DV
        lower = rr[None, :] < rr[:, None]
        causal = rr[None, :] <= rr[:, None]
        row0 = tl.load(row0_ptr + s).to(tl.int64)
        ring = ring_ptr + tl.load(slot_ptr + s).to(tl.int64) * (2 * C * F)
        neg_a = tl.load(neg_a_ptr + h)
        dt_bias = tl.load(dt_bias_ptr + h)
        q_col = kh * DK + kk
        k_col = HK * DK + kh * DK + kk
        v_col = 2 * HK * DK + h * DV + vv
        b_col = kh * 2 * REP + h % REP
        end = start + n
        pos = start - start % C + j * C + rr
        in_ring = pos < start  # earlier steps' rows of this chunk
        in_x = (pos >= start) & (pos < end)
        xrow = row0 + (pos - start).to(tl.int64)
        rrow = (pos % (2 * C)).to(tl.int64) * F
        q = read_rows(ring, rrow, x_ptr, x_stride, xrow, q_col, kmask, in_ring, in_x)
        k = read_rows(ring, rrow, x_ptr, x_stride, xrow, k_col, kmask, in_ring, in_x)
        v = read_rows(ring, rrow, x_ptr, x_stride, xrow, v_col, vmask, in_ring, in_x)
        b = read_column(ring + XW, rrow, ba_ptr, ba_stride, xrow, b_col, in_ring, in_x)
        a = read_column(ring + XW, rrow, ba_ptr, ba_stride, xrow, b_col + REP, in_ring, in_x)
        # the per-token gates and norms, as the token-by-token kernel computes them
        q = q / tl.sqrt(tl.sum(q * q, axis=1) + 1e-6)[:, None] * scale
        k = k / tl.sqrt(tl.sum(k * k, axis=1) + 1e-6)[:, None]
        beta = 1.0 / (1.0 + tl.exp(-b))
        ax = a + dt_bias
        g = neg_a * tl.where(ax > 20.0, ax, tl.log(1.0 + tl.exp(tl.minimum(ax, 20.0))))
        g = tl.where(in_ring | in_x, g, 0.0)
        gc = tl.cumsum(g, axis=0)  # a prefix scan: row i reads rows <= i only
        decay = tl.exp(tl.where(causal, gc[:, None] - gc[None, :], float("-inf")))
        kb = k * beta[:, None]
        a_low = tl.where(lower, tl.dot(kb, tl.trans(k), input_precision=PREC) * decay, 0.0)
        t_inv = _unit_lower_inverse(a_low, rr[:, None], rr[None, :], LOG2C, PREC)
        eg = tl.exp(gc)
        w = tl.dot(t_inv, kb * eg[:, None], input_precision=PREC)
        u = tl.dot(t_inv, v * beta[:, None], input_precision=PREC)
        p = tl.where(causal, tl.dot(q, tl.trans(k), input_precision=PREC) * decay, 0.0)
        g_last = tl.sum(tl.where(rr == C - 1, gc, 0.0), axis=0)
        out = scratch_ptr + ((tl.load(chunk0_ptr + s) + j).to(tl.int64) * HV + h) * ROW
        mat = rr[:, None] * BK + kk[None, :]
        tl.store(out + mat, w)
        tl.store(out + C * BK + mat, q * eg[:, None])
        tl.store(out + 2 * C * BK + mat, k * tl.exp(g_last - gc)[:, None])
        tl.store(out + 3 * C * BK + rr[:, None] * BVF + vv[None, :], u)
        tl.store(out + 3 * C * BK + C * BVF + rr[:, None] * C + rr[None, :], p)
        tl.store(out + ROW - 1, g_last)


@triton.jit
def _gdn_state_kernel(
    scratch_ptr, state_ptr, out_ptr, cap_ptr,
    row0_ptr, len_ptr, start_ptr, slot_ptr, chunk0_ptr, cap_first_ptr, cap_count_ptr, cap_at_ptr,
    HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BVF: tl.constexpr,
    C: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """Phase 2, each request's chunks in order: ``V' = U - W S``, ``O = (Q e^g) S + P V'``, and at a full
    chunk ``S <- S e^{g_last} + (K e^{g_last - g})^T V'``; program ``(s, h, vb)`` owns value columns ``vb``."""
    s = tl.program_id(0)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    ROW: tl.constexpr = 3 * C * BK + C * BVF + C * C + 1
    kk = tl.arange(0, BK)
    jj = vb * BV + tl.arange(0, BV)
    rr = tl.arange(0, C)
    kmask = kk < DK
    jmask = jj < DV
    smask = kmask[:, None] & jmask[None, :]
    s_off = h * DK * DV + kk[:, None] * DV + jj[None, :]
    mat = rr[:, None] * BK + kk[None, :]
    slot = tl.load(slot_ptr + s).to(tl.int64)
    n = tl.load(len_ptr + s)
    start = tl.load(start_ptr + s)
    row0 = tl.load(row0_ptr + s).to(tl.int64)
    chunk0 = tl.load(chunk0_ptr + s)
    c = tl.load(cap_first_ptr + s)
    c_end = c + tl.load(cap_count_ptr + s)
    state = tl.load(state_ptr + slot * (HV * DK * DV) + s_off, mask=smask, other=0.0)
    end = start + n
    base = tl.where(n > 0, start - start % C, end)  # a padding request (no rows) runs no chunk
    u_off = 3 * C * BK + rr[:, None] * BVF + jj[None, :]
    p_off = 3 * C * BK + C * BVF + rr[:, None] * C + rr[None, :]
    # The next chunk's operands load while this chunk's dots run (they do not depend on the state): the
    # loop is latency-bound. (Vector masks as bounds: the interpreter cannot `&` a vector with a scalar.)
    row = scratch_ptr + (chunk0.to(tl.int64) * HV + h) * ROW
    live = (n > 0).to(tl.int32)
    w = tl.load(row + mat, mask=rr[:, None] < C * live, other=0.0)
    qe = tl.load(row + C * BK + mat, mask=rr[:, None] < C * live, other=0.0)
    u = tl.load(row + u_off, mask=rr[:, None] < C * live, other=0.0)
    p = tl.load(row + p_off, mask=rr[:, None] < C * live, other=0.0)
    for cb in range(base, end, C):
        pos = cb + rr
        in_x = (pos >= start) & (pos < end)
        xrow = row0 + (pos - start).to(tl.int64)
        row1 = row + HV * ROW  # the request's next chunk
        more = (cb + C < end).to(tl.int32)
        w1 = tl.load(row1 + mat, mask=rr[:, None] < C * more, other=0.0)
        qe1 = tl.load(row1 + C * BK + mat, mask=rr[:, None] < C * more, other=0.0)
        u1 = tl.load(row1 + u_off, mask=rr[:, None] < C * more, other=0.0)
        p1 = tl.load(row1 + p_off, mask=rr[:, None] < C * more, other=0.0)
        v_new = u - tl.dot(w, state, input_precision=PREC)
        o = tl.dot(qe, state, input_precision=PREC) + tl.dot(p, v_new, input_precision=PREC)
        tl.store(
            out_ptr + (xrow[:, None] * HV + h) * DV + jj[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=in_x[:, None] & jmask[None, :],
        )
        state_end = state
        if cb + C <= end:  # a full chunk: the state at the next grid point
            kd = tl.load(row + 2 * C * BK + mat)
            state_end = state * tl.exp(tl.load(row + ROW - 1)) + tl.dot(tl.trans(kd), v_new, input_precision=PREC)
        # captures after token t (start + t + 1 in (cb, cb + C]): the state at t's grid point
        t_cap = tl.load(cap_at_ptr + c, mask=c < c_end, other=_NO_CAPTURE)
        while start + t_cap + 1 <= cb + C:
            at_end = start + t_cap + 1 == cb + C
            tl.store(cap_ptr + c.to(tl.int64) * (HV * DK * DV) + s_off, tl.where(at_end, state_end, state), mask=smask)
            c += 1
            t_cap = tl.load(cap_at_ptr + c, mask=c < c_end, other=_NO_CAPTURE)
        state = state_end
        w, qe, u, p, row = w1, qe1, u1, p1, row1
    if base + C <= end:  # the grid state moved (a decode step inside a chunk leaves it)
        tl.store(state_ptr + slot * (HV * DK * DV) + s_off, state, mask=smask)


def gated_delta_grid(
    x: torch.Tensor,
    ba: torch.Tensor,
    neg_a: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    ring: torch.Tensor,
    meta: RecurrentMeta,
    num_key_heads: int,
    *,
    precision: str = DOT_PRECISION,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule for every request of a step on the absolute chunk grid; states and rings in place.

    Args:
        x: ``[rows, conv_dim]`` the conv's output, ``q | k | v`` (key heads of ``dk``, value heads of ``dv``).
        ba: ``[rows, Hk * 2 * rep]`` the raw ``b`` (beta's logit) then ``a`` (the decay's) of each key head.
        neg_a: ``-exp(A_log)``, dt_bias: ``[Hv]`` float32.
        state: ``[slots, Hv, dk, dv]`` float32: each slot's state at its request's last grid point.
        ring: ``[slots, 2C, conv_dim + 2 Hv]`` float32: the raw inputs of the positions since (``C`` from
            its shape, one of :data:`CHUNKS`).
        meta: the step's requests (``seq_start`` places their rows on the grid).
        precision: the dots' ``input_precision`` (benchmarks compare others; the engine runs the default).

    Returns:
        ``(out [rows, Hv, dv]`` in ``x``'s dtype, ``captured [meta.num_capture_rows, Hv, dk, dv])``.
    """
    _, hv, dk, dv = state.shape
    rows, xw = x.shape
    chunk = ring.shape[1] // 2
    if chunk not in CHUNKS or ring.shape[2] != xw + 2 * hv or ba.shape[1] != 2 * hv:
        raise ValueError(f"gated_delta_grid: ring {tuple(ring.shape)} does not fit x {tuple(x.shape)}, Hv {hv}")
    if meta.chunk != chunk:
        raise ValueError(f"gated_delta_grid: the step's grid chunk {meta.chunk} is not the ring's {chunk}")
    out = torch.empty((rows, hv, dv), dtype=x.dtype, device=x.device)
    caps = torch.empty((max(meta.num_capture_rows, 1), hv, dk, dv), dtype=torch.float32, device=x.device)
    if meta.num_seqs and meta.num_chunks:
        bk, bvf = max(16, triton.next_power_of_2(dk)), max(16, triton.next_power_of_2(dv))
        cols = min(GRID_COLS, bvf)
        width = 3 * chunk * bk + chunk * bvf + chunk * chunk + 1
        scratch = torch.empty((meta.num_chunks, hv, width), dtype=torch.float32, device=x.device)
        common = dict(HV=hv, DK=dk, DV=dv, BK=bk, BVF=bvf, C=chunk, PREC=precision, num_warps=GRID_WARPS)
        _gdn_chunk_kernel[(meta.num_seqs, meta.max_chunks, hv)](
            x, x.stride(0), ba, ba.stride(0), neg_a, dt_bias, ring, scratch,
            meta.seq_len, meta.seq_row0, meta.seq_start, meta.seq_slot, meta.chunk0, dk**-0.5,
            HK=num_key_heads, LOG2C=chunk.bit_length() - 1, XW=xw, **common,
        )  # fmt: skip
        _gdn_state_kernel[(meta.num_seqs, hv, triton.cdiv(dv, cols))](
            scratch, state, out, caps,
            meta.seq_row0, meta.seq_len, meta.seq_start, meta.seq_slot, meta.chunk0,
            meta.cap_first, meta.cap_count, meta.cap_at, BV=cols, **common,
        )  # fmt: skip
        write_ring(x, ba, ring, meta)  # NOTE: after the scan: its programs read the rows this overwrites
    return out, caps[: meta.num_capture_rows]
