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


class LegacyAlignChunking:
    """vLLM's hybrid align-mode rule (``Scheduler._mamba_block_aligned_split``).

    During prefill: ``last = num_tokens - num_tokens % B``, pulled back one
    block when speculative decoding is on. A chunk ending before ``last`` is
    rounded down to a multiple of B (its *size*, so it may cross several
    boundaries); a chunk crossing ``last`` is cut there; the tail past
    ``last`` is left as it is. A recurrent state is saved only where a chunk
    ends exactly on a block boundary (:func:`kvwarden.layers.chunked_scan.vendor_scan`).

    ``fixed=True`` is the one-line fix: every crossed block boundary also ends
    a chunk, so a state exists at every boundary.
    """

    def __init__(self, block_size: int, speculative: bool, fixed: bool) -> None:
        self.block_size = block_size
        self.speculative = speculative
        self.fixed = fixed

    def chunk(self, req: CacheView, start: int, max_tokens: int) -> int:
        b = self.block_size
        num_tokens = len(req.all_token_ids)
        prompt = getattr(req, "num_prompt_tokens", num_tokens)
        if start >= max(prompt, num_tokens - 1):
            return max_tokens  # decode
        last = num_tokens - num_tokens % b
        if self.speculative:
            last = max(last - b, 0)
        n = max_tokens
        end = start + n
        if end < last:
            n = n // b * b
        elif start < last < end:
            n = last - start
        if self.fixed:
            n = min(n, (start // b + 1) * b - start)
        return n


def make_chunking_rule(config: SchedulerConfig, block_size: int, speculative: bool = False) -> ChunkingRule:
    """The configured rule; ``speculative`` (speculative decoding on) drives the legacy pull-back."""
    if config.chunking == "kvwarden":
        return GreedyChunking()
    fixed = config.chunking == "legacy-align-fixed"
    return LegacyAlignChunking(block_size, speculative, fixed)
