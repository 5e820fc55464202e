"""The engine's side of disaggregated serving: which memory a transfer reads or writes, and its end.

A decode instance's request waits in ``Status.REMOTE`` with blocks for its
whole prompt (:meth:`kvwarden.engine.scheduler.Scheduler.remote_done`); a
prefill instance's request keeps its blocks after finishing (``hold_blocks``).
:class:`RemoteKV` names the memory of both sides for the transfer (blocks,
the recurrent working-state slot, the boundary-state snapshot slots of hybrid
models) and ends a transfer: publish what landed, or free what was held.
All of it runs on the engine thread (the server calls it through
``AsyncEngine.call``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvwarden.cache.hybrid_manager import HybridCacheManager
from kvwarden.cache.kv_cache_manager import KVCacheManager
from kvwarden.cache.state_pool import StatePool
from kvwarden.engine.request import Request
from kvwarden.engine.scheduler import Scheduler


@dataclass(frozen=True)
class TransferMemory:
    """One side's memory of a transfer.

    Attributes:
        block_ids: the request's blocks, in prompt order.
        first_block: the first block the transfer covers (the decode side's prefix hit ends there).
        state_slot: the recurrent working-state slot (hybrid models), else None.
        snapshot_slots: block index -> snapshot slot holding the state at that block's end.
    """

    block_ids: list[int]
    first_block: int = 0
    state_slot: int | None = None
    snapshot_slots: dict[int, int] = field(default_factory=dict)


class RemoteKV:
    """Transfers' view of one engine's requests (owned by :class:`~kvwarden.engine.llm_engine.LLMEngine`)."""

    def __init__(
        self,
        scheduler: Scheduler,
        kv: KVCacheManager | HybridCacheManager,
        states: StatePool | None,
        requests: dict[str, Request],
        block_size: int,
    ) -> None:
        self.scheduler = scheduler
        self.kv = kv
        self.states = states
        self.requests = requests
        self.block_size = block_size
        # Finished or aborted requests whose blocks stay allocated until release().
        self.detached: dict[str, Request] = {}

    def take_newly_remote(self) -> list[Request]:
        """Requests that got their blocks and now wait for a prefill instance (each returned once)."""
        taken, self.scheduler.newly_remote = self.scheduler.newly_remote, []
        return taken

    def target(self, request_id: str) -> TransferMemory:
        """Decode side: where the prefill instance writes; reserves snapshot slots for the boundaries."""
        req = self.requests[request_id]
        first = req.num_computed_tokens // self.block_size
        full = (req.num_tokens - 1) // self.block_size  # full blocks of prompt[:-1]
        snaps = self.states.reserve_snapshots(request_id, list(range(first, full))) if self.states else {}
        return TransferMemory(self.kv.block_ids(request_id), first, self._slot(request_id), snaps)

    def source(self, request_id: str) -> TransferMemory:
        """Prefill side (a held request): its blocks, working state and the snapshots of its own blocks."""
        req = self.detached[request_id]
        blocks = self.kv.req_blocks[request_id]
        snaps = {}
        if self.states is not None:
            full = (req.num_tokens - 1) // self.block_size  # the sampled token is not part of the prompt
            for i in range(min(full, len(req.block_hashes))):
                slot = self.states.snapshot_slot(req.block_hashes[i])
                # NOTE: only a snapshot whose KV block is this request's own stays put during the read
                # (a cached twin block with the same hash could be evicted, taking its snapshot along).
                if slot is not None and self.kv.pool.lookup(req.block_hashes[i], self._tokens(req, i)) is blocks[i]:
                    snaps[i] = slot
        return TransferMemory([b.block_id for b in blocks], 0, self._slot(request_id), snaps)

    def done(self, request_id: str, cached_tokens: int, snapshots: list[int]) -> bool:
        """Decode side: the prompt's KV but its last token landed: publish it and run the request.

        ``snapshots``: block indices whose boundary state landed in the reserved slots.
        Returns False if the request is gone (aborted meanwhile).
        """
        req = self.requests.get(request_id)
        if req is None or req not in self.scheduler.remote:
            return False
        self.scheduler.remote_done(req)
        req.num_cached_tokens = max(req.num_cached_tokens, cached_tokens)  # as a single server would report
        if self.states is not None:
            hashes = {}
            for i in snapshots:
                if i < len(req.block_hashes) and self.kv.pool.lookup(req.block_hashes[i], self._tokens(req, i)):
                    hashes[i] = req.block_hashes[i]  # published with its KV block, like a computed one
            self.states.adopt_snapshots(request_id, hashes)
        return True

    def hold(self, req: Request) -> None:
        """Keep a finished or aborted request's blocks allocated (a transfer may still use them)."""
        self.detached[req.request_id] = req

    def release(self, request_id: str) -> None:
        """Free the blocks of an aborted or held request once nothing writes or reads them any more."""
        req = self.detached.pop(request_id, None)
        if req is not None:
            self.kv.free(req)

    def detached_blocks(self) -> int:
        return sum(len(self.kv.block_ids(r)) for r in self.detached)

    def _slot(self, request_id: str) -> int | None:
        return self.states.working.get(request_id) if self.states is not None else None

    def _tokens(self, req: Request, i: int) -> tuple[int, ...]:
        return tuple(req.all_token_ids[i * self.block_size : (i + 1) * self.block_size])
