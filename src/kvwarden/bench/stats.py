"""Percentiles and millisecond summaries every benchmark reports the same way."""

from __future__ import annotations

import statistics
from collections.abc import Sequence


def pct(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100) by nearest rank below; None for no values.

    NOTE: nearest rank, not interpolation, so a p99 is a latency some request really had.
    """
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


def ms(seconds: float | None) -> float | None:
    """Seconds to milliseconds rounded to 0.01 ms, None kept (JSON ``null``)."""
    return None if seconds is None else round(seconds * 1000, 2)


def latency_ms(values: Sequence[float], quantiles: Sequence[int] = (50, 90, 99)) -> dict[str, float | None]:
    """``{"mean_ms", "p50_ms", ...}`` of latencies in seconds; empty dict for no values."""
    if not values:
        return {}
    out: dict[str, float | None] = {"mean_ms": ms(statistics.fmean(values))}
    out.update({f"p{q}_ms": ms(pct(values, q)) for q in quantiles})
    return out


def fmt(value: float | None, digits: int = 1) -> str:
    """A table cell: ``-`` for a missing figure."""
    return "-" if value is None else f"{value:.{digits}f}"
