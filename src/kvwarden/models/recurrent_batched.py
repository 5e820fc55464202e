"""A recurrent layer over all of a step's requests at once (the GPU backends' path).

The blocks of :mod:`kvwarden.models.recurrent_blocks` walk the batch request
by request on the CPU; on the Triton and CUDA backends
(``Ops.batched_recurrent``) they call the conv and the scan once per layer for
every request, addressed through the step's
:class:`~kvwarden.layers.recurrent_plan.RecurrentMeta`. What stays on the host
is rare: the boundary states the kernels captured (once per block per request)
are staged for the prefix cache here, with the conv window at that boundary.
"""

from __future__ import annotations

import torch

from kvwarden.cache.state_pool import StatePool
from kvwarden.layers.recurrent_plan import RecurrentMeta
from kvwarden.models.common import ForwardBatch


def conv_columns(*parts: tuple[int, int, int, int]) -> list[int]:
    """Input columns of the conv's channels: for each part ``(groups, width, group_stride, offset)`` the
    ``width`` columns at ``g * group_stride + offset`` for every group ``g``, parts in channel order."""
    cols: list[int] = []
    for groups, width, stride, offset in parts:
        for g in range(groups):
            cols.extend(range(g * stride + offset, g * stride + offset + width))
    return cols


def boundary_windows(
    x: torch.Tensor, cols: torch.Tensor, windows: torch.Tensor, meta: RecurrentMeta
) -> list[torch.Tensor]:
    """The conv window (last ``K-1`` raw inputs) at each boundary the step captures, in ``meta.captures``
    order; taken before the conv advances the windows."""
    out = []
    k1 = windows.shape[1]
    for cap in meta.captures:
        _, row0, _, _, slot = meta.host_seqs[cap.seq]
        at = cap.index + 1  # rows of the step before the boundary
        rows = x[row0 + max(at - k1, 0) : row0 + at].index_select(1, cols).float()
        # the last K-1 inputs before the boundary: from this step's rows, the window before it when too few
        out.append(rows if at >= k1 else torch.cat([windows[slot][at:], rows]))
    return out


def stage_captures(
    states: StatePool, meta: RecurrentMeta, layer: int, windows: list[torch.Tensor], ssm: torch.Tensor
) -> None:
    """Hand the step's captured states of one layer to the state pool: boundary states (published after
    the step) and a verify step's token states; a verify graph's go to :func:`keep_token_states` instead."""
    if meta.per_token:
        return
    for cap, window, state in zip(meta.captures, windows, ssm, strict=True):
        if cap.boundary:
            states.stage(cap.request_id, cap.pos, layer, window, state, owned=True)  # fresh tensors: no copies
        if cap.token:
            states.keep_token(cap.request_id, cap.pos, layer, window, state)


def window_rows(x: torch.Tensor, cols: torch.Tensor, windows: torch.Tensor, meta: RecurrentMeta) -> torch.Tensor:
    """A verify graph's conv inputs per request: ``[seqs, K - 1 + q, C]`` float32, the window before the
    step then the step's ``q`` raw inputs; the window after token ``t`` is rows ``t + 1 .. t + K - 1``.
    Taken before the conv advances the windows (static shapes: nothing leaves the device)."""
    q = meta.per_token
    before = windows.index_select(0, meta.seq_slot.long())
    rows = x.index_select(1, cols).float().view(meta.num_seqs, q, -1)
    return torch.cat([before, rows], dim=1)


def keep_token_states(
    batch: ForwardBatch, meta: RecurrentMeta, windows: torch.Tensor | None, caps: torch.Tensor
) -> None:
    """In a verify graph, hand the layer's per-token conv inputs and scan states to the step's caller
    (``batch.token_states``, one entry per recurrent layer in order)."""
    if meta.per_token and batch.token_states is not None:
        assert windows is not None
        batch.token_states.append((windows, caps))


def trace_states_in(batch: ForwardBatch, meta: RecurrentMeta, name: str, layer: int) -> None:
    """The tracer's view of each request's state before the step (restored or carried)."""
    tracer, states = batch.tracer, batch.states
    if tracer is None or states is None:
        return
    for rid, _, _, start, slot in meta.host_seqs:
        tracer.record_at(f"{name}.state_in", rid, start, states.ssm[layer][slot])
        tracer.record_at(f"{name}.conv_in", rid, start, states.conv[layer][slot])
