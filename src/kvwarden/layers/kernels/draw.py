"""Seeded draws of many rows in one launch: the noise, the ratio and the argmax fused, read once.

``row_math.draw_ids`` draws token ``argmax(p / E)`` per row, with ``E = -log(u)`` and ``u`` a hash of the
row's 64-bit key and the token id (``engine/randomness.py``). Written as PyTorch element-wise ops, a step
of 256 rows over a 151,936-id vocabulary builds a dozen ``[rows, vocab]`` int64 and float64 temporaries
(300 MB each): several milliseconds of memory traffic a step, as much as the model's forward. This kernel
reads the probabilities once and keeps everything else in registers.

NOTE(invariance): each element goes through the operations of ``randomness.noise_from_keys`` and
``row_math.draw_ids`` in the same order and precision: ``z = id * 0x9E3779B97F4A7C15 + key`` and
SplitMix64's finaliser in wrapping int64 arithmetic with logical right shifts (exact); ``u = (z >>> 11 &
(2^53 - 1)) + 0.5`` in float64, times ``2^-53`` (a power of two: exact); ``E = -log(u)`` and ``p / E`` in
float64 (the correctly rounded division and libdevice's ``log`` that PyTorch's CUDA kernels use). The row's
maximum ratio is exact whatever the walk order, and the token is the lowest id reaching it (each lane keeps
its first maximum; the lanes' ids are then compared), so tile size and lane layout cannot change a token.
One program per row, never reading another row: a row draws the same token in any batch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # ids per step of a row's walk

# SplitMix64's constants as the int64 bit patterns torch and Triton store (each is >= 2^63)
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)
_MIX1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MIX2 = 0x94D049BB133111EB - (1 << 64)


@triton.jit
def _lsr(z, s: tl.constexpr):
    """Logical right shift of int64 bit patterns (``>>`` on int64 is arithmetic)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


@triton.jit(do_not_specialize=["rows"])
def _draw_kernel(
    p_ptr, key_ptr, out_ptr, rows, n, stride, golden, mix1, mix2, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    key = tl.load(key_ptr + row)
    lanes = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], -1.0, tl.float64)  # a ratio is >= 0: every lane's first element beats it
    best_id = tl.full([BLOCK], 0, tl.int64)
    for start in range(0, n, BLOCK):
        ids = (start + lanes).to(tl.int64)
        mask = ids < n
        p = tl.load(p_ptr + row.to(tl.int64) * stride + ids, mask=mask, other=0.0).to(tl.float64)
        z = ids * golden + key
        z = (z ^ _lsr(z, 30)) * mix1
        z = (z ^ _lsr(z, 27)) * mix2
        z = z ^ _lsr(z, 31)
        u = ((_lsr(z, 11) & ((1 << 53) - 1)).to(tl.float64) + 0.5) * (2.0**-53)
        ratio = tl.where(mask, p / -tl.log(u), -1.0)
        take = ratio > best  # strict: a lane keeps its first (lowest) id among equal ratios
        best_id = tl.where(take, ids, best_id)
        best = tl.where(take, ratio, best)
    top = tl.max(best, axis=0)
    token = tl.min(tl.where(best == top, best_id, n), axis=0)
    tl.store(out_ptr + row, token)


def draw_tokens(probs: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """The token each row of ``probs [R, vocab]`` (float32) draws under its int64 key ``keys [R]``."""
    assert probs.dim() == 2 and probs.dtype == torch.float32 and keys.dtype == torch.int64
    probs = probs if probs.stride(-1) == 1 else probs.contiguous()
    rows, n = probs.shape
    out = torch.empty(rows, dtype=torch.int64, device=probs.device)
    if rows:
        keys = keys.contiguous().to(probs.device)
        _draw_kernel[(rows,)](
            probs, keys, out, rows, n, probs.stride(0), _GOLDEN, _MIX1, _MIX2, BLOCK=BLOCK, num_warps=8
        )
    return out
