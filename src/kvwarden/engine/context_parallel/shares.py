"""How a step's rows are shared among the ranks.

NOTE(invariance): a share is an ordinary chunk of each request it touches (positions ``[start + a,
start + b)`` over the request's blocks), and kvwarden's logits do not depend on where chunks are cut:
the canonical attention's key tiles are fixed to absolute positions and folded in a fixed order, and
every GEMM and row op gives a row the same bits in any batch. A rank's rows therefore come out exactly
as on one rank, once every earlier position's K/V is in its cache at that layer (the per-layer exchange).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvwarden.engine.model_runner import BatchEntry


def num_rows(entries: Sequence[BatchEntry]) -> int:
    return sum(len(e.token_ids) for e in entries)


def split_entries(entries: Sequence[BatchEntry], world: int) -> list[list[BatchEntry]]:
    """The step's rows in ``world`` contiguous shares of ``rows * r // world`` boundaries.

    A request cut by a boundary appears in both shares as two consecutive chunks. Contiguous shares
    keep each rank's rows in the step's order, so rank 0 puts the hidden rows back by concatenation.
    (Later ranks' rows see longer contexts; a zig-zag split would balance the causal attention's work,
    at the price of two chunks per request per rank.)
    """
    total = num_rows(entries)
    bounds = [total * r // world for r in range(world + 1)]
    shares: list[list[BatchEntry]] = [[] for _ in range(world)]
    row0 = 0
    for e in entries:
        n = len(e.token_ids)
        for r in range(world):
            a, b = max(bounds[r], row0) - row0, min(bounds[r + 1], row0 + n) - row0
            if a < b:
                shares[r].append(BatchEntry(e.request_id, e.token_ids[a:b], e.start + a, e.block_ids))
        row0 += n
    return shares
