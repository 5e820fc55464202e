"""Canonical paged attention for the CPU: a query's output is a function of its position and the keys only.

NOTE(invariance) - the library facts and the decisions built on them:

* MKL's float32 GEMM computes an output row from its input row and the right
  operand alone, in the same order wherever the row sits, for every row count
  that is a multiple of 4 (a tail of 1-3 rows below 12 takes another path), and
  never reduces across output columns, so the key count ``n`` of ``q @ K^T``
  cannot change a score; a transposed right operand gives the same bits, and
  ``bmm`` does not depend on its batch count. ``tests/test_numerics.py`` pins
  all of it. So a query's scores do not depend on which other queries share its
  product: a decode step packs the ``rep`` query heads sharing a kv head into
  ``round_up(rep, 4)`` rows instead of padding a tile of positions, and a
  prefill chunk's tiles of ``key_tile`` positions use ``rep * key_tile`` rows.
* The softmax max is an exact ``amax`` over the visible keys (order-free);
  ``exp`` runs in one call padded to whole SIMD blocks per thread (position-free).
* ``P @ [V | 1]`` per key tile of ``key_tile`` keys aligned to absolute
  position 0 gives the numerator and the row sum in one fixed-shape
  ``(M x Tk) @ (Tk x D+1)`` product; tiles are summed in a pairwise tree fixed
  by tile index, so trailing tiles past a query's context add exact zeros.
* Keys past the context read the all-zero null slot: masked products are
  ``0 * finite`` and never NaN.

Cost: a group of items is padded to its longest key range (items are sorted
by key count first, so neighbours are alike), and a decode step computes at
most 3 padding rows per (request, kv head).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvwarden.intmath import round_up
from kvwarden.layers.attention import AttentionPlan, SeqAttn

# Score elements (queries x keys) per kv head that one batched call may hold, and the most padding
# (as a share of the computed keys) a group may add: they bound memory and waste only, since a
# query's result does not depend on its group.
GROUP_BUDGET = 1 << 18
GROUP_PADDING = 1.5


@dataclass(frozen=True)
class TileGroup:
    """Query items of one shape, processed by one batched call.

    An item is one request's queries that share one key range: a decode query
    (``Q = 1``) or a position-aligned tile of a prefill chunk (``Q = key_tile``).
    """

    q_rows: torch.Tensor  # [G, Q] row of each query in the batch, -1 for a padding slot
    q_pos: torch.Tensor  # [G, Q] absolute position of each query, -1 for a padding slot
    kv_slots: torch.Tensor  # [G, n] cache slot of key position j (the null slot past the context)
    _heads: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(
        default_factory=dict, compare=False
    )

    def head_rows(self, hq: int, hkv: int, num_rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Index ``[G, Hkv, M]`` of each GEMM row into ``q`` viewed as ``[rows * Hq + 1, D]`` (padding
        reads the last, all-zero row), index ``[G, Hkv, n]`` of each key into the cache viewed as
        ``[slots * Hkv, D]``, and the mask ``[G, 1, M, n]`` of keys a row must not see; computed once
        per step and shared by every attention layer.

        Row ``r * Q + i`` of kv head ``h`` is query ``i``'s head ``h * rep + r``; ``M`` is ``rep * Q``
        rounded up to a multiple of 4 (see the module note).
        """
        key = (hq, hkv)
        if key not in self._heads:
            self._heads[key] = self._build_heads(hq, hkv, num_rows)
        return self._heads[key]

    def _build_heads(self, hq: int, hkv: int, num_rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        g, q = self.q_rows.shape
        rep = hq // hkv
        m = round_up(rep * q, 4)
        pad_row = num_rows * hq
        heads = torch.arange(hkv * rep).view(1, hkv, rep, 1)
        idx = self.q_rows.view(g, 1, 1, q) * hq + heads
        idx = torch.where(self.q_rows.view(g, 1, 1, q) >= 0, idx, pad_row).reshape(g, hkv, rep * q)
        n = self.kv_slots.shape[1]
        # visible: key position <= query position (padding slots have position -1: nothing visible)
        vis = torch.arange(n).view(1, 1, n) <= self.q_pos.view(g, q, 1)
        vis = vis.view(g, 1, q, n).expand(g, rep, q, n).reshape(g, 1, rep * q, n)
        if m > rep * q:
            idx = torch.cat([idx, idx.new_full((g, hkv, m - rep * q), pad_row)], dim=2)
            vis = torch.cat([vis, vis.new_zeros((g, 1, m - rep * q, n))], dim=2)
        kv_idx = self.kv_slots.view(g, 1, n) * hkv + torch.arange(hkv).view(1, hkv, 1)
        return idx, kv_idx, ~vis


def build_tile_plan(seqs: list[SeqAttn], num_rows: int, k_tile: int, null_slot: int) -> AttentionPlan:
    """Cut the step's queries into items and group them.

    Items: a decode query alone; a prefill chunk's queries in tiles of ``k_tile``
    positions aligned to position 0 (the causal diagonal then falls inside one key
    tile). Items of one query count are sorted by key range and grouped under
    :data:`GROUP_BUDGET` and :data:`GROUP_PADDING`.
    """
    q_tile = k_tile
    items: dict[int, list[tuple[int, list[int], list[int], SeqAttn]]] = {}
    for seq in seqs:
        end = seq.start_pos + seq.num_queries
        if seq.num_queries == 1:
            n = round_up(end, k_tile)
            items.setdefault(1, []).append((n, [seq.row_start], [seq.start_pos], seq))
            continue
        for tile in range(seq.start_pos // q_tile, (end - 1) // q_tile + 1):
            pos = range(tile * q_tile, (tile + 1) * q_tile)
            real = [seq.start_pos <= p < end for p in pos]
            rows = [seq.row_start + p - seq.start_pos if ok else -1 for p, ok in zip(pos, real, strict=True)]
            qpos = [p if ok else -1 for p, ok in zip(pos, real, strict=True)]
            n = round_up(max(qpos) + 1, k_tile)
            items.setdefault(q_tile, []).append((n, rows, qpos, seq))
    groups: list[TileGroup] = []
    for q, group_items in items.items():
        group_items.sort(key=lambda item: item[0])
        start = 0
        while start < len(group_items):
            end, keys = start + 1, group_items[start][0]
            while end < len(group_items):
                n = group_items[end][0]  # sorted: the group's new longest key range
                count = end - start + 1
                if count * q * n > GROUP_BUDGET or count * n > GROUP_PADDING * (keys + n):
                    break
                end, keys = end + 1, keys + n
            groups.append(_make_group(group_items[start:end], null_slot))
            start = end
    return AttentionPlan(seqs=tuple(seqs), groups=tuple(groups), num_rows=num_rows)


def _make_group(items: list[tuple[int, list[int], list[int], SeqAttn]], null_slot: int) -> TileGroup:
    n = items[-1][0]  # sorted: the longest key range
    kv_slots = torch.full((len(items), n), null_slot, dtype=torch.long)
    for i, (_, _, qpos, seq) in enumerate(items):
        ctx = max(qpos) + 1
        kv_slots[i, :ctx] = seq.slots[:ctx]
    q_rows = torch.tensor([rows for _, rows, _, _ in items], dtype=torch.long)
    q_pos = torch.tensor([qpos for _, _, qpos, _ in items], dtype=torch.long)
    return TileGroup(q_rows=q_rows, q_pos=q_pos, kv_slots=kv_slots)


def canonical_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: AttentionPlan,
    scale: float,
    exp: Callable[[torch.Tensor], torch.Tensor],
    k_tile: int,
) -> torch.Tensor:
    """Attention of ``q [rows, Hq, D]`` (rope applied) over the paged cache.

    Args:
        q: the step's queries.
        k_cache: ``[slots, Hkv, D]`` flat cache; the null slot is all zeros.
        v_cache: ``[slots, Hkv, D + 1]``: V plus a ones column (zero in the null slot).
        plan: the step's items and groups (:func:`build_tile_plan`).
        scale: softmax scale applied to ``q . k``.
        exp: the numerics' element-wise ``exp``.
        k_tile: keys per ``P @ V`` tile.

    Scores, softmax and the P@V fold run in float32 whatever the model dtype.
    """
    rows, hq, d = q.shape
    # NOTE: padding rows of every group point at row rows * hq, the discarded sink below; a plan built
    # for another row count would point them at a real row.
    if rows != plan.num_rows:
        raise ValueError(f"attention plan built for {plan.num_rows} rows, called with {rows}")
    hkv = k_cache.shape[1]
    q_flat = torch.cat([q.reshape(rows * hq, d).float(), q.new_zeros((1, d), dtype=torch.float32)])
    k_flat = k_cache.view(-1, d)
    v_flat = v_cache.view(-1, d + 1)
    out = q_flat.new_empty((rows * hq + 1, d))
    for group in plan.groups:
        q_idx, kv_idx, hidden = group.head_rows(hq, hkv, rows)
        g, _, m = q_idx.shape
        n = group.kv_slots.shape[1]
        nk = n // k_tile
        # index_select over flat row indices: the same rows as advanced indexing, 3-4x faster on the CPU.
        qg = q_flat.index_select(0, q_idx.view(-1)).view(g * hkv, m, d)
        kg = k_flat.index_select(0, kv_idx.view(-1)).float().view(g * hkv, n, d)
        # NOTE(invariance): rows m (a multiple of 4) and inner size d fixed by the model; the key
        # count n and the row's neighbours cannot change its scores (module note).
        # The scale, mask and max subtraction run in place on the product's buffer: the same IEEE
        # operations element by element, without three more score-sized allocations (the largest
        # tensors of a prefill step; each fresh one costs its page faults again).
        scores = torch.bmm(qg, kg.transpose(1, 2)).view(g, hkv, m, n).mul_(scale)
        scores.masked_fill_(hidden, float("-inf"))
        # Padding rows see nothing: clamping their max to a finite value keeps them at exp(-inf) = 0
        # instead of NaN; a real row's max is finite and unchanged.
        peak = scores.amax(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).min)
        probs = exp(scores.sub_(peak))
        probs = probs.view(g * hkv, m, nk, k_tile).transpose(1, 2).reshape(g * hkv * nk, m, k_tile)
        v_aug = v_flat.index_select(0, kv_idx.view(-1)).float().view(g * hkv * nk, k_tile, d + 1)
        partial = torch.bmm(probs, v_aug).view(g * hkv, nk, m, d + 1)  # fixed [m, Tk] @ [Tk, d+1] per tile
        total = _tree_fold(partial)  # [g*hkv, m, d+1]
        # Each real (query, head) row is written once; padding rows all land on the discarded last row.
        out.index_copy_(0, q_idx.view(-1), (total[..., :d] / total[..., d:]).reshape(-1, d))
    return out[: rows * hq].view(rows, hq, d).to(q.dtype)


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
