"""Driving a recurrent layer's scan for one request's chunk, and where its state goes.

Two drivers with one signature (the CPU's, request by request):

* :func:`canonical_scan` - kvwarden's. The chunk grid is fixed to absolute
  positions (multiples of ``chunk``). The working state holds the recurrent
  state at the last grid point plus the features of the tokens since then (the
  *pending* rows). Every call recomputes the current grid chunk from that state
  with one fixed-shape kernel call, so a decode step gives the same bits as the
  prefill that would have covered the same position. When a grid chunk
  completes on a block boundary, its end state is captured for the prefix
  cache: every boundary a prefill chunk crosses, from inside that one chunk,
  with no extra scheduler splits.
* :func:`vendor_scan` - the shape-dependent emulation: the scan runs over the
  scheduler's chunk with a grid relative to its start (token by token for
  decode), the working state is the state at the current position, and only a
  chunk that ends exactly on a block boundary leaves a state behind (vLLM's
  align mode).

On a GPU the scan runs batched over a step's requests instead
(:mod:`kvwarden.models.recurrent_batched`): token by token by default and on the
fast path (:mod:`kvwarden.layers.kernels.recurrent`), or, with
``numerics.recurrent_scan="chunked"``, on the same absolute grid as here with a
ring of raw pending rows (:mod:`kvwarden.layers.kernels.recurrent_grid`,
:mod:`kvwarden.layers.kernels.ssd_grid`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

# (packed rows [C, F], state) -> (outputs [C, O], state at the chunk's end)
ChunkKernel = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
# (packed rows [n, F], state) -> (outputs [n, O], state after the last row)
SeqKernel = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
Capture = Callable[[int, torch.Tensor], None]
# (packed rows [n, F], state (updated in place), token indices to capture after) -> (outputs [n, O], captured)
StepKernel = Callable[[torch.Tensor, torch.Tensor, list[int]], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class ScanState:
    """Views of one request's working state for one layer (updated in place)."""

    ssm: torch.Tensor
    pending: torch.Tensor | None  # [chunk, F]: features of positions since the last grid point (chunked only)


def canonical_scan(
    new: torch.Tensor,
    start: int,
    state: ScanState,
    chunk: int,
    block_size: int,
    kernel: ChunkKernel,
    capture: Capture,
) -> torch.Tensor:
    """Outputs for positions ``[start, start + len(new))``; advances the working state."""
    assert state.pending is not None, "the chunked scan needs the state pool's pending rows"
    base = start - start % chunk
    have = start - base
    rows = torch.cat([state.pending[:have].to(new.dtype), new]) if have else new
    total = rows.shape[0]
    outs = []
    for off in range(0, total, chunk):
        part = rows[off : off + chunk]
        m = part.shape[0]
        if m < chunk:
            part = torch.cat([part, part.new_zeros((chunk - m, part.shape[1]))])
        out, end_state = kernel(part, state.ssm)
        lo = max(off, have)
        outs.append(out[lo - off : m])
        if m == chunk:
            state.ssm.copy_(end_state)
            pos = base + off + chunk
            if pos % block_size == 0:
                capture(pos, state.ssm)
    tail = total % chunk
    if tail:
        state.pending[:tail] = rows[total - tail :]
    return torch.cat(outs)


def vendor_scan(
    new: torch.Tensor,
    start: int,
    state: ScanState,
    block_size: int,
    kernel: SeqKernel,
    capture: Capture,
) -> torch.Tensor:
    """Shape-dependent: one scan over the chunk; a state only where the chunk ends on a boundary."""
    out, end_state = kernel(new, state.ssm)
    state.ssm.copy_(end_state)
    end = start + new.shape[0]
    if end % block_size == 0:
        capture(end, state.ssm)
    return out
