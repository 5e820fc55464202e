"""The decode role: requests whose prompt a prefill instance computes into this engine's blocks.

The life of a request (``kv_transfer_params.prefill_url`` in its body): the
engine admits it with blocks for the whole prompt (after its own prefix hit)
and parks it (``Status.REMOTE``); :meth:`DecodeService.on_blocks_ready` sends
the prefill order; when the prefill instance reports every write landed and
its NIXL notification has arrived, the request runs here from the last prompt
token on. If the request is aborted once its order was sent (client gone,
``--request-timeout``, or the prefill instance past ``--pd-transfer-timeout``)
its blocks stay allocated until the prefill instance answers the abort with
"safe to reclaim" (:mod:`kvwarden.disagg.protocol`).
"""

from __future__ import annotations

import asyncio
import base64
import enum
import logging
import threading
import time
from dataclasses import dataclass

import httpx

from kvwarden.disagg.protocol import AbortReport, PeerInfo, PrefillOrder, PrefillReport
from kvwarden.disagg.transfer import TransferAgent
from kvwarden.engine.remote_kv import TransferMemory
from kvwarden.server.async_engine import AsyncEngine
from kvwarden.server.engine_errors import PrefillTimeoutError, RemotePrefillError

log = logging.getLogger("kvwarden.pd")

NOTIFY_POLL_S = 0.0005  # transport polling while a transfer is under way
UNSAFE_DRAIN_S = 10.0  # --unsafe-pd-abort: progress is still driven this long for a freed transfer
NOTIFY_TIMEOUT_S = 10.0  # the notification travels behind the data: it is late only if the peer broke
ABORT_RETRY_S = 0.5  # between attempts to get "safe to reclaim" from an unreachable prefill instance
ABORT_ANSWER_S = 30.0  # an abort is answered after the writes in flight land: longer than one write
DEAD_PEER_S = 5.0  # connections refused this long: the prefill process is gone
ABORT_GIVE_UP_S = 300.0  # after this the blocks stay quarantined for good (leaked, never corrupted)


class _Phase(enum.Enum):
    NEW = "new"  # blocks allocated, order not sent
    SENT = "sent"  # order sent: writes may land at any time
    DONE = "done"
    ABORTED = "aborted"


@dataclass
class _Transfer:
    url: str
    token_ids: list[int]
    cache_salt: str | None
    phase: _Phase = _Phase.NEW
    task: asyncio.Task[None] | None = None


