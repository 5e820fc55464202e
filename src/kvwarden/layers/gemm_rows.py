"""Row counts at which this machine's float32 GEMM computes every row as a 16-row call does.

NOTE(invariance): MKL picks its GEMM kernel (and the order of the reduction over
``k``) from the problem shape and the CPU. A 16-row call is the canonical
reference: its shape is fixed per weight, so a row's bits there depend only on
the row. Larger calls are faster (one call instead of one per 16 rows) but give
the same bits only for some row counts, and which ones depends on the CPU: on
one Xeon every multiple of 16 up to 2048 agreed for every preset shape, on
another ``k = 1536, n = 576`` disagreed for 64-192 rows and ``k = 1536,
n = 3072`` from 208 rows on. So nothing is assumed: for each weight (and thread
count) the first call measures, on random rows and the real weight, which
candidate row counts reproduce the 16-row calls bit for bit, and a batch is
then cut into calls of those sizes only (16 always qualifies).
"""

from __future__ import annotations

import torch

# Candidate call sizes beyond the 16-row tile: every multiple of 16 up to 64 (decode batches),
# then coarser steps (prefill chunks); a batch is cut greedily into the largest agreeing sizes.
CANDIDATES = (32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 2048)
# Multiply-adds one calibration may spend (about 0.1 s on 2 cores): it bounds the largest candidate
# tried for a wide weight (the LM head tries small calls only).
CALIBRATION_MACS = 2_000_000_000


class GemmRowSizes:
    """Per weight shape, the call sizes that reproduce 16-row GEMM calls exactly (measured once)."""

    def __init__(self, tile: int = 16) -> None:
        self.tile = tile  # the reference call size (NumericsConfig.row_tile)
        self._sizes: dict[tuple[int, ...], tuple[int, ...]] = {}

    def sizes(self, wt: torch.Tensor) -> tuple[int, ...]:
        """Agreeing call sizes for ``x @ wt`` (``wt``: ``[k, n]``), largest first; ends with the tile."""
        k, n = wt.shape
        # What the library's kernel choice can depend on: shape, layout, alignment, threads.
        key = (k, n, *wt.stride(), wt.data_ptr() % 64, torch.get_num_threads())
        if key not in self._sizes:
            self._sizes[key] = calibrate(wt, self.tile)
        return self._sizes[key]

    def pieces(self, rows: int, wt: torch.Tensor) -> list[int]:
        """Call sizes covering ``rows`` (a multiple of the tile), largest first: no padding beyond the
        round-up to the tile, since the tile always agrees."""
        out, left = [], rows
        for size in self.sizes(wt):
            while left >= size:
                out.append(size)
                left -= size
        return out


def calibrate(wt: torch.Tensor, tile: int) -> tuple[int, ...]:
    """Candidate row counts whose ``torch.mm`` gives every row the bits of ``tile``-row calls."""
    k, n = wt.shape
    budget = CALIBRATION_MACS // (3 * k * n)  # reference + candidates cost about 3x the largest
    tried = [c for c in CANDIDATES if c <= budget and c > tile and c % tile == 0]
    if not tried:
        return (tile,)
    gen = torch.Generator().manual_seed(k * 7919 + n)
    x = torch.randn(tried[-1], k, generator=gen)
    ref = torch.cat([torch.mm(x[i : i + tile], wt) for i in range(0, x.shape[0], tile)])
    agree = [c for c in tried if torch.equal(torch.mm(x[:c], wt), ref[:c])]
    return (*sorted(agree, reverse=True), tile)
