"""The gated delta rule (Qwen3-Next's linear attention), chunked and recurrent.

State ``S [Hv, dk, dv]``; per token: ``S <- S * exp(g)``, then the delta-rule
write ``S <- S + k (beta (v - S^T k))^T``, output ``o = S^T q``. The chunked
form computes a chunk of C tokens with a few matmuls (the UT transform) from the
state at the chunk's start.

Canonical use (see :mod:`kvwarden.layers.chunked_scan`): the chunk grid is fixed
to absolute positions and every call computes exactly one chunk of C rows,
zero-padded. Every quantity of row i depends on rows <= i only (triangular
masks, forward substitution), so a position's output is the same whether its
chunk was full (prefill) or ended at it (decode), and the state at a chunk end
is the same however the scheduler cut the prompt.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

Exp = Callable[[torch.Tensor], torch.Tensor]


def chunk_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    exp: Exp,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk of the gated delta rule.

    Args:
        q, k: ``[Hv, C, dk]`` float32 (l2-normalised; q already scaled by dk^-0.5).
        v: ``[Hv, C, dv]``; g (log decay, <= 0), beta: ``[Hv, C]``.
        state: ``[Hv, dk, dv]`` at the chunk's start.
        exp: element-wise exp (the numerics' pointwise exp).

    Returns:
        ``(out [Hv, C, dv], state at the chunk's end)``; the end state is only
        meaningful when all C rows are real tokens.
    """
    c = q.shape[1]
    upper = torch.ones(c, c, dtype=torch.bool, device=q.device).triu(1)
    v_beta = v * beta.unsqueeze(-1)
    k_beta = k * beta.unsqueeze(-1)
    cum = torch.cumsum(g, dim=-1)  # sequential: row i sums rows <= i
    decay = exp((cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(upper, float("-inf")))
    ut = torch.bmm(k_beta, k.transpose(1, 2)) * decay
    attn = torch.bmm(q, k.transpose(1, 2)) * decay
    exp_cum = exp(cum)
    new_values = torch.linalg.solve_triangular(ut, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(ut, k_beta * exp_cum.unsqueeze(-1), upper=False, unitriangular=True)
    v_new = new_values - torch.bmm(k_cumdecay, state)
    out = torch.bmm(q * exp_cum.unsqueeze(-1), state) + torch.bmm(attn, v_new)
    to_end = exp(cum[:, -1:] - cum).unsqueeze(-1)
    end_state = state * exp(cum[:, -1]).view(-1, 1, 1) + torch.bmm((k * to_end).transpose(1, 2), v_new)
    return out, end_state


def recurrent_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token form (what engines use for decode); same layout, T rows."""
    outs = []
    for t in range(q.shape[1]):
        state = state * torch.exp(g[:, t]).view(-1, 1, 1)
        kv_mem = (state * k[:, t].unsqueeze(-1)).sum(dim=-2)
        delta = (v[:, t] - kv_mem) * beta[:, t].unsqueeze(-1)
        state = state + k[:, t].unsqueeze(-1) * delta.unsqueeze(-2)
        outs.append((state * q[:, t].unsqueeze(-1)).sum(dim=-2))
    return torch.stack(outs, dim=1), state


def vendor_chunk_size(rows: int) -> int:
    """Chunk size a shape-dependent kernel picks for a call of ``rows`` tokens.

    Emulates kernel libraries that choose tiling by problem size; the grid
    starts at the call's first token, not at an absolute position.
    """
    return 64 if rows >= 512 else (32 if rows % 2 == 0 else 16)


def shape_dependent_scan(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Vendor-style: recurrent for one token, else chunks relative to the call's start."""
    rows = q.shape[1]
    if rows == 1:
        return recurrent_step(q, k, v, g, beta, state)
    c = vendor_chunk_size(rows)
    pad = (-rows) % c
    if pad:
        q, k, v = (torch.nn.functional.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (torch.nn.functional.pad(x, (0, pad)) for x in (g, beta))
    outs = []
    for start in range(0, rows + pad, c):
        sl = slice(start, start + c)
        out, end = chunk_step(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], state, torch.exp)
        outs.append(out)
        state = end
    # Padded rows (g = 0, beta = 0, k = 0) leave the state unchanged, so `state` is the final one.
    return torch.cat(outs, dim=1)[:, :rows], state
