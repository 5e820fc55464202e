"""The scheduler's only view of the KV cache.

Three verbs, as in vLLM v1: :meth:`KVCacheManager.get_computed_blocks` (prefix
hit), :meth:`KVCacheManager.allocate_slots` (``None`` when it cannot) and
:meth:`KVCacheManager.free`. Plus :meth:`cache_computed_blocks`, called once a
step's KV is written, so a block is published only after it holds real data.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from kvwarden.cache.block_pool import Block, BlockPool
from kvwarden.cache.hashing import extend_hashes
from kvwarden.intmath import cdiv

if TYPE_CHECKING:
    from kvwarden.cache.host_tier import HostHit, HostTier


@dataclass
class CacheView:
    """What the manager needs to know about a request (owned by the request).

    Attributes:
        request_id: unique id.
        all_token_ids: prompt + generated tokens.
        num_computed_tokens: tokens whose KV is written.
        cache_salt: isolates the request's blocks from unsalted/other-salted ones.
        skip_prefix_hit: never reuse cached blocks (prompt logprobs need every position).
        block_hashes: hashes of the full blocks of ``all_token_ids`` (grown lazily).
    """

    request_id: str
    all_token_ids: list[int]
    num_computed_tokens: int = 0
    cache_salt: str | None = None
    skip_prefix_hit: bool = False
    block_hashes: list[bytes] = field(default_factory=list)


class KVCacheManager:
    """Maps requests to blocks; owns prefix-cache lookups and publication."""

    def __init__(self, pool: BlockPool, block_size: int, enable_caching: bool) -> None:
        self.pool = pool
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.req_blocks: dict[str, list[Block]] = {}
        self._rows: dict[str, np.ndarray] = {}  # block_row's arrays, until a request's blocks change
        self._num_cached: dict[str, int] = {}
        self.query_tokens = 0  # prefix-cache statistics, in tokens
        self.hit_tokens = 0
        self.host: HostTier | None = None  # the host tier, when there is one

    def attach_host(self, host: HostTier) -> None:
        """Extend lookups to the host tier and write evicted blocks back to it."""
        self.host = host
        self.pool.on_reuse = host.write_back

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, [])]

    def block_row(self, request_id: str) -> np.ndarray:
        """:meth:`block_ids` as an int32 array (the graphs' block tables), kept between steps.

        NOTE: valid while its length matches: a request's blocks only grow at the end until :meth:`free`,
        which drops the array.
        """
        blocks = self.req_blocks.get(request_id, [])
        row = self._rows.get(request_id)
        if row is None or len(row) != len(blocks):
            row = np.fromiter((b.block_id for b in blocks), dtype=np.int32, count=len(blocks))
            self._rows[request_id] = row
        return row

    def get_computed_blocks(self, req: CacheView) -> tuple[list[Block | HostHit], int]:
        """Longest cached prefix of the request, in full blocks: device hits, then host-tier hits.

        At least one token is always left to compute: the step that computes it
        produces the logits the next token is sampled from.
        """
        num_tokens = len(req.all_token_ids)
        if not self.enable_caching or req.skip_prefix_hit:
            return [], 0
        extend_hashes(req.block_hashes, req.all_token_ids, self.block_size, req.cache_salt)
        max_blocks = (num_tokens - 1) // self.block_size
        hits: list[Block | HostHit] = []
        for i, block_hash in enumerate(req.block_hashes[:max_blocks]):
            tokens = tuple(req.all_token_ids[i * self.block_size : (i + 1) * self.block_size])
            hit = self.pool.lookup(block_hash, tokens)
            if hit is None and self.host is not None:
                hit = self.host.lookup(block_hash, tokens)
            if hit is None:
                break
            hits.append(hit)
        return hits, len(hits) * self.block_size

    def record_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count a scheduled request's prefix lookup (for metrics)."""
        self.query_tokens += num_tokens
        self.hit_tokens += num_hit_tokens

    def allocate_slots(
        self, req: CacheView, num_new_tokens: int, new_computed_blocks: list[Block | HostHit] | None = None
    ) -> list[Block] | None:
        """Make room for ``num_new_tokens`` more tokens after the computed ones.

        Args:
            req: the request.
            num_new_tokens: tokens to compute this step.
            new_computed_blocks: prefix hits from :meth:`get_computed_blocks`
                (first scheduling only); device blocks are referenced here, host
                hits get fresh device blocks and their loads are queued.

        Returns:
            The newly allocated blocks, or ``None`` if the pool cannot provide them
            (nothing is changed then).
        """
        held = self.req_blocks.get(req.request_id, [])
        if not new_computed_blocks and held and len(held) * self.block_size >= req.num_computed_tokens + num_new_tokens:
            return []  # a decode step inside its last block (most of them): nothing to look at
        hits = new_computed_blocks or []
        device = [b for b in hits if isinstance(b, Block)]
        remote = [h for h in hits if not isinstance(h, Block)]  # device hits always come first
        total_tokens = req.num_computed_tokens + len(hits) * self.block_size + num_new_tokens
        needed = cdiv(total_tokens, self.block_size) - len(held) - len(device)
        revived = sum(1 for b in device if b.ref_cnt == 0)  # hits that sit in the free queue
        if needed > self.pool.num_free_blocks - revived:
            return None
        self.pool.touch(device)
        if remote:
            assert self.host is not None
            self.host.pin(remote)  # before allocating: write-backs of evicted blocks may evict host slots
        new = self.pool.allocate(max(needed, 0))
        if remote:
            self.host.load(remote, new[: len(remote)])  # type: ignore[union-attr]
        self.req_blocks.setdefault(req.request_id, []).extend([*device, *new])
        if hits:
            # Loaded blocks are published like computed ones, after the step that waited for them.
            self._num_cached[req.request_id] = len(device) + len(held)
        return new

    def cache_computed_blocks(self, req: CacheView) -> None:
        """Publish every block that is now full and computed (call after the step)."""
        if not self.enable_caching:
            return
        blocks = self.req_blocks.get(req.request_id, [])
        full = min(req.num_computed_tokens // self.block_size, len(blocks))
        start = self._num_cached.get(req.request_id, 0)
        if full <= start:
            return
        extend_hashes(req.block_hashes, req.all_token_ids, self.block_size, req.cache_salt)
        for i in range(start, full):
            tokens = tuple(req.all_token_ids[i * self.block_size : (i + 1) * self.block_size])
            self.pool.cache(blocks[i], req.block_hashes[i], tokens)
        self._num_cached[req.request_id] = full

    def free(self, req: CacheView) -> None:
        """Return the request's blocks; tail blocks become the first to be evicted."""
        blocks = self.req_blocks.pop(req.request_id, [])
        self._rows.pop(req.request_id, None)
        self._num_cached.pop(req.request_id, None)
        self.pool.free(list(reversed(blocks)))

    def check_integrity(self) -> None:
        """Pool invariants plus: every held block's ref count covers its holders."""
        self.pool.check_integrity()
        holders: dict[int, int] = {}
        for blocks in self.req_blocks.values():
            for b in blocks:
                holders[b.block_id] = holders.get(b.block_id, 0) + 1
        for block_id, count in holders.items():
            ref = self.pool.blocks[block_id].ref_cnt
            assert ref == count, f"block {block_id}: ref_cnt {ref} but held by {count} requests"
