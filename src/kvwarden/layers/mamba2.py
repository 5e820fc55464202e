"""Mamba2 state-space duality (SSD) scan, chunked and recurrent.

State ``S [H, P, N]``; per token with ``dA = exp(dt * A)``:
``S <- S * dA + dt * x B^T``, ``y = S C + D x``. The chunked form computes C
tokens at once from the state at the chunk's start (intra-chunk quadratic form
plus the decayed read of the start state).

Canonical use follows the same contract as :mod:`kvwarden.layers.gated_delta`:
one fixed-size chunk per call, grid fixed to absolute positions, row i depends
on rows <= i only.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvwarden.layers.gated_delta import vendor_chunk_size

Exp = Callable[[torch.Tensor], torch.Tensor]


def chunk_step(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    d: torch.Tensor,
    state: torch.Tensor,
    exp: Exp,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One SSD chunk.

    Args:
        x: ``[H, L, P]`` float32; dt: ``[H, L]`` (after softplus and clamp).
        a: ``[H]`` (negative); b, c: ``[H, L, N]`` (groups already expanded to heads).
        d: ``[H]`` skip weights; state: ``[H, P, N]`` at the chunk's start.

    Returns:
        ``(y [H, L, P], state at the chunk's end)`` (end state meaningful for full chunks).
    """
    length = x.shape[1]
    upper = torch.ones(length, length, dtype=torch.bool, device=x.device).triu(1)
    da = dt * a.unsqueeze(-1)  # [H, L]
    x_dt = x * dt.unsqueeze(-1)
    cum = torch.cumsum(da, dim=-1)  # sequential
    decay = exp((cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(upper, float("-inf")))  # [H, L, L]
    scores = torch.bmm(c, b.transpose(1, 2)) * decay
    y = torch.bmm(scores, x_dt) + torch.bmm(c, state.transpose(1, 2)) * exp(cum).unsqueeze(-1)
    y = y + x * d.view(-1, 1, 1)
    to_end = exp(cum[:, -1:] - cum).unsqueeze(-1)  # [H, L, 1]
    end_state = state * exp(cum[:, -1]).view(-1, 1, 1) + torch.bmm(x_dt.transpose(1, 2), b * to_end)
    return y, end_state


def recurrent_step(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    d: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token form (decode in vendor engines); same layout."""
    outs = []
    for t in range(x.shape[1]):
        da = torch.exp(dt[:, t] * a).view(-1, 1, 1)
        state = state * da + (dt[:, t].view(-1, 1, 1) * x[:, t].unsqueeze(-1)) * b[:, t].unsqueeze(1)
        y = torch.bmm(state, c[:, t].unsqueeze(-1)).squeeze(-1) + x[:, t] * d.unsqueeze(-1)
        outs.append(y)
    return torch.stack(outs, dim=1), state


def shape_dependent_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    d: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Vendor-style: recurrent for one token, else chunks relative to the call's start."""
    rows = x.shape[1]
    if rows == 1:
        return recurrent_step(x, dt, a, b, c, d, state)
    size = vendor_chunk_size(rows)
    outs = []
    for start in range(0, rows, size):
        sl = slice(start, start + size)
        y, state = chunk_step(x[:, sl], dt[:, sl], a, b[:, sl], c[:, sl], d, state, torch.exp)
        outs.append(y)
    return torch.cat(outs, dim=1), state
