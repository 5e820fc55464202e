"""Layer split: each rank stores only its share of the attention layers' caches.

Attention layer ``i`` lives on rank ``i % world`` (its owner). In a step, every rank reads every layer
through a *view*: the blocks the step's requests read, renumbered ``0 .. m-1`` (the same numbering on
every rank, built from the step's entries). Before layer ``i``'s K/V write, its owner's cache rows of the
view arrive in a view buffer by broadcast; the rows the step computes are then written into the buffer
and exchanged as without the split, and the owner also writes them into its own cache. Two view buffers
alternate, so layer ``i + 1``'s broadcast runs on a prefetch thread with its own process group while
layer ``i`` computes (on GPUs that would be a CUDA stream and a communicator of its own; not built yet).

NOTE(invariant): ``kv[i]`` is the only way to layer ``i``'s buffer, and it waits for that layer's
broadcast: a new reader cannot forget the wait. ``unsafe_layer_split`` (testing only) skips it and reads
whatever the buffer holds (the previous layer's context, or a half-landed one): the race on demand.

NOTE(invariance): the view renames blocks, it changes no position: the attention plan's key tiles are
fixed to absolute positions, so reading a request's K/V through view slots gives the same bits as
through the pool's slots.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from kvwarden.config import EngineConfig
from kvwarden.engine.context_parallel.exchange import KV, row_width, rows_bytes, write_rows
from kvwarden.engine.context_parallel.group import COLLECTIVE_TIMEOUT_S, RankGroup
from kvwarden.engine.model_runner import BatchEntry, ModelRunner


def owner(layer: int, world: int) -> int:
    """The rank that stores attention layer ``layer``'s cache (round robin: neighbours on different ranks)."""
    return layer % world


def owned_layers(rank: int, world: int, num_layers: int) -> set[int]:
    return set(range(rank, num_layers, world))


