"""The prefill role: compute a prompt for a decode instance and write its KV into the decode's blocks.

The life of an order (``POST /pd/v1/prefill``, see :mod:`kvwarden.disagg.protocol`):
the engine computes ``prompt[:-1]`` as a request that keeps its blocks after
it finishes (``hold``); the blocks are written into the decode instance's,
one slice per attention layer (plus the recurrent state), then released. The
order runs as a task of its own, so a caller that hangs up does not stop
writes already under way; only an abort does, and the abort is answered
"safe to reclaim" once nothing of the order is in flight.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from kvwarden.disagg.protocol import AbortOrder, AbortReport, PrefillOrder, PrefillReport
from kvwarden.disagg.transfer import Layout, TransferAgent
from kvwarden.engine.sampling_params import SamplingParams
from kvwarden.intmath import cdiv
from kvwarden.server.async_engine import AsyncEngine
from kvwarden.server.protocol import ApiError

log = logging.getLogger("kvwarden.pd")

POLL_S = 0.0005  # how often a posted write's state is checked
MAX_TOMBSTONES = 100_000  # aborted transfer ids remembered (an order arriving after its abort is refused)


@dataclass
class _Order:
    """One transfer on the prefill side."""

    aborted: bool = False
    writing: bool = False  # past the compute phase
    posted: int = 0
    completed: int = 0
    bytes: int = 0
    quiet: asyncio.Event = field(default_factory=asyncio.Event)  # set when nothing is in flight
    task: asyncio.Task[PrefillReport] | None = None


class PrefillService:
    """Serves ``/pd/v1/prefill`` and ``/pd/v1/abort`` for one engine."""

    def __init__(self, engine: AsyncEngine, agent: TransferAgent, transfer_delay_ms: float = 0.0) -> None:
        self.engine = engine
        self.agent = agent
        self.delay_s = transfer_delay_ms / 1000.0  # testing only: --inject-fault transfer-delay=MS
        self._orders: dict[str, _Order] = {}
        self._tombstones: OrderedDict[str, None] = OrderedDict()
        self.counters = {"orders": 0, "done": 0, "aborted": 0, "bytes": 0, "writes": 0, "aborts_received": 0}

    async def prefill(self, order: PrefillOrder) -> PrefillReport:
        peer = Layout.from_json(order.peer.layout)
        why = self.agent.layout.mismatch(peer)
        if why is not None:
            raise ApiError(400, f"peer.layout: the decode instance's KV does not match this one's: {why}", "peer")
        if order.transfer_id in self._orders:
            raise ApiError(400, f"transfer_id: {order.transfer_id!r} is already in use", "transfer_id")
        self.counters["orders"] += 1
        if order.transfer_id in self._tombstones:
            self.counters["aborted"] += 1
            return PrefillReport(status="aborted")
        self.agent.connect(order.peer.agent, base64.b64decode(order.peer.metadata))
        state = _Order()
        self._orders[order.transfer_id] = state
        state.task = asyncio.create_task(self._run(order, peer, state))
        # Shielded: the caller hanging up must not cancel writes already posted (only an abort stops them).
        try:
            return await asyncio.shield(state.task)
        except asyncio.CancelledError:
            if state.task.cancelled():  # our own abort cancelled it before it began
                self.counters["aborted"] += 1
                return PrefillReport(status="aborted")
            raise

    async def abort(self, order: AbortOrder) -> AbortReport:
        self.counters["aborts_received"] += 1
        state = self._orders.get(order.transfer_id)
        if state is None:
            self._remember(order.transfer_id)
            return AbortReport(safe_to_reclaim=True)
        state.aborted = True
        if not state.writing and state.task is not None:
            state.task.cancel()  # still computing: nothing was posted and nothing will be
            await asyncio.wait({state.task})
            # NOTE: a task cancelled before its first step never runs its ``finally``: settle it here.
            self._close(order.transfer_id, state)
        await state.quiet.wait()
        return AbortReport(safe_to_reclaim=True, writes_posted=state.posted, writes_completed=state.completed)

    async def _run(self, order: PrefillOrder, peer: Layout, state: _Order) -> PrefillReport:
        rid = f"pd-{order.transfer_id}"
        params = SamplingParams(temperature=0.0, max_tokens=1)  # the sampled token is not used
        started = time.perf_counter()
        cached = 0
        try:
            async for out in self.engine.generate(rid, order.token_ids[:-1], params, order.cache_salt, hold=True):
                cached = out.num_cached_tokens
            computed = time.perf_counter()
            if state.aborted:
                return self._report("aborted", state)
            state.writing = True
            mine = await self.engine.call(lambda e: e.remote.source(rid))
            first, end = order.first_block, cdiv(len(order.token_ids) - 1, peer.block_size)
            theirs = dict(order.snapshot_slots)
            snaps = [(i, mine.snapshot_slots[i], theirs[i]) for i in sorted(theirs) if i in mine.snapshot_slots]
            pieces = self.agent.plan(
                peer, mine.block_ids[first:end], order.block_ids[first:end], mine.state_slot, order.state_slot,
                [(a, b) for _, a, b in snaps],
            )  # fmt: skip
            handles: list[Any] = []
            for i, piece in enumerate(pieces):
                if self.delay_s:
                    await asyncio.sleep(self.delay_s / len(pieces))
                if state.aborted:
                    break  # posted writes still land; none is added
                notif = order.transfer_id.encode() if i == len(pieces) - 1 else b""
                handles.append(self.agent.post(order.peer.agent, piece, notif))
                state.posted += 1
                state.bytes += piece.num_bytes
            await self._settle(handles, state)
            self.counters["writes"] += state.posted
            self.counters["bytes"] += state.bytes
            if state.aborted:
                return self._report("aborted", state)
            report = self._report(
                "done", state, state.posted, computed - started, time.perf_counter() - computed, cached
            )
            report.snapshots = [i for i, _, _ in snaps]
            return report
        except asyncio.CancelledError:
            return self._report("aborted", state)
        finally:
            with contextlib.suppress(Exception):
                await self.engine.call(lambda e: e.remote.release(rid))
            self._close(order.transfer_id, state)

    def _close(self, transfer_id: str, state: _Order) -> None:
        """Nothing of this order is in flight any more: answer its abort, forget it."""
        state.quiet.set()
        self._orders.pop(transfer_id, None)
        if state.aborted:
            self._remember(transfer_id)

    async def _settle(self, handles: list[Any], state: _Order) -> None:
        """Wait until every posted write has completed (or failed: the peer is gone)."""
        pending = list(handles)
        while pending:
            still = []
            for h in pending:
                status = self.agent.state(h)
                if status == "PROC":
                    still.append(h)
                    continue
                if status != "DONE":
                    log.warning("a KV write failed (%s): the decode instance is gone or refused it", status)
                state.completed += 1
                self.agent.release(h)
            pending = still
            if pending:
                await asyncio.sleep(POLL_S)

    def _report(
        self, status: str, state: _Order, writes: int = 0, compute: float = 0.0, transfer: float = 0.0, cached: int = 0
    ) -> PrefillReport:
        self.counters["done" if status == "done" else "aborted"] += 1
        return PrefillReport(
            status=status,
            bytes=state.bytes,
            writes=writes,
            compute_s=compute,
            transfer_s=transfer,
            cached_tokens=cached,
        )

    def _remember(self, transfer_id: str) -> None:
        self._tombstones[transfer_id] = None
        while len(self._tombstones) > MAX_TOMBSTONES:
            self._tombstones.popitem(last=False)
