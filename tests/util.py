"""Test helpers: exact comparison of logprob lists (no tolerance anywhere)."""

from __future__ import annotations

import random
import struct

from kvwarden import RequestOutput


def exact(logprobs: list[list[tuple[int, float]]] | None) -> list[list[tuple[int, bytes]]]:
    """Logprob lists with every float replaced by its IEEE-754 bytes."""
    assert logprobs is not None, "request did not return logprobs"
    return [[(int(t), struct.pack("<d", v)) for t, v in step] for step in logprobs]


def assert_same(a: RequestOutput, b: RequestOutput, what: str = "") -> None:
    """Bitwise identity of two outputs: token ids and every top-k (id, logprob) pair."""
    assert a.token_ids == b.token_ids, f"{what}: tokens differ {a.token_ids} vs {b.token_ids}"
    ea, eb = exact(a.logprobs), exact(b.logprobs)
    for i, (x, y) in enumerate(zip(ea, eb, strict=True)):
        assert x == y, f"{what}: top-k list of token {i} differs"


def random_tokens(rng: random.Random, n: int, vocab: int, low: int = 3) -> list[int]:
    """n random token ids, avoiding the special tokens at the start of the vocabulary."""
    return [rng.randrange(low, vocab) for _ in range(n)]