@dataclass(frozen=True)
class StepView:
    """The blocks one step reads, in first-use order: view block ``j`` is pool block ``blocks[j]``."""

    blocks: list[int]
    block_size: int

    @staticmethod
    def of(entries: list[BatchEntry], block_size: int) -> StepView:
        seen: dict[int, None] = {}
        for e in entries:
            used = -(-(e.start + len(e.token_ids)) // block_size)  # blocks up to the chunk's last position
            seen.update(dict.fromkeys(e.block_ids[:used]))
        return StepView(list(seen), block_size)

    def remap(self, entries: list[BatchEntry]) -> list[BatchEntry]:
        """``entries`` over view blocks (only the blocks they read)."""
        index = {b: j for j, b in enumerate(self.blocks)}
        out = []
        for e in entries:
            used = -(-(e.start + len(e.token_ids)) // self.block_size)
            out.append(BatchEntry(e.request_id, e.token_ids, e.start, [index[b] for b in e.block_ids[:used]]))
        return out

    def pool_slots(self) -> torch.Tensor:
        """The pool slot of every view slot ``[m * block_size]``."""
        blocks = torch.tensor(self.blocks, dtype=torch.long)
        return (blocks[:, None] * self.block_size + torch.arange(self.block_size)).reshape(-1)


class Prefetcher:
    """One thread running broadcast jobs in order on its own process group (the prefetch 'stream')."""

    def __init__(self, group: RankGroup, delay_s: float = 0.0) -> None:
        self.group, self.delay_s = group, delay_s
        self._jobs: queue.SimpleQueue[tuple[Callable[[], None], threading.Event] | None] = queue.SimpleQueue()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kvwarden-layer-prefetch", daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], None]) -> threading.Event:
        done = threading.Event()
        self._jobs.put((job, done))
        return done

    def _run(self) -> None:
        while (item := self._jobs.get()) is not None:
            job, done = item
            if self.error is not None:  # the group is broken: later jobs would pair with stale collectives
                done.set()
                continue
            try:
                if self.delay_s:  # testing only (--inject-fault layer-split-delay): the broadcast lands late
                    time.sleep(self.delay_s)
                with torch.inference_mode():
                    job()
            except BaseException as e:  # reported to the compute thread at its next wait
                self.error = e
            done.set()

    def close(self) -> None:
        self._jobs.put(None)


class LayerSplitKV:
    """What the model indexes under the layer split: ``kv[i]`` is layer ``i``'s view buffer, holding the
    step's context of that layer once its owner's broadcast has landed.

    Args:
        runner: this rank's runner (its ``kv_caches`` hold the owned layers' caches; the others are empty).
        prefetch: the prefetcher whose group carries the owners' broadcasts.
        unsafe: testing only: ``kv[i]`` does not wait for the broadcast.
    """

    def __init__(self, runner: ModelRunner, prefetch: Prefetcher, unsafe: bool = False) -> None:
        self.runner, self.prefetch, self.unsafe = runner, prefetch, unsafe
        self.rank, self.world = prefetch.group.rank, prefetch.group.world
        self.num_layers = len(runner.kv_caches)
        self.view: StepView | None = None
        self.buffers: list[KV] = []
        self.capacity = 0  # view slots per buffer (the null slot is at this index)
        self.current = -1  # the layer last handed out
        self.peak_buffer_bytes = 0
        self._done: dict[int, threading.Event] = {}

    def __len__(self) -> int:
        return self.num_layers

    @property
    def null_slot(self) -> int:
        return self.capacity

    def begin(self, view: StepView, new_slots: torch.Tensor) -> None:
        """A new step: buffers large enough for its view, the first two layers' broadcasts started.

        ``new_slots``: the view slots of the rows the step computes. The broadcast carries every other
        slot of the view (the context): the new rows come from the exchange, and the owner's cache holds
        nothing for them yet.
        """
        self.view, self.current = view, -1
        need = len(view.blocks) * view.block_size
        if need > self.capacity:  # grow geometrically; the null slot (index capacity) stays zero
            self.capacity = max(need, 2 * self.capacity)
            self.buffers = [self.runner.model.new_kv_cache(self.capacity + 1) for _ in range(2)]
            self.peak_buffer_bytes = sum(t.numel() * t.element_size() for kv in self.buffers for t in kv)
        context = torch.ones(need, dtype=torch.bool)
        context[new_slots.cpu()] = False
        self._view_slots = context.nonzero().view(-1).to(self.runner.device)
        self._pool_slots = view.pool_slots().to(self.runner.device)[self._view_slots]
        self._done = {}
        for layer in range(min(2, self.num_layers)):
            self._start(layer)

    def __getitem__(self, layer: int) -> KV:
        # layer - 1 is done with its buffer: start layer + 1's broadcast into it
        if layer + 1 < self.num_layers and layer + 1 not in self._done:
            self._start(layer + 1)
        if not self.unsafe:
            self._done[layer].wait()
            self._raise()
        self.current = layer
        return self.buffers[layer % 2]

    def _start(self, layer: int) -> None:
        buffer, src, n = self.buffers[layer % 2], owner(layer, self.world), len(self._pool_slots)
        pool, view_slots, pool_slots = self.runner.kv_caches.raw(layer), self._view_slots, self._pool_slots

        def job() -> None:  # reads only what was captured at submission: the step's own view
            if self.rank == src:
                payload = rows_bytes(pool, pool_slots)
            else:
                payload = torch.empty((n, row_width(buffer)), dtype=torch.uint8, device=self.runner.device)
            self.prefetch.group.broadcast_rows(payload, root=src)
            write_rows(buffer, view_slots, payload)

        self._done[layer] = self.prefetch.submit(job)

    def store_rows(self, kv: KV, view_slots: torch.Tensor, pool_slots: torch.Tensor) -> None:
        """The owner of the current layer keeps the step's new rows (every rank's) in its own cache."""
        if owner(self.current, self.world) == self.rank:
            pool = self.runner.kv_caches.raw(self.current)
            for src, dst in zip(kv, pool, strict=True):
                dst.index_copy_(0, pool_slots, src[view_slots])

    def settle(self) -> None:
        """End of step: every broadcast done (an unsafe read may have raced one; none outlives the step)."""
        for done in self._done.values():
            done.wait()
        self._raise()

    def _raise(self) -> None:
        if self.prefetch.error is not None:
            raise RuntimeError(f"layer-split prefetch failed: {self.prefetch.error}") from self.prefetch.error


class SplitExchange:
    """The per-layer exchange under the split: every rank's new rows into every view buffer, then the
    layer's owner stores them in its cache."""

    def __init__(self, layers: LayerSplitKV, group: RankGroup, view_slots: list[torch.Tensor], pool: torch.Tensor):
        self.layers, self.group, self.view_slots = layers, group, view_slots
        self.counts = [len(s) for s in view_slots]
        self.all_view = torch.cat(view_slots)
        self.all_pool = pool  # the pool slot of every new row, in rank order

    def __call__(self, kv: KV) -> None:
        rank = self.group.rank
        parts = self.group.all_gather_rows(rows_bytes(kv, self.view_slots[rank]), self.counts)
        for r, part in enumerate(parts):
            if r != rank and len(part):
                write_rows(kv, self.view_slots[r], part)
        self.layers.store_rows(kv, self.all_view, self.all_pool)


def layer_split_kv(runner: ModelRunner, store: dist.Store, rank: int, config: EngineConfig) -> LayerSplitKV:
    """This rank's view of the split layers, its prefetch thread on a process group of its own."""
    par = config.parallel
    prefix = dist.PrefixStore("prefetch/", store)  # the second group's keys apart from the first's
    group = RankGroup(prefix, rank, par.context_parallel_size, runner.device, COLLECTIVE_TIMEOUT_S)
    return LayerSplitKV(runner, Prefetcher(group, par.layer_split_delay_ms / 1000.0), par.unsafe_layer_split)
