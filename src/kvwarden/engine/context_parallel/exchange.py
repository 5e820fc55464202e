"""Moving K/V rows between the ranks' caches: per layer inside a split step, and after a rank-0 step.

Without the layer split every rank keeps a full copy of every attention layer's cache, in the same
slots (rank 0's block tables are the only ones; the workers' pools are never allocated from, only
written). So a prefix hit, a preemption or a finished request needs nothing from the workers: the
slots hold the same bits on every rank. (The layer split's exchange is ``layer_split.SplitExchange``.)
"""

from __future__ import annotations

import torch

from kvwarden.engine.context_parallel.group import RankGroup, as_bytes
from kvwarden.engine.model_runner import BatchEntry, ModelRunner

KV = tuple[torch.Tensor, ...]  # one layer's cache tensors (or several layers' at once)


def rows_bytes(kv: KV, slots: torch.Tensor) -> torch.Tensor:
    """One layer's cache rows at ``slots`` (K then V, or GLM-5's latent then indexer key) as byte rows."""
    return torch.cat([as_bytes(t[slots]) for t in kv], 1)


def _width(t: torch.Tensor) -> int:
    return t[0].numel() * t.element_size()


def row_width(kv: KV) -> int:
    return sum(_width(t) for t in kv)


def write_rows(kv: KV, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """The inverse of :func:`rows_bytes`: byte rows written into the layer's cache at ``slots``."""
    col = 0
    for t in kv:
        width = _width(t)
        part = rows[:, col : col + width].contiguous().view(t.dtype).view(rows.shape[0], *t.shape[1:])
        t.index_copy_(0, slots, part)
        col += width


class KVExchange:
    """Called by each attention layer between writing its rows' K/V and reading the cache.

    NOTE(invariant): every rank calls it once per attention layer of the model, in layer order (the
    model's forward is the same code on every rank), so the collectives pair up without a tag.
    """

    def __init__(self, group: RankGroup, slots: list[torch.Tensor]) -> None:
        self.group, self.slots = group, slots
        self.counts = [len(s) for s in slots]

    def __call__(self, kv: KV) -> None:
        rank = self.group.rank
        parts = self.group.all_gather_rows(rows_bytes(kv, self.slots[rank]), self.counts)
        for r, part in enumerate(parts):
            if r != rank:
                write_rows(kv, self.slots[r], part)


def sync_rows(runner: ModelRunner, entries: list[BatchEntry], group: RankGroup) -> None:
    """After a step rank 0 ran alone: its new K/V rows of every layer, copied into the other ranks' caches
    (every layer's tensors as one row of bytes per slot, one broadcast)."""
    slots = runner.slot_rows(entries).to(runner.device)
    tensors = tuple(t for i in range(len(runner.kv_caches)) for t in runner.kv_caches[i])
    if group.rank == 0:
        payload = rows_bytes(tensors, slots)
    else:
        payload = torch.empty((len(slots), row_width(tensors)), dtype=torch.uint8, device=runner.device)
    group.broadcast_rows(payload)
    if group.rank != 0:
        write_rows(tensors, slots, payload)
