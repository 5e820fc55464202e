"""Block pool: reference-counted KV blocks, an LRU free queue and the prefix-cache map.

A block is *free* when no request holds it (``ref_cnt == 0``); a free block may
still carry a cached hash and be revived by a prefix hit until it is handed out
again. Allocation takes from the front of the free queue (least recently
freed), which is where eviction happens.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class Block:
    """One KV block.

    Attributes:
        block_id: index into the KV tensors (slot = block_id * block_size + offset).
        ref_cnt: requests holding the block.
        block_hash: chained content hash once the block is full and cached.
        token_ids: the block's tokens, re-checked on a hit (hash collisions).
    """

    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None
    token_ids: tuple[int, ...] = ()


class BlockPool:
    """Owns every block; the only place ref counts and the cache map change."""

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[bytes, int] = {}
        self.evictions = 0
        # Called with the hash of every cache entry that disappears (hybrid state snapshots follow).
        self.on_evict: Callable[[bytes], None] | None = None
        # Called with a cached block about to be handed to a new owner (the host tier writes it back).
        self.on_reuse: Callable[[Block], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out (including cached-but-unused ones)."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def lookup(self, block_hash: bytes, token_ids: tuple[int, ...]) -> Block | None:
        """The cached block with this hash and exactly these tokens, if any."""
        block_id = self._cached.get(block_hash)
        if block_id is None:
            return None
        block = self.blocks[block_id]
        return block if block.token_ids == token_ids else None

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def allocate(self, num_blocks: int) -> list[Block]:
        """Take ``num_blocks`` from the free queue (evicting their cache entries).

        Raises:
            RuntimeError: not enough free blocks (callers check ``can_allocate``).
        """
        if not self.can_allocate(num_blocks):
            raise RuntimeError(f"block pool: asked for {num_blocks} blocks, {len(self._free)} free")
        out = []
        for _ in range(num_blocks):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:
                self.evictions += 1
                if self.on_reuse is not None and self._cached.get(block.block_hash) == block.block_id:
                    self.on_reuse(block)
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: list[Block]) -> None:
        """Take a reference on blocks found by a prefix hit."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free(self, blocks: list[Block]) -> None:
        """Drop one reference on each block, in eviction order (first = evicted first)."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"block pool: double free of block {block.block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = None

    def cache(self, block: Block, block_hash: bytes, token_ids: tuple[int, ...]) -> None:
        """Publish a full, computed block under its hash (first writer wins)."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self._cached:
            return  # another request already cached identical content
        block.block_hash = block_hash
        block.token_ids = token_ids
        self._cached[block_hash] = block.block_id

    def forget(self, block: Block) -> None:
        """Drop a block's cache entry now (its contents must never be hit again)."""
        self._evict(block)

    def _evict(self, block: Block) -> None:
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) == block.block_id:
                del self._cached[block.block_hash]
                if self.on_evict is not None:
                    self.on_evict(block.block_hash)
            block.block_hash = None
            block.token_ids = ()

    def check_integrity(self) -> None:
        """Raise ``AssertionError`` if any pool invariant is broken."""
        free_ids = set(self._free)
        assert len(free_ids) == len(self._free), "duplicate block in free queue"
        for block in self.blocks:
            assert block.ref_cnt >= 0, f"block {block.block_id}: negative ref count"
            assert (block.ref_cnt == 0) == (block.block_id in free_ids), (
                f"block {block.block_id}: ref_cnt={block.ref_cnt} but free={block.block_id in free_ids}"
            )
            if block.block_hash is not None:
                assert self._cached.get(block.block_hash) == block.block_id, (
                    f"block {block.block_id}: hash not in the cache map"
                )
        for block_hash, block_id in self._cached.items():
            assert self.blocks[block_id].block_hash == block_hash, f"cache map entry for block {block_id} is stale"
