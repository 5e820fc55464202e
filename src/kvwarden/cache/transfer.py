"""Block copies between the device KV pool and the host tier, off the compute path.

One worker thread per engine takes copy jobs in order (FIFO: a load queued
after a write-back of the same host slot reads what the write-back wrote). On
a GPU it issues them on its own CUDA stream and records a CUDA event per job:
host slots are sorted into runs of consecutive slots, so every run moves as
one asynchronous copy straight from or into pinned host memory, and the
device side is one gather or scatter (no copy of the data on the host). On the
CPU the worker copies itself, in parallel with the forward pass (PyTorch
releases the GIL inside a copy). Each job answers with a :class:`Ticket`; whoever reads the
destination first waits on it (see :class:`kvwarden.cache.paged_kv.PagedKV`).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

KV = tuple[torch.Tensor, torch.Tensor]


@dataclass
class Ticket:
    """One queued copy: ``wait`` before reading its destination on the compute path.

    On a GPU the wait is a stream dependency (no host synchronisation);
    ``synchronize`` blocks the host until the copy has really finished (before
    a block it touches may be handed to anyone else).
    """

    done: threading.Event = field(default_factory=threading.Event)
    event: torch.cuda.Event | None = None
    error: BaseException | None = None

    def wait(self) -> None:
        self.done.wait()
        if self.error is not None:
            raise RuntimeError(f"host-tier copy failed: {self.error}") from self.error
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)

    def synchronize(self) -> None:
        self.done.wait()
        if self.event is not None:
            self.event.synchronize()


def block_rows(block_ids: list[int], block_size: int) -> torch.Tensor:
    """Flat cache rows of whole blocks, in order."""
    ids = torch.tensor(block_ids, dtype=torch.long)
    return (ids[:, None] * block_size + torch.arange(block_size)[None, :]).reshape(-1)


def slot_runs(slots: list[int], blocks: list[int]) -> tuple[list[tuple[int, int]], list[int]]:
    """Host slots as runs ``(first, count)`` of consecutive slots, and the device blocks in run order."""
    pairs = sorted(zip(slots, blocks, strict=True))
    runs: list[tuple[int, int]] = []
    for slot, _ in pairs:
        if runs and runs[-1][0] + runs[-1][1] == slot:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((slot, 1))
    return runs, [b for _, b in pairs]


class CopyEngine:
    """Runs copy jobs in order on a worker thread (and a CUDA stream on a GPU).

    Attributes:
        load_delay_s: testing only (``--inject-fault host-load-delay=MS``): each
            layer's load waits this long before copying, so a reader that does
            not wait for its ticket reads the block's old contents.
    """

    def __init__(self, device: torch.device, block_size: int) -> None:
        self.device = device
        self.block_size = block_size
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device=device) if self.cuda else None
        self.load_delay_s = 0.0
        self._jobs: queue.SimpleQueue[tuple[Callable[[Ticket], None], Ticket] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="kvwarden-copy", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=10)

    def _submit(self, job: Callable[[Ticket], None]) -> Ticket:
        ticket = Ticket()
        if self.cuda:
            assert self.stream is not None
            # The copy must see every write the compute stream has queued so far (a block's last KV).
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        self._jobs.put((job, ticket))
        return ticket

    def load(self, host: KV, slots: list[int], dev: KV, blocks: list[int], parts: tuple[int, ...] = (0, 1)) -> Ticket:
        """Queue one layer's copy of host ``slots`` into device ``blocks`` (``parts``: of its K and V tensors,
        both by default); done when they have landed."""
        bs = self.block_size
        runs, ordered = slot_runs(slots, blocks)
        host, dev = tuple(host[i] for i in parts), tuple(dev[i] for i in parts)

        def job(ticket: Ticket) -> None:
            if self.load_delay_s:
                time.sleep(self.load_delay_s)
            if not self.cuda:
                src, dst = block_rows(slots, bs), block_rows(blocks, bs)
                for h, d in zip(host, dev, strict=True):
                    d.index_copy_(0, dst, h.index_select(0, src))
                return
            with torch.cuda.stream(self.stream):
                rows = block_rows(ordered, bs).pin_memory().to(self.device, non_blocking=True)  # pageable would sync
                for h, d in zip(host, dev, strict=True):
                    parts = [h[first * bs : (first + n) * bs].to(self.device, non_blocking=True) for first, n in runs]
                    d.index_copy_(0, rows, parts[0] if len(parts) == 1 else torch.cat(parts))
                ticket.event = torch.cuda.Event()
                ticket.event.record(self.stream)

        return self._submit(job)

    def write_back(self, dev: list[KV], blocks: list[int], host: list[KV], slots: list[int]) -> list[Ticket]:
        """Queue every layer's copy of device ``blocks`` into host ``slots``; one ticket per layer.

        A ticket completes as soon as its layer's rows have been read from the
        device (the blocks may then be overwritten). On a GPU one job gathers
        every layer on the copy stream, then downloads each run of host slots
        straight into pinned memory; on the CPU each layer is its own job, so
        layer ``i`` of the forward waits only for layer ``i``'s write-back.
        """
        bs = self.block_size
        if not self.cuda:
            src, dst = block_rows(blocks, bs), block_rows(slots, bs)

            def layer_job(dev_kv: KV, host_kv: KV) -> Callable[[Ticket], None]:
                def job(ticket: Ticket) -> None:
                    for d, h in zip(dev_kv, host_kv, strict=True):
                        h.index_copy_(0, dst, d.index_select(0, src))

                return job

            return [self._submit(layer_job(d, h)) for d, h in zip(dev, host, strict=True)]
        runs, ordered = slot_runs(slots, blocks)

        def job(ticket: Ticket) -> None:
            assert self.stream is not None
            with torch.cuda.stream(self.stream):
                rows = block_rows(ordered, bs).pin_memory().to(self.device, non_blocking=True)  # pageable would sync
                gathered = [[d.index_select(0, rows) for d in dev_kv] for dev_kv in dev]
                ticket.event = torch.cuda.Event()
                ticket.event.record(self.stream)
                ticket.done.set()  # readers may go on: the rows are out of the blocks
                for host_kv, kv_g in zip(host, gathered, strict=True):
                    for h, g in zip(host_kv, kv_g, strict=True):
                        offset = 0
                        for first, n in runs:  # pinned destination: asynchronous downloads
                            h[first * bs : (first + n) * bs].copy_(g[offset : offset + n * bs], non_blocking=True)
                            offset += n * bs
                self.stream.synchronize()  # the next job (a load of these slots, maybe) sees them complete

        ticket = self._submit(job)
        return [ticket] * len(dev)

    def _run(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            job, ticket = item
            try:
                job(ticket)
            except BaseException as exc:  # reported to whoever waits on the ticket, and logged
                ticket.error = exc
                logging.getLogger("kvwarden").error("host-tier copy failed: %s: %s", type(exc).__name__, exc)
            ticket.done.set()
