"""KV blocks and recurrent states under one narrow API (the scheduler cannot tell).

A hybrid prefix hit is the longest run of cached KV blocks whose *last* block
boundary also has a cached recurrent state: the attention layers need the KV
of every position, the recurrent layers only the state at the hit boundary.
States are their own cache entries keyed by block hash (see
:mod:`kvwarden.cache.state_pool`), published after the step that computed
them, only for blocks whose KV is published too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from kvwarden.cache.block_pool import Block, BlockPool
from kvwarden.cache.hashing import extend_hashes
from kvwarden.cache.kv_cache_manager import CacheView, KVCacheManager
from kvwarden.cache.state_pool import StatePool

if TYPE_CHECKING:
    from kvwarden.cache.host_tier import HostHit, HostTier


class HybridCacheManager:
    """Same verbs as :class:`KVCacheManager`; adds the recurrent working state and snapshots."""

    def __init__(self, kv: KVCacheManager, states: StatePool) -> None:
        self.kv = kv
        self.states = states
        kv.pool.on_evict = states.evict

    # The scheduler and runner read these as on KVCacheManager.
    @property
    def pool(self) -> BlockPool:
        return self.kv.pool

    @property
    def block_size(self) -> int:
        return self.kv.block_size

    @property
    def query_tokens(self) -> int:
        return self.kv.query_tokens

    @property
    def hit_tokens(self) -> int:
        return self.kv.hit_tokens

    @property
    def req_blocks(self) -> dict[str, list[Block]]:
        return self.kv.req_blocks

    def attach_host(self, host: HostTier) -> None:
        self.kv.attach_host(host)

    def block_ids(self, request_id: str) -> list[int]:
        return self.kv.block_ids(request_id)

    def block_row(self, request_id: str) -> np.ndarray:
        return self.kv.block_row(request_id)

    def record_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.kv.record_query(num_tokens, num_hit_tokens)

    def get_computed_blocks(self, req: CacheView) -> tuple[list[Block | HostHit], int]:
        """KV hit, cut back to the last block whose end boundary has a cached state (either tier)."""
        hits, _ = self.kv.get_computed_blocks(req)
        while hits and not self._has_state(req.block_hashes[len(hits) - 1]):
            hits.pop()
        return hits, len(hits) * self.block_size

    def _has_state(self, block_hash: bytes) -> bool:
        host = self.kv.host
        return self.states.has_snapshot(block_hash) or (host is not None and host.has_state(block_hash))

    def allocate_slots(
        self, req: CacheView, num_new_tokens: int, new_computed_blocks: list[Block | HostHit] | None = None
    ) -> list[Block] | None:
        """KV slots plus a working state slot (zeroed, or restored from the hit boundary)."""
        rid = req.request_id
        fresh = rid not in self.states.working
        if fresh and not self.states.can_allocate_working(rid):
            return None
        new = self.kv.allocate_slots(req, num_new_tokens, new_computed_blocks)
        if new is None:
            return None
        if fresh:
            self.states.allocate_working(rid)
            if new_computed_blocks:
                boundary = req.block_hashes[len(new_computed_blocks) - 1]
                if self.states.has_snapshot(boundary):
                    self.states.restore(rid, boundary)
                else:
                    assert self.kv.host is not None
                    self.kv.host.restore_state(rid, boundary)
        return new

    def cache_computed_blocks(self, req: CacheView) -> None:
        """Publish KV blocks, then the boundary states staged this step for published blocks."""
        self.kv.cache_computed_blocks(req)
        positions = self.states.staged_positions(req.request_id)
        if not positions:
            return
        bs = self.block_size
        extend_hashes(req.block_hashes, req.all_token_ids, bs, req.cache_salt)
        for pos in positions:
            if pos > req.num_computed_tokens:
                continue
            i = pos // bs - 1
            tokens = tuple(req.all_token_ids[i * bs : (i + 1) * bs])
            if self.kv.enable_caching and i < len(req.block_hashes):
                block_hash = req.block_hashes[i]
                if self.pool.lookup(block_hash, tokens) is not None:
                    self.states.commit(req.request_id, pos, block_hash)
        # States of computed but unpublished blocks are dropped; states staged past the computed
        # tokens (draft positions of a verify step) wait until the drafts are accepted or rolled back.
        self.states.drop_staged(req.request_id, upto=req.num_computed_tokens)

    def free(self, req: CacheView) -> None:
        self.kv.free(req)
        self.states.free_working(req.request_id)

    def check_integrity(self) -> None:
        self.kv.check_integrity()
        self.states.check_integrity()
        cached = {b.block_hash for b in self.pool.blocks if b.block_hash is not None}
        stale = self.states.snapshot_hashes() - cached
        assert not stale, f"{len(stale)} state snapshots outlived their KV blocks"
        assert set(self.states.working) >= {r for r in self.kv.req_blocks}, "a request holds blocks but no state"
