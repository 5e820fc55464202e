"""Counter-based randomness for seeded sampling: every number a pure function of (seed, position, stream, id).

NOTE(invariance): no generator carries state between steps or requests. A 64-bit key hashes the seed and
the position (SplitMix64, exact integer arithmetic on every device); each token id's uniform number hashes
the key and the id, so a draw depends on nothing but the seed, the position and the row's distribution:
not on batch partners, preemption, earlier draws or speculative decoding (``sampler.py`` uses it).
"""

from __future__ import annotations

import torch

_MASK64 = (1 << 64) - 1


def draw_from(probs: torch.Tensor, seed: int, position: int, stream: int = 0) -> int:
    """One draw from ``probs`` keyed by ``(seed, position, stream)`` alone.

    Exponential race: argmax(p / E) with E ~ Exp(1) draws exactly from p. The
    maximum is exact; among equal ratios the lowest id wins. ``stream`` > 0
    gives independent draws for the same position (rejection sampling's
    residual); the default stream is the one plain decoding uses.
    """
    key = position if stream == 0 else position ^ (stream << 56)
    ratio = probs.double() / exponential_noise(seed, key, probs.numel(), probs.device)
    return int(torch.nonzero(ratio == ratio.max())[0, 0])


def uniform(seed: int, position: int, stream: int) -> float:
    """One uniform number in (0, 1) keyed by ``(seed, position, stream)``."""
    return float(torch.exp(-exponential_noise(seed, position ^ (stream << 56), 1, "cpu"))[0])  # E = -log(u)


def draw_key(seed: int, position: int) -> int:
    """The 64-bit counter key of the draw for ``position`` under ``seed`` (each id's noise hashes it)."""
    return _splitmix(_splitmix(seed & _MASK64) ^ (position & _MASK64))


def exponential_noise(seed: int, position: int, n: int, device: torch.device | str) -> torch.Tensor:
    """``-log(u)`` for ``u`` uniform in (0, 1), one per token id, a pure function of (seed, position, id)."""
    key = torch.tensor(signed64(draw_key(seed, position)), dtype=torch.int64, device=device)
    return noise_from_keys(key, n, device)


def noise_from_keys(key: torch.Tensor, n: int, device: torch.device | str) -> torch.Tensor:
    """``-log(u)`` for ids ``0..n-1`` under each key (a 0-d key: ``[n]``; keys ``[R, 1]``: ``[R, n]``)."""
    ids = torch.arange(n, dtype=torch.int64, device=device)
    bits = _mix_tensor(ids * signed64(0x9E3779B97F4A7C15) + key)
    u = ((bits >> 11) & ((1 << 53) - 1)).double().add_(0.5).mul_(2.0**-53)  # 53 random bits, never 0 or 1
    return -torch.log(u)


def signed64(value: int) -> int:
    """A 64-bit pattern as the int64 torch stores it."""
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


def _splitmix(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _mix_tensor(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser on int64 tensors (wrapping multiplication, logical shifts)."""
    z = (z ^ _lsr(z, 30)) * signed64(0xBF58476D1CE4E5B9)
    z = (z ^ _lsr(z, 27)) * signed64(0x94D049BB133111EB)
    return z ^ _lsr(z, 31)


def _lsr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's ``>>`` on int64 is arithmetic)."""
    return (z >> s) & ((1 << (64 - s)) - 1)
