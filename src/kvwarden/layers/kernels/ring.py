"""The chunked scans' pending rows: each request's latest raw inputs, kept in its ring in the state pool.

A request's working state on the chunk grid is the state at its last grid point
plus the raw inputs of the positions since; a step reads them back to recompute
its grid chunk. Rows live at ``position % 2C`` of a ``2C``-row ring, so a verify
step of at most ``C`` rows (drafts beyond ``C - 1`` are refused at start-up,
``engine/memory.py``) never overwrites the rows before its start that a return
to one of its tokens needs.

NOTE(invariance): rows are stored in float32, exact copies of the model-dtype
inputs, so a row read back is the value the step itself read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvwarden.layers.recurrent_plan import RecurrentMeta

RING_COLS = 256  # columns per program


@triton.jit
def _ring_write_kernel(
    x_ptr, x_stride, extra_ptr, extra_stride, ring_ptr, row0_ptr, len_ptr, start_ptr, slot_ptr,
    C: tl.constexpr, XW: tl.constexpr, F: tl.constexpr, BF: tl.constexpr,
):  # fmt: skip
    """Each request's last rows (at most ``C``) into its ring at ``position % 2C``: ``x`` then ``extra``."""
    s = tl.program_id(0)
    cols = tl.program_id(1) * BF + tl.arange(0, BF)
    n = tl.load(len_ptr + s)
    start = tl.load(start_ptr + s)
    row0 = tl.load(row0_ptr + s).to(tl.int64)
    ring = ring_ptr + tl.load(slot_ptr + s).to(tl.int64) * (2 * C * F)
    end = start + n
    in_x = cols < XW
    in_extra = (cols >= XW) & (cols < F)
    for p in range(tl.maximum(start, end - C), end):
        row = row0 + (p - start)
        xv = tl.load(x_ptr + row * x_stride + cols, mask=in_x, other=0.0).to(tl.float32)
        ev = tl.load(extra_ptr + row * extra_stride + (cols - XW), mask=in_extra, other=0.0).to(tl.float32)
        tl.store(ring + (p % (2 * C)) * F + cols, tl.where(in_x, xv, ev), mask=cols < F)


@triton.jit
def read_rows(ring, rrow, x_ptr, x_stride, xrow, cols, colmask, in_ring, in_x):
    """A chunk's rows ``[C, cols]`` in float32: earlier steps' from the ring (row offsets ``rrow``), this step's
    from ``x`` (rows ``xrow``), zeros past the request's rows."""
    return tl.where(
        in_ring[:, None],
        tl.load(ring + rrow[:, None] + cols[None, :], mask=in_ring[:, None] & colmask[None, :], other=0.0),
        tl.load(x_ptr + xrow[:, None] * x_stride + cols[None, :], mask=in_x[:, None] & colmask[None, :], other=0.0).to(
            tl.float32
        ),
    )


@triton.jit
def read_column(ring, rrow, x_ptr, x_stride, xrow, col, in_ring, in_x):
    """One column of a chunk's rows ``[C]`` in float32 (a gate's input), as :func:`read_rows`."""
    return tl.where(
        in_ring,
        tl.load(ring + rrow + col, mask=in_ring, other=0.0),
        tl.load(x_ptr + xrow * x_stride + col, mask=in_x, other=0.0).to(tl.float32),
    )


def write_ring(x: torch.Tensor, extra: torch.Tensor, ring: torch.Tensor, meta: RecurrentMeta) -> None:
    """Keep the step's last rows of ``x | extra`` (``[rows, XW]``, ``[rows, E]``, rows contiguous in their last
    dimension) in each request's ring ``[slots, 2C, XW + E]``. Launch it after the scan that read the ring."""
    width = x.shape[1] + extra.shape[1]
    if ring.shape[2] != width:
        raise ValueError(f"write_ring: ring rows of {ring.shape[2]} for {x.shape[1]} + {extra.shape[1]} columns")
    if meta.num_seqs:
        _ring_write_kernel[(meta.num_seqs, triton.cdiv(width, RING_COLS))](
            x, x.stride(0), extra, extra.stride(0), ring, meta.seq_row0, meta.seq_len, meta.seq_start, meta.seq_slot,
            C=ring.shape[1] // 2, XW=x.shape[1], F=width, BF=RING_COLS,
        )  # fmt: skip
