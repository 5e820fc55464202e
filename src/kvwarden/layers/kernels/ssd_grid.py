"""Mamba2's SSD scan in chunks on the absolute position grid (``numerics.recurrent_scan="chunked"``).

Granite 4.0-H's mixer on the canonical GPU backend, on the rule of the CPU
path (:func:`kvwarden.layers.chunked_scan.canonical_scan`) and of the gated
delta rule's chunked scan (:mod:`kvwarden.layers.kernels.recurrent_grid`):
chunks of ``C`` tokens at multiples of ``C``; a request's working state is the
state ``S [P, N]`` (per head) at its last grid point plus the raw inputs of the
positions since, in its ring of pending rows (:mod:`kvwarden.layers.kernels.ring`).
Each grid chunk the step touches is computed from that state in the SSD form,
with ``dA = dt A`` and its in-chunk prefix sums ``g``:

* ``y = ((C e^g) S^T) + (C B^T * decay) (x dt) + D x`` with ``decay_ij = e^{g_i - g_j}`` for ``j <= i``;
* at a full chunk, ``S' = S e^{g_last} + (x dt)^T (B e^{g_last - g})``.

Four dots per chunk and no inverse (unlike the delta rule), so one launch per
layer: program ``(s, h, p-block)`` walks request ``s``'s chunks in order. A
decode step recomputes its grid chunk - the same code, the same shapes.

NOTE(invariance), by construction (the argument of ``recurrent_grid.py``):
a row's output reads the state at its grid point and the rows of its chunk up
to itself only (the decay mask gives exact zeros above the diagonal, the
cumulative decay is a prefix scan, each dot's entry reads one row of one side);
padding rows of a decode step get ``dt = 0`` and meet earlier rows only as
``0 * finite``. Shapes are constants (``C``, the ``P`` block, ``N``), the chunk
loop's bound is data, and partners change only the grid. So decode equals
prefill bit for bit for any split, and the state at a grid point (a block
boundary: ``block_size % C == 0``, checked at start-up) is the same however it
was reached; verify steps keep the state at a token's grid point, as the gated
delta rule's scan does.

Precision: float32 operands and accumulation, ``tf32x3`` dots (about float32's
accuracy) on tensor cores; ``dt`` (softplus, clamp) and the state in float32.
Not yet timed on a GPU: ``kvwarden bench fla_compare`` times the gated delta rule's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvwarden.layers.kernels.gemm import INTERPRETED
from kvwarden.layers.kernels.recurrent_grid import CHUNKS, DOT_PRECISION
from kvwarden.layers.kernels.ring import read_column, read_rows, write_ring
from kvwarden.layers.recurrent_plan import RecurrentMeta

# Head-dim rows per program (a constant, never chosen by the batch): 16 on a GPU (the token loop's block);
# whole heads under the interpreter (a program costs Python time there).
SSD_ROWS, SSD_WARPS = (64 if INTERPRETED else 16), 4
_NO_CAPTURE = tl.constexpr(1 << 30)  # a capture index past any step


@triton.jit
def _ssd_grid_kernel(
    x_ptr, x_stride, dt_ptr, dt_stride, dt_bias_ptr, a_ptr, d_ptr, state_ptr, ring_ptr, y_ptr, cap_ptr,
    row0_ptr, len_ptr, start_ptr, slot_ptr, cap_first_ptr, cap_count_ptr, cap_at_ptr, dt_lo, dt_hi,
    H: tl.constexpr, G: tl.constexpr, P: tl.constexpr, N: tl.constexpr, BP: tl.constexpr, BN_: tl.constexpr,
    CLAMP: tl.constexpr, C: tl.constexpr, XW: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    s = tl.program_id(0)
    h = tl.program_id(1)
    pb = tl.program_id(2)
    F: tl.constexpr = XW + H  # a ring row: the conv's output x | B | C, then the raw dt of every head
    pp = pb * BP + tl.arange(0, BP)
    nn = tl.arange(0, BN_)
    rr = tl.arange(0, C)
    pmask = pp < P
    nmask = nn < N
    smask = pmask[:, None] & nmask[None, :]
    s_off = h * P * N + pp[:, None] * N + nn[None, :]
    causal = rr[None, :] <= rr[:, None]
    slot = tl.load(slot_ptr + s).to(tl.int64)
    n = tl.load(len_ptr + s)
    start = tl.load(start_ptr + s)
    row0 = tl.load(row0_ptr + s).to(tl.int64)
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
    ring = ring_ptr + slot * (2 * C * F)
    end = start + n
    base = tl.where(n > 0, start - start % C, end)  # a padding request (no rows) runs no chunk
    for cb in range(base, end, C):
        pos = cb + rr
        in_ring = pos < start  # earlier steps' rows of this chunk
        in_x = (pos >= start) & (pos < end)
        xrow = row0 + (pos - start).to(tl.int64)
        rrow = (pos % (2 * C)).to(tl.int64) * F
        x = read_rows(ring, rrow, x_ptr, x_stride, xrow, x_col, pmask, in_ring, in_x)
        bb = read_rows(ring, rrow, x_ptr, x_stride, xrow, b_col, nmask, in_ring, in_x)
        cc = read_rows(ring, rrow, x_ptr, x_stride, xrow, c_col, nmask, in_ring, in_x)
        dt = read_column(ring + XW, rrow, dt_ptr, dt_stride, xrow, h, in_ring, in_x)
        # softplus and the clamp as the token-by-token kernel computes them; padding rows take no step
        dx = dt + dt_bias
        step = tl.where(dx > 20.0, dx, tl.log(1.0 + tl.exp(tl.minimum(dx, 20.0))))
        if CLAMP:
            step = tl.minimum(tl.maximum(step, dt_lo), dt_hi)
        step = tl.where(in_ring | in_x, step, 0.0)
        gc = tl.cumsum(step * a, axis=0)  # a prefix scan: row i reads rows <= i only
        decay = tl.exp(tl.where(causal, gc[:, None] - gc[None, :], float("-inf")))
        xd = x * step[:, None]
        scores = tl.where(causal, tl.dot(cc, tl.trans(bb), input_precision=PREC) * decay, 0.0)
        y = tl.dot(cc * tl.exp(gc)[:, None], tl.trans(state), input_precision=PREC)
        y = y + tl.dot(scores, xd, input_precision=PREC) + x * dskip
        tl.store(y_ptr + (xrow[:, None] * H + h) * P + pp[None, :], y, mask=in_x[:, None] & pmask[None, :])
        state_end = state
        if cb + C <= end:  # a full chunk: the state at the next grid point
            g_last = tl.sum(tl.where(rr == C - 1, gc, 0.0), axis=0)
            to_end = tl.exp(g_last - gc)
            state_end = state * tl.exp(g_last) + tl.dot(tl.trans(xd), bb * to_end[:, None], input_precision=PREC)
        # captures after token t (start + t + 1 in (cb, cb + C]): the state at t's grid point
        t_cap = tl.load(cap_at_ptr + c, mask=c < c_end, other=_NO_CAPTURE)
        while start + t_cap + 1 <= cb + C:
            at_end = start + t_cap + 1 == cb + C
            tl.store(cap_ptr + c.to(tl.int64) * (H * P * N) + s_off, tl.where(at_end, state_end, state), mask=smask)
            c += 1
            t_cap = tl.load(cap_at_ptr + c, mask=c < c_end, other=_NO_CAPTURE)
        state = state_end
    if base + C <= end:  # the grid state moved (a decode step inside a chunk leaves it)
        tl.store(state_ptr + slot * (H * P * N) + s_off, state, mask=smask)


def mamba2_grid(
    x: torch.Tensor,
    dt: torch.Tensor,
    dt_bias: torch.Tensor,
    a: torch.Tensor,
    d: torch.Tensor,
    state: torch.Tensor,
    ring: torch.Tensor,
    meta: RecurrentMeta,
    num_groups: int,
    dt_limit: tuple[float, float],
    *,
    precision: str = DOT_PRECISION,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Mamba2 recurrence for every request of a step on the absolute chunk grid; states and rings in place.

    Args:
        x: ``[rows, conv_dim]`` the conv's output, ``x | B | C`` (``B``, ``C`` per group).
        dt: ``[rows, >= H]`` raw time steps (softplus with ``dt_bias`` and the clamp happen here).
        a (``-exp(A_log)``), d, dt_bias: ``[H]`` float32.
        state: ``[slots, H, P, N]`` float32: each slot's state at its request's last grid point.
        ring: ``[slots, 2C, conv_dim + H]`` float32, the raw rows since (``C`` from its shape).
        meta: the step's requests; precision: the dots' ``input_precision``.

    Returns:
        ``(y [rows, H, P]`` float32, ``captured [meta.num_capture_rows, H, P, N])``.
    """
    _, h, p, nstate = state.shape
    rows, xw = x.shape
    chunk = ring.shape[1] // 2
    if chunk not in CHUNKS or ring.shape[2] != xw + h or meta.chunk != chunk:
        raise ValueError(
            f"mamba2_grid: ring {tuple(ring.shape)} does not fit x {tuple(x.shape)}, H {h}, C {meta.chunk}"
        )
    y = torch.empty((rows, h, p), dtype=torch.float32, device=x.device)
    caps = torch.empty((max(meta.num_capture_rows, 1), h, p, nstate), dtype=torch.float32, device=x.device)
    lo, hi = dt_limit
    if meta.num_seqs:
        bp = min(SSD_ROWS, max(16, triton.next_power_of_2(p)))
        _ssd_grid_kernel[(meta.num_seqs, h, triton.cdiv(p, bp))](
            x, x.stride(0), dt, dt.stride(0), dt_bias, a, d, state, ring, y, caps,
            meta.seq_row0, meta.seq_len, meta.seq_start, meta.seq_slot, meta.cap_first, meta.cap_count, meta.cap_at,
            float(lo), float(hi) if hi != float("inf") else 3.0e38,
            H=h, G=num_groups, P=p, N=nstate, BP=bp, BN_=max(16, triton.next_power_of_2(nstate)),
            CLAMP=lo > 0.0 or hi != float("inf"), C=chunk, XW=xw, PREC=precision, num_warps=SSD_WARPS,
        )  # fmt: skip
        write_ring(x, dt[:, :h], ring, meta)  # NOTE: after the scan: its programs read the rows this overwrites
    return y, caps[: meta.num_capture_rows]