class DecodeService:
    """The decode side's transfers; implements :class:`kvwarden.server.async_engine.RemoteKVHooks`."""

    def __init__(
        self, engine: AsyncEngine, agent: TransferAgent, transfer_timeout: float = 60.0, unsafe_abort: bool = False
    ) -> None:
        self.engine = engine
        self.agent = agent
        self.transfer_timeout = transfer_timeout
        self.unsafe_abort = unsafe_abort  # testing only: --unsafe-pd-abort
        self.loop: asyncio.AbstractEventLoop | None = None
        self.http: httpx.AsyncClient | None = None
        self._lock = threading.Lock()  # phases are read by the engine thread (on_abort) and the loop
        self._transfers: dict[str, _Transfer] = {}
        self._expected: dict[str, _Transfer] = {}  # registered before the request is queued
        self._notified: set[bytes] = set()  # tags of notifications that arrived before their waiter
        self._receiving: set[str] = set()  # requests whose writes may be under way: progress is driven for them
        self._progress: asyncio.Task[None] | None = None
        self._work = asyncio.Event()  # set when _receiving gains a member
        self.counters = {
            **{"orders": 0, "done": 0, "failed": 0, "handshakes": 0, "unsafe_frees": 0, "bytes": 0},
            # aborts by the transfer's stage: blocks allocated but no order sent, order sent, transfer done
            **{"aborts_before": 0, "aborts_during": 0, "aborts_after": 0},
        }
        self.transfer_seconds: list[float] = []

    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(self.transfer_timeout, connect=5.0))
        self._progress = asyncio.ensure_future(self._drive_progress())

    async def close(self) -> None:
        if self._progress is not None:
            self._progress.cancel()
        if self.http is not None:
            await self.http.aclose()

    async def _drive_progress(self) -> None:
        """Poll the transport while writes may be landing here (the peer's writes move only then)."""
        while True:
            if not self._receiving:
                self._work.clear()
                await self._work.wait()
            for messages in self.agent.notifications().values():
                self._notified.update(messages)
            await asyncio.sleep(NOTIFY_POLL_S)

    def expect(self, request_id: str, url: str, token_ids: list[int], cache_salt: str | None) -> None:
        """Call before queuing a remote-prefill request: which prefill instance computes which prompt."""
        with self._lock:
            self._expected[request_id] = _Transfer(url.rstrip("/"), list(token_ids), cache_salt)

    # ------------------------------------------------------------ engine thread
    def on_blocks_ready(self, request_id: str, memory: TransferMemory) -> None:
        with self._lock:
            transfer = self._expected.pop(request_id, None)
            if transfer is None:
                return
            self._transfers[request_id] = transfer
        assert self.loop is not None
        self.loop.call_soon_threadsafe(self._start, request_id, transfer, memory)

    def on_abort(self, request_id: str) -> bool:
        with self._lock:
            self._expected.pop(request_id, None)
            transfer = self._transfers.get(request_id)
            if transfer is None or transfer.phase is _Phase.ABORTED:
                return True
            if transfer.phase is _Phase.DONE:
                self._transfers.pop(request_id, None)
                self.counters["aborts_after"] += 1
                return True
            was = transfer.phase
            transfer.phase = _Phase.ABORTED
            self.counters["aborts_before" if was is _Phase.NEW else "aborts_during"] += 1
        assert self.loop is not None
        self.loop.call_soon_threadsafe(self._cancel_order, transfer)
        if was is _Phase.NEW:
            self._forget(request_id)
            return True  # no order was sent: nothing can write into the blocks
        if self.unsafe_abort:
            self.counters["unsafe_frees"] += 1
            self._forget(request_id)
            # The peer's writes still need this side's progress to land (late): drive it a while longer.
            self.loop.call_soon_threadsafe(self.loop.call_later, UNSAFE_DRAIN_S, self._receiving.discard, request_id)
            return True  # the race re-created: the prefill instance may still be writing
        self.loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._handshake(request_id, transfer.url)))
        return False

    def on_finished(self, request_id: str) -> None:
        with self._lock:
            self._expected.pop(request_id, None)  # computed here after all (prefix hit, prompt scores)
            self._transfers.pop(request_id, None)

    # ------------------------------------------------------------------ loop
    def _start(self, rid: str, transfer: _Transfer, memory: TransferMemory) -> None:
        with self._lock:
            if transfer.phase is not _Phase.NEW:
                return  # aborted before the order went out
            transfer.phase = _Phase.SENT
        self._receiving.add(rid)
        self._work.set()
        transfer.task = asyncio.ensure_future(self._order(rid, transfer, memory))

    async def _order(self, rid: str, transfer: _Transfer, memory: TransferMemory) -> None:
        assert self.http is not None
        self.counters["orders"] += 1
        started = time.perf_counter()
        try:
            order = PrefillOrder(
                transfer_id=self._tid(rid),
                token_ids=transfer.token_ids,
                cache_salt=transfer.cache_salt,
                block_ids=memory.block_ids,
                first_block=memory.first_block,
                state_slot=memory.state_slot,
                snapshot_slots=sorted(memory.snapshot_slots.items()),
                peer=PeerInfo(
                    agent=self.agent.name,
                    metadata=base64.b64encode(self.agent.metadata).decode(),
                    layout=self.agent.layout.to_json(),
                ),
            )
            response = await self.http.post(f"{transfer.url}/pd/v1/prefill", json=order.model_dump())
            if response.status_code != 200:
                raise RuntimeError(f"prefill instance answered HTTP {response.status_code}: {response.text[:300]}")
            report = PrefillReport.model_validate(response.json())
            if report.status != "done":
                raise RuntimeError("the prefill instance aborted the transfer")
            await self._wait_notification(order.transfer_id.encode())
        except asyncio.CancelledError:
            return  # aborted here: on_abort decided what happens to the blocks
        except Exception as exc:  # the request fails; its blocks go through the handshake (phase SENT)
            self.counters["failed"] += 1
            if isinstance(exc, httpx.ConnectError):
                with self._lock:  # the order never left: nothing can write into the blocks
                    if transfer.phase is _Phase.SENT:
                        transfer.phase = _Phase.NEW
                self._receiving.discard(rid)
            if isinstance(exc, httpx.TimeoutException):
                why = f"the prefill instance at {transfer.url} did not finish within {self.transfer_timeout} s"
                error: BaseException = PrefillTimeoutError(why + " (--pd-transfer-timeout)")
            else:
                error = RemotePrefillError(f"remote prefill at {transfer.url} failed: {type(exc).__name__}: {exc}")
            self.engine.fail(rid, error)
            return
        with self._lock:
            if transfer.phase is not _Phase.SENT:
                return
            transfer.phase = _Phase.DONE  # forgotten when the request finishes or is aborted
        self._receiving.discard(rid)
        self.counters["done"] += 1
        self.counters["bytes"] += report.bytes
        self.transfer_seconds.append(time.perf_counter() - started)
        await self.engine.call(lambda e: e.remote.done(rid, report.cached_tokens, report.snapshots))

    async def _wait_notification(self, tag: bytes) -> None:
        """The NIXL notification of the last write (delivered after the transfer's data; see _drive_progress)."""
        deadline = time.monotonic() + NOTIFY_TIMEOUT_S
        while tag not in self._notified:
            if time.monotonic() > deadline:
                raise RuntimeError("the transfer's completion notification never arrived")
            await asyncio.sleep(NOTIFY_POLL_S)
        self._notified.discard(tag)

    def _cancel_order(self, transfer: _Transfer) -> None:
        if transfer.task is not None:
            transfer.task.cancel()  # the prefill side goes on writing until it is told to stop

    async def _handshake(self, rid: str, url: str) -> None:
        """Tell the prefill instance to stop; free the blocks only on its "safe to reclaim"."""
        assert self.http is not None
        self.counters["handshakes"] += 1
        deadline = time.monotonic() + ABORT_GIVE_UP_S
        refused_since: float | None = None
        while True:
            try:
                body = {"transfer_id": self._tid(rid)}  # answered once the writes in flight have landed
                response = await self.http.post(f"{url}/pd/v1/abort", json=body, timeout=ABORT_ANSWER_S)
                if response.status_code == 200 and AbortReport.model_validate(response.json()).safe_to_reclaim:
                    break
            except httpx.ConnectError as exc:
                # Refused connections: the prefill process is gone, and its transport with it (NIXL
                # reports a dead peer within ~0.1 s); after DEAD_PEER_S nothing of it can still land.
                refused_since = refused_since or time.monotonic()
                if time.monotonic() - refused_since > DEAD_PEER_S:
                    log.warning("abort of %s: prefill instance %s is gone (%s); blocks reclaimed", rid, url, exc)
                    break
            except httpx.HTTPError as exc:
                log.warning("abort of %s: prefill instance %s did not answer (%s); blocks stay held", rid, url, exc)
            if time.monotonic() > deadline:
                log.error(
                    "abort of %s: no 'safe to reclaim' in %.0f s; its blocks stay held for good", rid, ABORT_GIVE_UP_S
                )
                return
            await asyncio.sleep(ABORT_RETRY_S)
        self._forget(rid)
        self._receiving.discard(rid)  # nothing of this transfer is in flight any more
        await self.engine.call(lambda e: e.remote.release(rid))

    def _forget(self, rid: str) -> None:
        with self._lock:
            self._transfers.pop(rid, None)
        self._notified.discard(self._tid(rid).encode())

    def _tid(self, rid: str) -> str:
        return f"{self.agent.name}/{rid}"
