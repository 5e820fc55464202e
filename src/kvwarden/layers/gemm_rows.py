"""How this machine's float32 GEMM must be called so that every row gets the bits of a 16-row call.

NOTE(invariance): MKL picks its GEMM kernel (and the order of the reduction over
``k``) from the problem shape, the thread count and the CPU. The reference is a
call of exactly 16 rows (``row_tile``) on one thread: its shape is fixed per
weight, so a row's bits there depend only on the row. Two things are measured
per weight at first use, on random rows and the real weight, nothing assumed:

* whether 16-row calls at the current thread count give the one-thread bits.
  For wide reductions they may not (here ``k = 1024, n = 3072`` differs at 2
  threads: MKL splits ``k`` across threads); such weights run on one thread, so
  ``kvwarden serve`` (all cores but one) and the Python API (all cores) agree.
* which larger call sizes reproduce the 16-row calls bit for bit. Larger calls
  are faster but agree only at some row counts, which depend on the CPU: on one
  Xeon every multiple of 16 up to 2048 agreed for every preset shape, on
  another ``k = 1536, n = 576`` disagreed for 64-192 rows at 2 threads and
  ``k = 1536, n = 3072`` from 208 rows on. A batch is cut into calls of the
  agreeing sizes only (16 always qualifies).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass

import torch

# Candidate call sizes beyond the 16-row tile: every multiple of 16 up to 64 (decode batches),
# then coarser steps (prefill chunks); a batch is cut greedily into the largest agreeing sizes.
CANDIDATES = (32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 2048)
# Multiply-adds one calibration may spend on candidates (0.01-0.06 s per shape on 2 cores): it bounds
# the largest candidate tried for a wide weight; an LM head over a large vocabulary tries none.
CALIBRATION_MACS = 2_000_000_000


@dataclass(frozen=True)
class GemmCalls:
    """How to call one weight: agreeing sizes (largest first, ending with the tile) and the threads."""

    sizes: tuple[int, ...]
    serial: bool  # the tile's bits depend on the thread count: every call runs on one thread

    def pieces(self, rows: int) -> list[int]:
        """Call sizes covering ``rows`` (a multiple of the tile), largest first: no padding beyond the
        round-up to the tile, since the tile always agrees."""
        out, left = [], rows
        for size in self.sizes:
            while left >= size:
                out.append(size)
                left -= size
        return out

    def threads(self) -> AbstractContextManager[None]:
        """One thread for a serial weight (about a microsecond to switch), the current count otherwise."""
        return torch_threads(1 if self.serial else torch.get_num_threads())


class GemmRowSizes:
    """Per weight, the calls that reproduce one-thread 16-row GEMM calls exactly (measured once)."""

    def __init__(self, tile: int = 16) -> None:
        self.tile = tile  # the reference call size (NumericsConfig.row_tile)
        self._calls: dict[tuple[int, ...], GemmCalls] = {}

    def calls(self, wt: torch.Tensor) -> GemmCalls:
        """How to compute ``x @ wt`` (``wt``: ``[k, n]``) for a float32 ``x`` of whole tiles."""
        k, n = wt.shape
        # What the library's kernel choice can depend on: shape, layout, alignment, threads. The input
        # rows are contiguous with 64-byte aligned tiles in every call the canonical linear makes.
        key = (k, n, *wt.stride(), wt.data_ptr() % 64, torch.get_num_threads())
        if key not in self._calls:
            self._calls[key] = calibrate(wt, self.tile)
        return self._calls[key]


@contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """Run torch's operators on ``count`` threads inside the block, then restore the previous count
    (the engine thread is the only caller in the engine)."""
    before = torch.get_num_threads()
    if before == count:
        yield
        return
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def calibrate(wt: torch.Tensor, tile: int) -> GemmCalls:
    """Whether ``wt`` needs one thread, and the candidate row counts whose ``torch.mm`` gives every row
    the bits of one-thread ``tile``-row calls."""
    k, n = wt.shape
    budget = CALIBRATION_MACS // (4 * k * n)  # references + all candidates: under 4x the largest
    tried = [c for c in CANDIDATES if c <= budget and c > tile and c % tile == 0]
    gen = torch.Generator().manual_seed(k * 7919 + n)
    x = torch.randn(max([tile, *tried]), k, generator=gen)

    def tiles() -> torch.Tensor:
        return torch.cat([torch.mm(x[i : i + tile], wt) for i in range(0, x.shape[0], tile)])

    with torch_threads(1):
        ref = tiles()
    serial = torch.get_num_threads() > 1 and not torch.equal(tiles(), ref)
    with torch_threads(1 if serial else torch.get_num_threads()):
        agree = [c for c in tried if torch.equal(torch.mm(x[:c], wt), ref[:c])]
    return GemmCalls(sizes=(*sorted(agree, reverse=True), tile), serial=serial)
