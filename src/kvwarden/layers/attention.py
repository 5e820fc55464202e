"""Paged causal attention: a canonical tiled kernel and a shape-dependent one.

Canonical kernel (NOTE(invariance) - every decision below keeps a query's output
a function of its absolute position and the keys' contents only):

* Queries are cut into tiles of ``Tq`` rows aligned to absolute position
  (tile ``p // Tq``, slot ``p % Tq``); keys into tiles of ``Tk`` aligned to
  position 0. A (query, key) pair therefore always sits at the same slot of a
  fixed-shape ``(Tq x D) @ (D x Tk)`` product, however the request was chunked.
* GQA: the ``rep`` query heads sharing a kv head become ``rep * Tq`` rows of
  one product, so K and V are never copied per query head.
* ``q . k`` is one ``(rep*Tq x D) @ (D x N)`` product per (query tile, kv head),
  ``N`` = keys of the group. Rows and inner size are fixed; a GEMM does not
  reduce across columns, so ``N`` cannot change a score (measured for every
  head_dim, and ``bmm`` does not depend on its batch count either;
  ``tests/test_numerics.py`` keeps checking both).
* The softmax max is an exact ``amax`` over all valid keys (order-free).
* ``P @ [V | 1]`` per key tile gives the numerator and the row sum in one
  fixed-shape ``(rep*Tq x Tk) @ (Tk x D+1)`` product; tiles are summed in a
  pairwise tree fixed by tile index, so trailing fully-masked tiles add exact
  zeros and change nothing.
* Keys past the context read a dedicated all-zero slot, so masked products are
  ``0 * finite`` and never NaN.

Cost: queries are padded to ``Tq`` (decode wastes Tq-1 of every Tq rows of the
score product) and key tiles up to the longest item in a group are computed.
"""

from __future__ import annotations

from collections.abc import Callable
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
class TileGroup:
    """Query tiles processed by one batched call (canonical kernel)."""

    q_rows: torch.Tensor  # [G, Tq] row in the batch, or -1 for a padding slot
    k_slots: torch.Tensor  # [G, nk * Tk] cache slot per key (null slot past the context)
    mask: torch.Tensor  # [G, 1, 1, Tq, nk * Tk] True where the key is visible to the query


@dataclass(frozen=True)
class AttentionPlan:
    """Everything the attention layers need for one step, built once per step."""

    seqs: tuple[SeqAttn, ...]
    groups: tuple[TileGroup, ...]
    num_rows: int
    meta: Any = None  # a GPU backend's own per-step tensors (kernels/attention.AttentionMeta)


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
    visible = k_pos.view(g, 1, 1, 1, nk * k_tile) <= q_pos.view(g, 1, 1, q_tile, 1)
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
        k_cache: ``[slots + 1, Hkv, D]`` flat cache; the last slot is all zeros.
        v_cache: ``[slots + 1, Hkv, D + 1]``: V plus a ones column (zero in the last slot).
        plan: the step's tiling.
        scale: softmax scale applied to ``q . k``.
        exp: a callable computing ``exp`` element-wise (the numerics' pointwise exp).

    Scores, softmax and the P@V fold run in float32 whatever the model dtype.
    """
    rows, hq, d = q.shape
    hkv = k_cache.shape[1]
    rep = hq // hkv
    m = rep * q_tile  # GEMM rows per (query tile, kv head): the GQA group's queries
    out = q.new_zeros((rows + 1, hq, d))
    q_padded = torch.cat([q, q.new_zeros((1, hq, d))])  # row -1 reads zeros
    for group in plan.groups:
        g = group.q_rows.shape[0]
        n = group.k_slots.shape[1]
        nk = n // k_tile
        # [g, Tq, hkv, rep, d] -> [g*hkv, rep*Tq, d]
        qg = q_padded[group.q_rows].float().view(g, q_tile, hkv, rep, d).permute(0, 2, 3, 1, 4).reshape(g * hkv, m, d)
        kg = k_cache[group.k_slots].float().permute(0, 2, 3, 1).reshape(g * hkv, d, n)
        # NOTE(invariance): one product per (tile, head) with fixed rows m and inner
        # size d; only the column count n varies, and a GEMM never reduces across
        # columns (checked for every head_dim in tests/test_numerics.py).
        scores = torch.bmm(qg, kg).view(g, hkv, rep, q_tile, n) * scale
        scores = scores.masked_fill(~group.mask, float("-inf"))
        probs = exp(scores - scores.amax(dim=-1, keepdim=True))  # masked: exp(-inf) = 0
        probs = probs.view(g * hkv, m, nk, k_tile).transpose(1, 2).contiguous()  # [g*hkv, nk, m, Tk]
        # The V cache carries a ones column (see ModelRunner): P @ [V | 1] -> numerator and row sum.
        v_aug = v_cache[group.k_slots].float()
        v_aug = v_aug.view(g, nk, k_tile, hkv, d + 1).permute(0, 3, 1, 2, 4).reshape(g * hkv, nk, k_tile, d + 1)
        partial = torch.matmul(probs, v_aug)  # fixed [m, Tk] @ [Tk, d+1] per tile
        total = _tree_fold(partial)  # [g*hkv, m, d+1]
        o = (total[..., :d] / total[..., d:]).view(g, hkv, rep, q_tile, d)
        o = o.permute(0, 3, 1, 2, 4).reshape(g * q_tile, hq, d).to(q.dtype)
        flat_rows = group.q_rows.reshape(-1)
        out[torch.where(flat_rows < 0, rows, flat_rows)] = o
    return out[:rows]


def _tree_fold(partial: torch.Tensor) -> torch.Tensor:
    """Sum ``partial[:, t]`` over key tiles ``t`` in a pairwise tree fixed by tile index.

    NOTE(invariance): level by level, tiles (0,1), (2,3), ... are added; an odd
    last tile moves up unchanged (the same as adding a zero tile). Tile t always
    sits at the same leaf and tiles past a query's context hold exact zeros, so
    computing more tiles only adds ``+ 0``: the sum does not depend on how many
    tiles the group happened to compute.
    """
    x = partial
    while x.shape[1] > 1:
        n = x.shape[1]
        pairs = x[:, 0 : n - 1 : 2] + x[:, 1:n:2]
        x = torch.cat([pairs, x[:, n - 1 :]], dim=1) if n % 2 else pairs
    return x[:, 0]


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
