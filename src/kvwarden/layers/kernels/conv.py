"""The recurrent layers' short causal conv on the GPU, batched over a step's requests.

``out[t] = silu(b + w[0] x[t-K+1] + ... + w[K-1] x[t])`` per channel, where the
inputs before a request's first row of the step come from its conv window (the
last ``K-1`` raw inputs, float32, in the state pool). Two launches per layer:
the conv over every row, then the windows' update (every row must have read
the old window before it is overwritten).

NOTE(invariance), by construction: an output element is a left fold over the
taps in order, in float32, rounded once to the model's dtype, then the silu of
``kernels/pointwise.py``; its inputs are the same values whether they come from
this step's rows or from the window (the window stores the raw model-dtype
values exactly, in float32). A position's output is therefore one fixed
instruction sequence over the same inputs, whatever the chunking, the batch or
the tile it lands in. The window after a step is a copy of inputs, no
arithmetic.

Inputs may be a column selection of a wider projection (``cols``: Qwen3-Next's
``q | k | v`` sit interleaved with ``z`` per key head in ``in_proj_qkvz``), which
saves a gather copy per layer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvwarden.layers.recurrent_plan import RecurrentMeta

BLOCK_ROWS = 16
BLOCK_CH = 128


@triton.jit(do_not_specialize=["rows"])
def _conv_kernel(
    x_ptr, x_stride, cols_ptr, win_ptr, w_ptr, bias_ptr, y_ptr, row_seq_ptr, row0_ptr, slot_ptr, rows, C,
    K: tl.constexpr, HAS_BIAS: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr,
):  # fmt: skip
    rr = tl.program_id(0) * BR + tl.arange(0, BR)
    cc = tl.program_id(1) * BC + tl.arange(0, BC)
    rmask = rr < rows
    cmask = cc < C
    seq = tl.load(row_seq_ptr + rr, mask=rmask, other=0)
    row0 = tl.load(row0_ptr + seq, mask=rmask, other=0)
    slot = tl.load(slot_ptr + seq, mask=rmask, other=0).to(tl.int64)
    col = tl.load(cols_ptr + cc, mask=cmask, other=0)
    idx = rr - row0  # the row's token index inside its request's rows
    acc = tl.zeros((BR, BC), dtype=tl.float32)
    for tap in tl.static_range(K):
        src = idx - (K - 1) + tap
        from_x = src >= 0
        m = rmask[:, None] & cmask[None, :]
        xv = tl.load(
            x_ptr + (row0 + src).to(tl.int64)[:, None] * x_stride + col[None, :], mask=m & from_x[:, None], other=0.0
        ).to(tl.float32)
        wv = tl.load(
            win_ptr + slot[:, None] * ((K - 1) * C) + (K - 1 + src)[:, None] * C + cc[None, :],
            mask=m & (src < 0)[:, None],
            other=0.0,
        )
        w = tl.load(w_ptr + cc * K + tap, mask=cmask, other=0.0).to(tl.float32)
        acc = acc + tl.where(from_x[:, None], xv, wv) * w[None, :]
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + cc, mask=cmask, other=0.0).to(tl.float32)[None, :]
    y = acc.to(y_ptr.dtype.element_ty).to(tl.float32)
    y = y / (1.0 + tl.exp(-y))
    tl.store(y_ptr + rr[:, None] * C + cc[None, :], y.to(y_ptr.dtype.element_ty), mask=rmask[:, None] & cmask[None, :])


@triton.jit
def _window_kernel(
    x_ptr, x_stride, cols_ptr, win_ptr, row0_ptr, len_ptr, slot_ptr, C,
    K1: tl.constexpr, BK1: tl.constexpr, BC: tl.constexpr,
):  # fmt: skip
    s = tl.program_id(0)
    cc = tl.program_id(1) * BC + tl.arange(0, BC)
    cmask = cc < C
    n = tl.load(len_ptr + s)
    row0 = tl.load(row0_ptr + s)
    slot = tl.load(slot_ptr + s).to(tl.int64)
    col = tl.load(cols_ptr + cc, mask=cmask, other=0)
    jj = tl.arange(0, BK1)
    src = n + jj - K1  # window entry j after the step = input n + j - K1 of [old window | new rows]
    from_x = src >= 0
    m = (jj < K1)[:, None] & cmask[None, :]
    xv = tl.load(
        x_ptr + (row0 + src).to(tl.int64)[:, None] * x_stride + col[None, :], mask=m & from_x[:, None], other=0.0
    ).to(tl.float32)
    wv = tl.load(win_ptr + slot * (K1 * C) + (K1 + src)[:, None] * C + cc[None, :], mask=m & (src < 0)[:, None])
    tl.store(win_ptr + slot * (K1 * C) + jj[:, None] * C + cc[None, :], tl.where(from_x[:, None], xv, wv), mask=m)


def causal_conv(
    x: torch.Tensor,
    cols: torch.Tensor,
    windows: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    meta: RecurrentMeta,
) -> torch.Tensor:
    """``silu(conv(x[:, cols]))`` for every row of a step, then each request's window advanced in place.

    Args:
        x: ``[rows, >= max(cols) + 1]`` the raw inputs (a projection's output).
        cols: ``[C]`` int32 columns of ``x`` that are the conv's channels, in channel order.
        windows: ``[slots, K-1, C]`` float32 (the state pool's conv tensor for this layer).
        weight: ``[C, K]``; bias: ``[C]`` or None.

    Returns:
        ``[rows, C]`` in ``x``'s dtype.
    """
    rows, c = x.shape[0], cols.shape[0]
    k = weight.shape[1]
    y = torch.empty((rows, c), dtype=x.dtype, device=x.device)
    if rows:
        grid = (triton.cdiv(rows, BLOCK_ROWS), triton.cdiv(c, BLOCK_CH))
        _conv_kernel[grid](
            x, x.stride(0), cols, windows, weight, bias if bias is not None else weight, y,
            meta.row_seq, meta.seq_row0, meta.seq_slot, rows, c,
            K=k, HAS_BIAS=bias is not None, BR=BLOCK_ROWS, BC=BLOCK_CH,
        )  # fmt: skip
    if meta.num_seqs and k > 1:
        _window_kernel[(meta.num_seqs, triton.cdiv(c, BLOCK_CH))](
            x, x.stride(0), cols, windows, meta.seq_row0, meta.seq_len, meta.seq_slot, c,
            K1=k - 1, BK1=max(2, triton.next_power_of_2(k - 1)), BC=BLOCK_CH,
        )  # fmt: skip
    return y
