"""Paged causal attention: a canonical tiled kernel and a shape-dependent one.

Canonical kernel (NOTE(invariance) - every decision below keeps a query's output
a function of its absolute position and the keys' contents only):

* Queries are cut into tiles of ``Tq`` rows aligned to absolute position
  (tile ``p // Tq``, slot ``p % Tq``); keys into tiles of ``Tk`` aligned to
  position 0. A (query, key) pair therefore always sits at the same slot of a
  fixed-shape ``(Tq x D) @ (D x Tk)`` product, however the request was chunked.
* ``bmm`` of one fixed per-matrix shape returns the same bits for a matrix
  whatever the batch count (measured; ``tests/test_numerics_assumptions.py``
  keeps checking it), so tiles from many requests share one call.
* The softmax max is an exact ``amax`` over all valid keys (order-free).
* ``P @ [V | 1]`` per tile gives both the numerator and the row sum in one
  fixed-shape product; tiles are folded in key order by ``cumsum`` (a
  sequential float64 fold), so trailing fully-masked tiles add exact zeros and
  change nothing.
* Keys past the context read a dedicated all-zero slot, so masked products are
  ``0 * finite`` and never NaN.

Cost: queries are padded to ``Tq`` (decode wastes Tq-1 rows of the score
product) and key tiles up to the longest item in a group are computed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

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
class TileGroup:
    """Query tiles processed by one batched call (canonical kernel)."""

    q_rows: torch.Tensor  # [G, Tq] row in the batch, or -1 for a padding slot
    k_slots: torch.Tensor  # [G, nk * Tk] cache slot per key (null slot past the context)
    mask: torch.Tensor  # [G, 1, nk, Tq, Tk] True where the key is visible to the query


@dataclass(frozen=True)
class AttentionPlan:
    """Everything the attention layers need for one step, built once per step."""

    seqs: tuple[SeqAttn, ...]
    groups: tuple[TileGroup, ...]
    num_rows: int


def build_plan(
    seqs: list[SeqAttn],
    num_rows: int,
    q_tile: int,
    k_tile: int,
    null_slot: int,
    max_pairs: int = 512,
) -> AttentionPlan:
    """Cut the batch's queries into position-aligned tiles and group them.

    Groups only bound memory (at most ``max_pairs`` query-tile x key-tile pairs
    per call): a tile's result does not depend on its group.
    """
    items: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    for seq in seqs:
        first = seq.start_pos // q_tile
        last = (seq.start_pos + seq.num_queries - 1) // q_tile
        for tile in range(first, last + 1):
            pos = torch.arange(tile * q_tile, (tile + 1) * q_tile)
            real = (pos >= seq.start_pos) & (pos < seq.start_pos + seq.num_queries)
            rows = torch.where(real, seq.row_start + pos - seq.start_pos, -1)
            max_pos = int(pos[real].max())
            nk = max_pos // k_tile + 1
            kpos = torch.arange(nk * k_tile)
            ctx = seq.start_pos + seq.num_queries
            slots = torch.full((nk * k_tile,), null_slot, dtype=torch.long)
            valid = kpos < ctx
            slots[valid] = seq.slots[kpos[valid]]
            qpos = torch.where(real, pos, -1)
            items.append((rows, slots, qpos))

    groups: list[TileGroup] = []
    start = 0
    while start < len(items):
        end = start + 1
        nk_max = items[start][1].numel() // k_tile
        while end < len(items):
            nk = max(nk_max, items[end][1].numel() // k_tile)
            if (end - start + 1) * nk > max_pairs:
                break
            nk_max, end = nk, end + 1
        groups.append(_make_group(items[start:end], nk_max, q_tile, k_tile, null_slot))
        start = end
    return AttentionPlan(seqs=tuple(seqs), groups=tuple(groups), num_rows=num_rows)


def _make_group(
    items: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    nk: int,
    q_tile: int,
    k_tile: int,
    null_slot: int,
) -> TileGroup:
    g = len(items)
    q_rows = torch.stack([rows for rows, _, _ in items])
    k_slots = torch.full((g, nk * k_tile), null_slot, dtype=torch.long)
    k_pos = torch.full((g, nk * k_tile), 1 << 40, dtype=torch.long)
    for i, (_, slots, _) in enumerate(items):
        n = slots.numel()
        k_slots[i, :n] = slots
        k_pos[i, :n] = torch.arange(n)
    q_pos = torch.stack([qpos for _, _, qpos in items])
    # visible: key position <= query position, for real queries only
    visible = k_pos.view(g, 1, nk, 1, k_tile) <= q_pos.view(g, 1, 1, q_tile, 1)
    visible &= (q_pos >= 0).view(g, 1, 1, q_tile, 1)
    return TileGroup(q_rows=q_rows, k_slots=k_slots, mask=visible)


def canonical_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: AttentionPlan,
    scale: float,
    exp: Callable[[torch.Tensor], torch.Tensor],
    q_tile: int,
    k_tile: int,
) -> torch.Tensor:
    """Tiled attention over the paged cache.

    Args:
        q: ``[rows, Hq, D]`` queries (rope applied).
        k_cache, v_cache: ``[slots + 1, Hkv, D]`` flat caches; the last slot is all zeros.
        plan: the step's tiling.
        scale: softmax scale applied to ``q . k``.
        exp: a callable computing ``exp`` element-wise (the numerics' pointwise exp).

    Scores, softmax and the P@V fold run in float32 whatever the model dtype.
    """
    rows, hq, d = q.shape
    hkv = k_cache.shape[1]
    rep = hq // hkv
    out = q.new_zeros((rows + 1, hq, d))
    q_padded = torch.cat([q, q.new_zeros((1, hq, d))])  # row -1 reads zeros
    for group in plan.groups:
        g = group.q_rows.shape[0]
        nk = group.k_slots.shape[1] // k_tile
        qg = q_padded[group.q_rows].float().permute(0, 2, 1, 3).reshape(g, hq, 1, q_tile, d)
        kg = _expand_heads(k_cache[group.k_slots].float(), rep).view(g, nk, k_tile, hq, d)
        vg = _expand_heads(v_cache[group.k_slots].float(), rep).view(g, nk, k_tile, hq, d)
        k_t = kg.permute(0, 3, 1, 4, 2).contiguous()  # [g, hq, nk, d, Tk]
        scores = torch.matmul(qg.expand(g, hq, nk, q_tile, d).contiguous(), k_t) * scale
        scores = scores.masked_fill(~group.mask, float("-inf"))
        row_max = scores.amax(dim=(2, 4), keepdim=True)
        probs = exp(scores - row_max)  # masked: exp(-inf) = 0
        ones = vg.new_ones((g, nk, k_tile, hq, 1))
        v_aug = torch.cat([vg, ones], dim=-1).permute(0, 3, 1, 2, 4).contiguous()  # [g, hq, nk, Tk, d+1]
        partial = torch.matmul(probs, v_aug)  # [g, hq, nk, Tq, d+1]
        total = torch.cumsum(partial, dim=2)[:, :, -1]  # sequential fold in key order
        o = (total[..., :d] / total[..., d:]).to(q.dtype)  # [g, hq, Tq, d]
        flat_rows = group.q_rows.reshape(-1)
        flat_rows = torch.where(flat_rows < 0, rows, flat_rows)
        out[flat_rows] = o.permute(0, 2, 1, 3).reshape(g * q_tile, hq, d)
    return out[:rows]


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
        k = _expand_heads(k_cache[seq.slots[:ctx]], rep).transpose(0, 1)
        v = _expand_heads(v_cache[seq.slots[:ctx]], rep).transpose(0, 1)
        qs = q[seq.row_start : seq.row_start + seq.num_queries].transpose(0, 1)
        qpos = torch.arange(seq.start_pos, ctx).view(-1, 1)
        mask = torch.arange(ctx).view(1, -1) <= qpos
        o = torch.nn.functional.scaled_dot_product_attention(qs, k, v, attn_mask=mask, scale=scale)
        out[seq.row_start : seq.row_start + seq.num_queries] = o.transpose(0, 1)
    return out
