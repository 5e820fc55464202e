"""The one collective of a sharded forward pass: every rank's ``[rows, width_r]`` block, in rank order.

Blocks travel as bytes (gloo has no bfloat16, and nothing here reduces): a block arrives bit for bit as
its rank computed it. Widths may differ by rank (a vocabulary that the rank count does not divide); each
is padded to the widest, gathered, and cut back.
"""

from __future__ import annotations

import torch

from kvwarden.engine.context_parallel.group import RankGroup


class GlooColumns:
    """:class:`kvwarden.models.tensor_shard.ColumnGather` over a :class:`RankGroup`; counts bytes moved."""

    def __init__(self, group: RankGroup) -> None:
        self.group = group
        self.bytes_gathered = 0  # this rank's received bytes (what the exchange costs, for stats)
        self.calls = 0

    def all_gather(self, x: torch.Tensor, widths: list[int]) -> list[torch.Tensor]:
        rows, size = x.shape[0], x.element_size()
        widest = max(widths) * size
        raw = x.contiguous().view(torch.uint8).view(rows, -1) if rows else x.new_empty((0, 0)).view(torch.uint8)
        padded = raw.new_zeros((rows, widest))
        padded[:, : raw.shape[1]] = raw
        out = [torch.empty_like(padded) for _ in range(self.group.world)]
        self.group.pg.allgather([out], [padded]).wait()
        self.calls += 1
        self.bytes_gathered += widest * rows * (self.group.world - 1)
        return [o[:, : w * size].contiguous().view(x.dtype).view(rows, w) for o, w in zip(out, widths, strict=True)]
