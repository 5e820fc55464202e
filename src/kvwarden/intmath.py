"""Integer helpers shared by the layers, caches and schedulers (block counts, padded tile sizes)."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for non-negative integers: how many ``b``-sized pieces hold ``a``."""
    return -(-a // b)


def round_up(a: int, b: int) -> int:
    """``a`` rounded up to a multiple of ``b``."""
    return cdiv(a, b) * b
