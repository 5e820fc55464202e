"""The host tier: write-back of evicted device blocks, lookups, and layer-wise loads.

The device pool calls :meth:`HostTier.write_back` for every cached block it is
about to hand to a new owner; the block's KV goes to a host slot under the same
hash (and, for hybrid models, the boundary state stored with it). A prefix
lookup that runs past the device hits continues here; each host hit gets a
fresh device block and one copy per layer, queued in layer order, so layer
``i``'s blocks land while layers ``< i`` compute. Readers wait through
:class:`~kvwarden.cache.paged_kv.PagedKV`.

NOTE(invariant): a loaded block holds the bytes the device block held when it
was evicted, and every block computed from the same tokens holds the same
bytes (canonical numerics), so a host hit gives bitwise the logits of a cold
run. Copies issued in a step are all finished before the step returns
(:meth:`end_step`): between steps no block, device or host, is in flight, so an
abort or a preemption can free anything.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvwarden.cache.block_pool import Block
from kvwarden.cache.host_pool import HostPool
from kvwarden.cache.paged_kv import PagedKV
from kvwarden.cache.state_pool import StatePool
from kvwarden.cache.transfer import CopyEngine
from kvwarden.config import CacheConfig


@dataclass(frozen=True)
class HostHit:
    """A prefix-hit block that lives in the host tier (loaded into a new device block on allocation)."""

    slot: int
    block_hash: bytes


class HostTier:
    """Owns the host pool and the copy engine; the KV managers call it, nothing else does."""

    def __init__(
        self,
        kv: PagedKV,
        host: HostPool,
        copies: CopyEngine,
        block_size: int,
        states: StatePool | None = None,
        race_second: bool = False,
    ) -> None:
        """``race_second``: testing only (``unsafe_indexer_load``): each layer's second tensor (a sparse-attention
        layer's indexer keys) is loaded by its own copy after the first's, and nobody waits for it."""
        self.kv = kv
        self.race_second = race_second
        self.host = host
        self.copies = copies
        self.block_size = block_size
        self.states = states
        self._evicted: list[tuple[int, int]] = []  # (device block, host slot) waiting to be written back
        self._pinned: list[int] = []
        self.hit_tokens = 0  # prompt tokens served from the host tier
        self.loaded_blocks = 0
        self.written_blocks = 0

    # ------------------------------------------------------------- lookups
    def lookup(self, block_hash: bytes, tokens: tuple[int, ...]) -> HostHit | None:
        slot = self.host.lookup(block_hash, tokens)
        return None if slot is None else HostHit(slot, block_hash)

    def has_state(self, block_hash: bytes) -> bool:
        return block_hash in self.host.states

    def restore_state(self, request_id: str, block_hash: bytes) -> None:
        """Copy a host boundary state into the request's working slot (small: done at once)."""
        assert self.states is not None
        self.states.restore_from(request_id, self.host.states[block_hash])

    # ---------------------------------------------------------- write-back
    def write_back(self, block: Block) -> None:
        """Called by the device pool before a cached block is reused: keep its contents on the host."""
        assert block.block_hash is not None
        slot = self.host.reserve(block.block_hash, block.token_ids)
        if slot is None:
            return  # already on the host, or every host slot is pinned by a load
        if self.states is not None and self.states.has_snapshot(block.block_hash):
            self.host.states[block.block_hash] = self.states.snapshot_to_host(block.block_hash)
        # NOTE: a small host pool may hand out, within one allocation, a slot whose earlier write-back is still
        # queued (its block was evicted from the host again): that write must not land after this one.
        self._evicted = [(b, s) for b, s in self._evicted if s != slot]
        self._evicted.append((block.block_id, slot))

    def flush(self) -> None:
        """Queue the pending write-backs (before any load, and before the step's forward writes)."""
        if not self._evicted:
            return
        blocks = [b for b, _ in self._evicted]
        slots = [s for _, s in self._evicted]
        self.written_blocks += len(self._evicted)
        self._evicted = []
        layers = [self.kv.raw(i) for i in range(len(self.kv))]
        tickets = self.copies.write_back(layers, blocks, self.host.layers, slots)
        for layer, ticket in enumerate(tickets):
            self.kv.add(layer, ticket, load=False)

    # --------------------------------------------------------------- loads
    def pin(self, hits: list[HostHit]) -> None:
        """Hold the hits' host slots (before the device allocation that may evict host slots)."""
        for hit in hits:
            self.host.pin(hit.slot)
            self._pinned.append(hit.slot)

    def load(self, hits: list[HostHit], blocks: list[Block]) -> None:
        """Queue the loads of pinned ``hits`` into ``blocks``, one copy per layer, in layer order."""
        self.flush()  # a block being reused must be written out before anything is loaded into it
        slots, ids = [h.slot for h in hits], [b.block_id for b in blocks]
        for layer in range(len(self.kv)):
            host, dev = self.host.layers[layer], self.kv.raw(layer)
            if self.race_second:
                self.kv.add(layer, self.copies.load(host, slots, dev, ids, parts=(0,)), load=True)
                self.kv.add(layer, self.copies.load(host, slots, dev, ids, parts=(1,)), load=True, race=True)
            else:
                self.kv.add(layer, self.copies.load(host, slots, dev, ids), load=True)
        self.loaded_blocks += len(hits)
        self.hit_tokens += len(hits) * self.block_size

    def end_step(self) -> None:
        """Wait for every copy of the step, then let go of the host slots its loads read."""
        self.flush()
        self.kv.settle()
        for slot in self._pinned:
            self.host.unpin(slot)
        self._pinned = []

    def stats(self) -> dict[str, int]:
        return {
            "host_blocks": self.host.num_blocks,
            "host_blocks_cached": self.host.num_cached,
            "host_evictions": self.host.evictions,
            "host_loaded_blocks": self.loaded_blocks,
            "host_written_blocks": self.written_blocks,
            "prefix_cache_hits_host": self.hit_tokens,
        }

    def check_integrity(self) -> None:
        self.host.check_integrity()
        assert not self._pinned and self.host.num_pinned == 0, "host slots pinned between steps"
        assert not self._evicted, "write-backs left unqueued between steps"


def make_host_tier(cache: CacheConfig, kv: PagedKV, device: torch.device, states: StatePool | None) -> HostTier:
    """The host tier of ``cache.host_cache_bytes`` behind the device tensors ``kv``, with its copy engine."""
    pool = host_pool_for(kv, cache.block_size, cache.host_cache_bytes, device)
    copies = CopyEngine(device, cache.block_size)
    return HostTier(kv, pool, copies, cache.block_size, states, race_second=cache.unsafe_indexer_load)


def host_pool_for(kv: PagedKV, block_size: int, num_bytes: int, device: torch.device) -> HostPool:
    """A host pool of as many blocks as ``num_bytes`` holds (pinned memory on a GPU)."""
    layers = [kv.raw(i) for i in range(len(kv))]
    per_block = HostPool.bytes_per_block(layers, block_size)
    num_blocks = num_bytes // per_block
    if num_blocks < 1:
        raise ValueError(f"host_cache_bytes: {num_bytes} bytes hold no KV block (one block is {per_block} bytes)")
    return HostPool(layers, block_size, num_blocks, pin=device.type == "cuda")
