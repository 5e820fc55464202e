"""The engine stepping in a background thread, serving asyncio callers.

All engine state is touched by the engine thread only. HTTP handlers validate
input synchronously (tokenizing is thread-safe), then hand the request over a
thread-safe inbox; outputs come back through a per-request asyncio queue. One
loop, all clients batched together.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvwarden.engine.faults import FaultInjector, Faults
from kvwarden.engine.llm_engine import LLMEngine
from kvwarden.engine.outputs import RequestOutput
from kvwarden.engine.remote_kv import TransferMemory
from kvwarden.engine.sampling_params import SamplingParams
from kvwarden.server.engine_errors import (
    EngineDeadError,
    QueueFullError,
    RequestFailedError,
    RequestTimeoutError,
)
from kvwarden.server.metrics import Metrics


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]
    arrival: float = field(default_factory=time.monotonic)
    last_token_time: float | None = None
    num_tokens: int = 0


@dataclass(frozen=True)
class _Add:
    request_id: str
    token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None
    remote: str | None = None  # the prefill instance that computes the prompt (decode role)
    hold: bool = False  # keep the blocks after finishing (prefill role)


class RemoteKVHooks(Protocol):
    """What the engine thread tells disaggregated serving (``kvwarden.disagg.decode``).

    ``on_blocks_ready`` and ``on_abort`` are called on the engine thread and must not block.
    """

    def expect(self, request_id: str, url: str, token_ids: list[int], cache_salt: str | None) -> None:
        """A remote-prefill request is about to be queued (called on the caller's loop)."""

    def on_blocks_ready(self, request_id: str, memory: TransferMemory) -> None:
        """A remote-prefill request holds its blocks now: start its transfer into ``memory``."""

    def on_abort(self, request_id: str) -> bool:
        """A request is being aborted: True to free its blocks now, False to keep them until reclaimed."""

    def on_finished(self, request_id: str) -> None:
        """A request finished normally (forget its bookkeeping)."""


class AsyncEngine:
    """Runs :class:`LLMEngine` in a thread; ``generate`` yields cumulative outputs."""

    def __init__(
        self,
        engine: LLMEngine,
        metrics: Metrics,
        max_waiting: int = 256,
        request_timeout: float | None = None,
        faults: Faults | None = None,
    ) -> None:
        self.engine = engine
        self.metrics = metrics
        self.max_waiting = max_waiting
        self.request_timeout = request_timeout
        self.faults = faults or Faults()
        if self.faults.kv_corruption is not None and engine.parallel is not None:
            raise ValueError("--inject-fault kv-corruption: not supported with --context-parallel-size > 1")
        if self.faults.touches_requests:
            engine.faults = FaultInjector(self.faults)
        if self.faults.host_load_delay is not None:
            if engine.host is None:
                raise ValueError("--inject-fault host-load-delay: needs a host tier (--host-cache-bytes N)")
            engine.host.copies.load_delay_s = self.faults.host_load_delay / 1000.0
        self._inbox: queue.SimpleQueue[_Add | tuple[Any, ...]] = queue.SimpleQueue()
        self.remote_kv: RemoteKVHooks | None = None  # set by the decode role
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._streams_lock = threading.Lock()
        self._ids = itertools.count()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvwarden-engine", daemon=True)
        self.error: BaseException | None = None

    def start(self) -> None:
        self._thread.start()

    def shutdown(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=10)
        if not self._thread.is_alive():  # the engine thread no longer steps: its workers may go
            self.engine.close()

    @property
    def kv_capacity(self) -> int:
        """Tokens the whole KV pool holds: no single request can be longer."""
        return self.engine.num_blocks * self.engine.config.cache.block_size

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def new_request_id(self, prefix: str) -> str:
        return f"{prefix}-{next(self._ids)}"

    async def generate(
        self,
        request_id: str,
        token_ids: list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        remote: str | None = None,
        hold: bool = False,
    ) -> AsyncIterator[RequestOutput]:
        """Queue a validated request and yield its outputs until it finishes.

        Cancelling the consumer (a disconnected client) aborts the request, so
        its KV blocks return to the pool (for a remote-prefill request, once
        the prefill instance says no write of its is in flight).

        Args:
            remote: URL of the prefill instance computing the prompt (decode role only).
            hold: keep the blocks after the request finishes (prefill role; see
                :meth:`kvwarden.engine.remote_kv.RemoteKV.release`).

        Raises:
            QueueFullError: ``max_waiting`` requests are already pending.
            ValueError: the engine rejected the request.
        """
        if remote is not None and self.remote_kv is None:
            raise ValueError("kv_transfer_params: this server is not a decode instance (start it with --role decode)")
        if self.error is not None:
            raise EngineDeadError(f"the engine is down: {type(self.error).__name__}: {self.error}")
        loop = asyncio.get_running_loop()
        stream = _Stream(loop=loop, queue=asyncio.Queue())
        with self._streams_lock:
            if len(self._streams) >= self.max_waiting:
                raise QueueFullError(f"{len(self._streams)} requests pending (limit {self.max_waiting})")
            self._streams[request_id] = stream
        if remote is not None:
            assert self.remote_kv is not None
            self.remote_kv.expect(request_id, remote, token_ids, cache_salt)
        self._inbox.put(_Add(request_id, token_ids, params, cache_salt, remote, hold))
        self._wake.set()
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finished:
                    finished = True
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))
        self._wake.set()

    def call(self, fn: Callable[[LLMEngine], Any]) -> asyncio.Future[Any]:
        """Run ``fn(engine)`` on the engine thread between steps; await its result."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self._inbox.put(("call", fn, future, loop))
        self._wake.set()
        return future

    def fail(self, request_id: str, exc: BaseException) -> None:
        """Abort a request and end its stream with ``exc`` (e.g. its prefill instance timed out)."""
        self._inbox.put(("fail", request_id, exc))
        self._wake.set()

    # ------------------------------------------------------------ engine thread
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain_inbox()
                self._expire()
                if not self.engine.has_unfinished_requests():
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                    continue
                crash_after = self.faults.engine_crash_after_steps
                if crash_after is not None and self.engine.num_steps >= crash_after:
                    raise RuntimeError(f"injected fault: engine crash after {crash_after} steps")
                outputs = self.engine.step()
                self.metrics.observe_engine(self.engine)
                if not self.engine.last_scheduled:  # all blocked on transfers: do not spin
                    self._wake.wait(timeout=0.005)
                    self._wake.clear()
                if self.remote_kv is not None:
                    for out in outputs:
                        if out.finished:
                            self.remote_kv.on_finished(out.request_id)
                    for req in self.engine.remote.take_newly_remote():
                        self.remote_kv.on_blocks_ready(req.request_id, self.engine.remote.target(req.request_id))
                for out in outputs:
                    self._deliver(out)
        except BaseException as exc:
            self.error = exc
            with self._streams_lock:
                streams = list(self._streams.values())
                self._streams.clear()
            dead = EngineDeadError(f"the engine failed: {type(exc).__name__}: {exc}")
            for stream in streams:
                with contextlib.suppress(RuntimeError):  # the client's loop is gone
                    stream.loop.call_soon_threadsafe(stream.queue.put_nowait, dead)
            raise

    def _drain_inbox(self) -> None:
        handled = False
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                if handled:  # aborts free blocks and adds queue requests: refresh the gauges now
                    self.metrics.observe_engine(self.engine)
                return
            handled = True
            if isinstance(item, tuple):
                self._control(item)
                continue
            try:
                self.engine.add_request(
                    item.token_ids,
                    item.params,
                    item.request_id,
                    item.cache_salt,
                    remote_prefill=item.remote is not None,
                    hold_blocks=item.hold,
                )
            except ValueError as exc:
                self._fail(item.request_id, exc)

    def _control(self, item: tuple[Any, ...]) -> None:
        kind = item[0]
        if kind == "call":
            _, fn, future, loop = item
            try:
                result, error = fn(self.engine), None
            except Exception as exc:  # the caller gets it; the engine goes on
                result, error = None, exc
            with contextlib.suppress(RuntimeError):  # the caller's loop is gone
                loop.call_soon_threadsafe(_settle, future, result, error)
            return
        rid = item[1]
        self._abort(rid)
        if kind == "fail":
            self._fail(rid, item[2])
        else:
            with self._streams_lock:
                self._streams.pop(rid, None)

    def _abort(self, request_id: str) -> None:
        free = self.remote_kv.on_abort(request_id) if self.remote_kv is not None else True
        out = self.engine.abort(request_id, free_blocks=free)
        if out is not None:
            self.metrics.observe_finished(out)

    def _expire(self) -> None:
        """Abort requests past the request timeout (their blocks return to the pool now)."""
        if self.request_timeout is None:
            return
        now = time.monotonic()
        with self._streams_lock:
            late = [rid for rid, s in self._streams.items() if now - s.arrival > self.request_timeout]
        for rid in late:
            self._abort(rid)
            message = f"the request ran past the server's request timeout of {self.request_timeout} s"
            self._fail(rid, RequestTimeoutError(message))
        if late:
            self.metrics.observe_engine(self.engine)

    def _fail(self, request_id: str, exc: BaseException) -> None:
        with self._streams_lock:
            stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, exc)

    def _deliver(self, out: RequestOutput) -> None:
        with self._streams_lock:
            stream = self._streams.get(out.request_id)
            if stream is not None and out.finished:
                del self._streams[out.request_id]
        if stream is None:
            return
        now = time.monotonic()
        new_tokens = len(out.token_ids) - stream.num_tokens
        if new_tokens > 0:
            if stream.last_token_time is None:
                self.metrics.ttft.observe(now - stream.arrival)
            else:
                self.metrics.itl.observe(now - stream.last_token_time)
            stream.last_token_time = now
            stream.num_tokens = len(out.token_ids)
        if out.finished:
            self.metrics.observe_finished(out, now - stream.arrival)
        item: RequestOutput | BaseException = (
            RequestFailedError(out.error, out.error_code) if out.error is not None else out
        )
        with contextlib.suppress(RuntimeError):  # the client's loop is gone
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
