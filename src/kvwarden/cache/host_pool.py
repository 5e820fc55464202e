"""The host tier's memory: KV blocks (and hybrid boundary states) evicted from the device pool.

Blocks are keyed by the same chained hash as the device prefix cache and kept
in LRU order. A slot that a load is still reading from is *pinned* and never
evicted or overwritten until the copy's ticket has completed. On a GPU the
tensors are pinned host memory (asynchronous uploads); on the CPU they are a
separate allocation with its own copy worker, so the asynchronous path runs in
CI too.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from kvwarden.cache.paged_kv import KV


class HostPool:
    """``num_blocks`` host slots mirroring the device KV layout, an LRU hash map and pins."""

    def __init__(self, layers: list[KV], block_size: int, num_blocks: int, pin: bool) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        rows = num_blocks * block_size

        def like(t: torch.Tensor) -> torch.Tensor:
            return torch.zeros((rows, *t.shape[1:]), dtype=t.dtype, pin_memory=pin)

        self.layers: list[KV] = [(like(k), like(v)) for k, v in layers]
        self._lru: OrderedDict[bytes, int] = OrderedDict()  # hash -> slot, least recent first
        self._tokens: dict[int, tuple[int, ...]] = {}
        self._free = list(range(num_blocks - 1, -1, -1))
        self._pins: dict[int, int] = {}
        # Hybrid models: the boundary state at the end of a host block, per recurrent layer (conv, ssm).
        self.states: dict[bytes, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.evictions = 0

    @staticmethod
    def bytes_per_block(layers: list[KV], block_size: int) -> int:
        return sum(block_size * (k[0].numel() * k.element_size() + v[0].numel() * v.element_size()) for k, v in layers)

    @property
    def num_cached(self) -> int:
        return len(self._lru)

    def lookup(self, block_hash: bytes, tokens: tuple[int, ...]) -> int | None:
        """The slot holding exactly this block, if any (refreshes its LRU position)."""
        slot = self._lru.get(block_hash)
        if slot is None or self._tokens[slot] != tokens:
            return None
        self._lru.move_to_end(block_hash)
        return slot

    def reserve(self, block_hash: bytes, tokens: tuple[int, ...]) -> int | None:
        """A slot for a block being written back (``None``: already here, or every slot is pinned)."""
        if block_hash in self._lru:
            self._lru.move_to_end(block_hash)
            return None
        if not self._free and not self._evict_one():
            return None
        slot = self._free.pop()
        self._lru[block_hash] = slot
        self._tokens[slot] = tokens
        return slot

    def _evict_one(self) -> bool:
        for block_hash, slot in self._lru.items():
            if not self._pins.get(slot):
                del self._lru[block_hash]
                del self._tokens[slot]
                self.states.pop(block_hash, None)
                self._free.append(slot)
                self.evictions += 1
                return True
        return False

    def pin(self, slot: int) -> None:
        self._pins[slot] = self._pins.get(slot, 0) + 1

    def unpin(self, slot: int) -> None:
        left = self._pins[slot] - 1
        if left:
            self._pins[slot] = left
        else:
            del self._pins[slot]

    @property
    def num_pinned(self) -> int:
        return len(self._pins)

    def check_integrity(self) -> None:
        held = list(self._lru.values())
        assert len(held) == len(set(held)), "host slot used twice"
        assert not set(held) & set(self._free), "a cached host slot is also free"
        assert len(held) + len(self._free) == self.num_blocks, "host slot leaked"
        assert set(self._pins) <= set(held), "a pinned host slot is not cached"
        assert set(self.states) <= set(self._lru), "a host state outlived its block"
