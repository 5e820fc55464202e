"""The per-step description of a paged attention launch: each request's rows and the query tiles.

Built once per step on the host (the Triton backend's ``attention_plan``) and read by every layer's
launch of :mod:`kvwarden.layers.kernels.attention`, whose docstring gives the invariance argument the
tile grid serves: query tiles are aligned to absolute positions, ``BLOCK_Q`` positions each (the engine
builds every meta with ``BLOCK_Q``; other tile sizes are for ``bench/attention_tiles.py --query-tiles`` only).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK_Q = 16  # query positions per tile (aligned to absolute position)


@dataclass(frozen=True)
class AttentionMeta:
    """Device tensors describing one step's requests and query tiles (built once per step).

    Attributes:
        seq_row0, seq_start, seq_nq: per request, its first row in the batch, the
            absolute position of its first query and its number of queries.
        block_tables: ``[requests, max_blocks]`` int32 KV block ids.
        tile_seq, tile_pos0: per query tile, its request and the absolute position
            of its first slot (a multiple of ``block_q``).
        max_keys: a bound on the step's longest context, which sizes the parallel splits: the
            exact figure in an eager step, the longest context served in a captured graph (whose
            steps' contexts vary; splits past a tile's keys then exit at once). 0: walk the splits.
        block_q: the query positions per tile the tiles were built for (the launch's tile size):
            ``BLOCK_Q`` for every engine step; others for ``bench/attention_tiles.py`` only.
    """

    seq_row0: torch.Tensor
    seq_start: torch.Tensor
    seq_nq: torch.Tensor
    block_tables: torch.Tensor
    tile_seq: torch.Tensor
    tile_pos0: torch.Tensor
    max_keys: int = 0
    block_q: int = BLOCK_Q

    @classmethod
    def build(
        cls, seqs: list[tuple[int, int, int, list[int]]], device: torch.device | str, block_q: int = BLOCK_Q
    ) -> AttentionMeta:
        """From ``(row_start, start_pos, num_queries, block_ids)`` per request; tiles of ``block_q`` positions."""
        max_blocks = max((len(b) for *_, b in seqs), default=1) or 1
        tables = [b + [0] * (max_blocks - len(b)) for *_, b in seqs]
        tile_seq, tile_pos0 = [], []
        for i, (_, start, nq, _) in enumerate(seqs):
            for t in range(start // block_q, (start + nq - 1) // block_q + 1):
                tile_seq.append(i)
                tile_pos0.append(t * block_q)

        def t(values: list) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int32).to(device, non_blocking=True)

        return cls(
            seq_row0=t([s[0] for s in seqs]),
            seq_start=t([s[1] for s in seqs]),
            seq_nq=t([s[2] for s in seqs]),
            block_tables=t(tables),
            tile_seq=t(tile_seq),
            tile_pos0=t(tile_pos0),
            max_keys=max((start + nq for _, start, nq, _ in seqs), default=0),
            block_q=block_q,
        )
