"""Paged causal attention: the per-step plan shared by every backend, and the shape-dependent kernel.

The canonical CPU kernel lives in :mod:`kvwarden.layers.canonical_attention`,
the GPU kernels in :mod:`kvwarden.layers.kernels.attention`; both read the
same :class:`AttentionPlan` (its ``groups`` and ``meta`` are theirs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class SeqAttn:
    """One request's share of a batch.

    Attributes:
        row_start: first row of its queries in the flattened batch.
        num_queries: queries this step (chunk length, 1 for decode).
        start_pos: absolute position of its first query.
        slots: flat cache slot of every position ``[0, start_pos + num_queries)``.
    """

    row_start: int
    num_queries: int
    start_pos: int
    slots: torch.Tensor


@dataclass(frozen=True)
class AttentionPlan:
    """Everything the attention layers need for one step, built once per step."""

    seqs: tuple[SeqAttn, ...]
    num_rows: int
    groups: tuple[Any, ...] = ()  # the canonical CPU kernel's (canonical_attention.TileGroup)
    meta: Any = None  # a GPU backend's own per-step tensors (kernels/attention.AttentionMeta)


def _expand_heads(x: torch.Tensor, rep: int) -> torch.Tensor:
    """``[..., Hkv, D] -> [..., Hkv * rep, D]`` (each kv head serves ``rep`` query heads)."""
    if rep == 1:
        return x
    *lead, hkv, d = x.shape
    return x.unsqueeze(-2).expand(*lead, hkv, rep, d).reshape(*lead, hkv * rep, d)


def shape_dependent_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: AttentionPlan, scale: float
) -> torch.Tensor:
    """Per-request SDPA over the gathered context: the usual (shape-dependent) way."""
    rows, hq, d = q.shape
    rep = hq // k_cache.shape[1]
    out = q.new_empty((rows, hq, d))
    for seq in plan.seqs:
        ctx = seq.start_pos + seq.num_queries
        slots = seq.slots[:ctx].to(q.device)
        k = _expand_heads(k_cache[slots], rep).transpose(0, 1)
        v = _expand_heads(v_cache[slots, :, :d], rep).transpose(0, 1)
        qs = q[seq.row_start : seq.row_start + seq.num_queries].transpose(0, 1)
        qpos = torch.arange(seq.start_pos, ctx, device=q.device).view(-1, 1)
        mask = torch.arange(ctx, device=q.device).view(1, -1) <= qpos
        o = torch.nn.functional.scaled_dot_product_attention(qs, k, v, attn_mask=mask, scale=scale)
        out[seq.row_start : seq.row_start + seq.num_queries] = o.transpose(0, 1)
    return out
