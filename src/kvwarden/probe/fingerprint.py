"""Fingerprints of a response's top-k logprobs (docs/production-story.md §2).

Text identity is not evidence: two responses match only if every generated
token's top-k ``(token id, logprob)`` list matches bit for bit. Logprobs are
hashed from their exact IEEE-754 float64 bytes (a float32 logprob widens to
float64 exactly, and a JSON ``repr`` round-trips it exactly).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

TokenTop = Sequence[tuple[int, float]]


@dataclass(frozen=True)
class Fingerprint:
    """``ordered``: lists in the server's order; ``sorted``: each list sorted by
    token id (equal when only tied candidates were reordered); ``text``: the text."""

    ordered: str
    sorted: str
    text: str

    def short(self) -> str:
        return self.ordered[:12]


def _update(h: hashlib._Hash, tops: Sequence[TokenTop]) -> None:
    for i, top in enumerate(tops):
        h.update(struct.pack("<qq", i, len(top)))
        for token_id, logprob in top:
            h.update(struct.pack("<qd", int(token_id), float(logprob)))


def fingerprint(tops: Sequence[TokenTop], text: str = "") -> Fingerprint:
    """Fingerprint one response from its per-token top-k lists and text."""
    ordered = hashlib.sha256()
    _update(ordered, tops)
    by_id = hashlib.sha256()
    _update(by_id, [sorted(top, key=lambda p: p[0]) for top in tops])
    return Fingerprint(
        ordered=ordered.hexdigest(),
        sorted=by_id.hexdigest(),
        text=hashlib.sha256(text.encode("utf-8")).hexdigest(),
    )


def first_divergence(a: Sequence[TokenTop], b: Sequence[TokenTop]) -> int | None:
    """Index of the first generated token whose lists differ (``None`` if identical)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if [(t, struct.pack("<d", v)) for t, v in x] != [(t, struct.pack("<d", v)) for t, v in y]:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))
