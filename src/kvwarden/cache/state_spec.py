"""What one recurrent layer's state is made of, and the bytes it takes (the state pool's and the budget's).

The state pool allocates from these shapes; the engine's memory budget
(:mod:`kvwarden.engine.memory`) counts with the same functions, so the two
never disagree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class RecurrentLayerSpec:
    """Shapes of one recurrent layer's state (float32)."""

    conv_shape: tuple[int, int]  # (K - 1, conv channels)
    ssm_shape: tuple[int, ...]
    feature_dim: int  # packed per-token features kept for the pending rows
    grid_ring: bool = False  # the GPU's chunked scan keeps the raw rows since the grid point, ``feature_dim`` wide
    scan_scratch: bool = False  # ... and a per-chunk scratch between its two phases (gated delta)

    def snapshot_numel(self) -> int:
        return self.conv_shape[0] * self.conv_shape[1] + math.prod(self.ssm_shape)


def ring_shape(spec: RecurrentLayerSpec, chunk: int) -> tuple[int, int]:
    """A working slot's ring of pending rows for the GPU's chunked scan (empty for other layers)."""
    return (2 * chunk, spec.feature_dim) if spec.grid_ring else (0, 0)


def scan_scratch_bytes(specs: list[RecurrentLayerSpec], chunk: int, rows: int, seqs: int) -> int:
    """The GPU chunked scan's scratch for one layer of a step of ``rows`` rows over ``seqs`` requests
    (``W``, ``q e^g``, ``k e^{g_last - g}``, ``U`` and ``P`` per grid chunk and head; float32)."""
    worst = 0
    for s in specs:
        if s.scan_scratch:
            heads, dk, dv = s.ssm_shape
            dk, dv = (max(16, 1 << (d - 1).bit_length()) for d in (dk, dv))  # the kernel's padded blocks
            worst = max(worst, 4 * heads * (3 * chunk * dk + chunk * dv + chunk * chunk + 1))
    return worst * (rows // chunk + 2 * seqs)  # each request's chunks: its rows' plus at most two partial


def ring_bytes(specs: list[RecurrentLayerSpec], chunk: int) -> int:
    """One working slot's rings, every layer (float32)."""
    return 4 * sum(math.prod(ring_shape(s, chunk)) for s in specs)
