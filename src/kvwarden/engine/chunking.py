"""Chunking rules: how many of a request's remaining tokens run in one step.

``kvwarden`` (the default) takes whatever the budget allows: with canonical
numerics the chunk boundaries cannot change any number, so there is no reason
to constrain them. The legacy rules (re-creations of vLLM's hybrid align mode)
live beside it so the scheduler stays rule-agnostic.
"""

from __future__ import annotations

from typing import Protocol

from kvwarden.cache.kv_cache_manager import CacheView
from kvwarden.config import SchedulerConfig


class ChunkingRule(Protocol):
    def chunk(self, req: CacheView, start: int, max_tokens: int) -> int:
        """Tokens to compute from position ``start``, at most ``max_tokens`` (0 = wait)."""
        ...


class GreedyChunking:
    """Take as many tokens as the budget allows."""

    def chunk(self, req: CacheView, start: int, max_tokens: int) -> int:
        return max_tokens


def make_chunking_rule(config: SchedulerConfig, block_size: int) -> ChunkingRule:
    if config.chunking == "kvwarden":
        return GreedyChunking()
    raise ValueError(f"chunking: rule {config.chunking!r} needs a hybrid model")
