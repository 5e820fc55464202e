"""Rank 0's side of context parallelism: start the workers, split long steps, keep their caches whole."""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any

import torch

from kvwarden.config import EngineConfig
from kvwarden.engine.context_parallel.exchange import sync_rows
from kvwarden.engine.context_parallel.group import COLLECTIVE_TIMEOUT_S, RankGroup, as_bytes
from kvwarden.engine.context_parallel.layer_split import LayerSplitKV, layer_split_kv, owned_layers
from kvwarden.engine.context_parallel.messages import FORWARD, STOP, SYNC, encode_setup, encode_step
from kvwarden.engine.context_parallel.step import forward_share
from kvwarden.engine.context_parallel.workers import RankWorkers
from kvwarden.engine.model_runner import BatchEntry, ModelRunner

log = logging.getLogger(__name__)

START_TIMEOUT_S = 600.0  # a worker loads the checkpoint before it reports ready


def unsupported(config: EngineConfig, runner: ModelRunner) -> str | None:
    """Why this engine cannot split its steps across ranks, naming the setting; None when it can."""
    model = runner.model
    if model.cfg.recurrent_layers:
        return (
            "context_parallel_size: the model has recurrent layers (gated DeltaNet / Mamba2), whose scan is "
            "sequential over positions; context parallelism needs attention-only models"
        )
    if config.cache.host_cache_bytes:
        return "context_parallel_size: not supported with the host tier (host_cache_bytes) yet"
    if runner.device.type != "cpu":
        # NOTE: the ranks' groups are gloo's; GPUs need NCCL groups, a device per rank and a prefetch stream
        # of its own, which nothing here has run on yet (no machine with two GPUs): refused, not guessed.
        return "context_parallel_size: runs on the CPU only so far (device='cpu'); GPU ranks are not supported yet"
    if config.cuda_graphs == "emulate" and config.parallel.layer_split:
        return "cuda_graphs: 'emulate' cannot be combined with layer_split (every step runs on all ranks, eagerly)"
    return None


class ContextParallel:
    """Rank 0's view of the ranks: :meth:`eligible`, :meth:`forward`, :meth:`sync`, :meth:`close`.

    Rank 0 posts each message to the TCP store under ``step{n}/{rank}``; workers read them in order. The tensors
    themselves go through the process group's collectives, never through the store.
    """

    def __init__(self, config: EngineConfig, runner: ModelRunner, num_blocks: int) -> None:
        why = unsupported(config, runner)
        if why is not None:
            raise ValueError(why)
        par = config.parallel
        self.world, self.min_tokens = par.context_parallel_size, par.context_parallel_min_tokens
        self.runner = runner
        self.layers: LayerSplitKV | None = None
        self.group: RankGroup | None = None
        self.broken: str | None = None
        self._step = 0
        threads = max(1, (os.cpu_count() or 1) // self.world)
        self.workers = RankWorkers(
            "kvwarden.engine.context_parallel.worker", self.world, encode_setup(config, num_blocks, threads),
            "context-parallel",
        )  # fmt: skip
        self.store = self.workers.store
        self.workers.wait_ready()
        self.group = RankGroup(self.store, 0, self.world, runner.device, COLLECTIVE_TIMEOUT_S)
        self.every_step = par.layer_split
        self.layers = layer_split_kv(runner, self.store, 0, config) if par.layer_split else None
        self.split_steps = 0
        log.info("context parallelism: %d ranks, steps of >= %d rows split", self.world, self.min_tokens)

    def eligible(self, rows: int) -> bool:
        """Whether a step of ``rows`` rows is split (else rank 0 runs it and :meth:`sync` copies its K/V)."""
        return rows >= self.min_tokens

    def forward(self, entries: list[BatchEntry], split: bool, want_rows: list[int] | None = None) -> torch.Tensor:
        """The step's final hidden rows ``[rows, hidden]``: each rank computing its share (``split``), or
        rank 0 all of them with the others serving their layers (layer split, a short step)."""
        self._post(encode_step(FORWARD, entries, split))
        try:
            hidden, counts = forward_share(self.runner, entries, self.group, split, self.layers)
            parts = self.group.gather_rows(as_bytes(hidden), counts)
        except BaseException as e:
            raise self._break("step", e) from e
        self.split_steps += split
        return torch.cat(parts).view(hidden.dtype).view(sum(counts), -1)

    def sync(self, entries: list[BatchEntry]) -> None:
        """Copy the K/V rows a step rank 0 ran alone wrote into every worker's cache."""
        if not entries:
            return
        self._post(encode_step(SYNC, entries))
        try:
            sync_rows(self.runner, entries, self.group)
        except BaseException as e:
            raise self._break("sync", e) from e

    def _break(self, what: str, cause: BaseException) -> RuntimeError:
        """A step failed part-way: the ranks may stand at different collectives, so the group cannot be
        reused (a later collective would pair with a stale one). End the workers; every later step fails."""
        self.broken = f"context-parallel {what} failed: {self.workers.failure() or cause!r}"
        self.workers.stop()
        return RuntimeError(self.broken)

    def stats(self) -> dict[str, Any]:
        """What ``LLMEngine.stats`` reports of the ranks (``/metrics`` exports the per-rank bytes)."""
        kv, n = self.runner.kv_caches, self.world
        if self.layers is None:  # every rank a full copy in rank 0's layout
            per_rank = [kv.nbytes] * n
        else:  # each rank its owned layers, all of one size
            layers = len(kv)
            per_layer = max(sum(t.numel() * t.element_size() for t in kv.raw(i)) for i in range(layers))
            per_rank = [len(owned_layers(r, n, layers)) * per_layer for r in range(n)]
        return {
            "tensor_parallel_size": 1,
            "tensor_parallel_gathered_bytes": 0,
            "context_parallel_size": n,
            "kv_cache_bytes_per_rank": per_rank,
            "layer_split_buffer_bytes": self.layers.peak_buffer_bytes if self.layers is not None else 0,
            "context_parallel_split_steps": self.split_steps,
        }

    @staticmethod
    def single_rank_stats(runner: ModelRunner) -> dict[str, Any]:
        """The same keys without context parallelism."""
        return {
            "tensor_parallel_size": 1,
            "tensor_parallel_gathered_bytes": 0,
            "context_parallel_size": 1,
            "kv_cache_bytes_per_rank": [runner.kv_caches.nbytes],
            "layer_split_buffer_bytes": 0,
            "context_parallel_split_steps": 0,
        }

    def _post(self, data: bytes) -> None:
        if self.broken is not None:
            raise RuntimeError(f"{self.broken} (the context-parallel ranks are stopped; build a new engine)")
        if self.group is None:
            raise RuntimeError("context parallelism: the engine was closed")
        self.workers.post(data)

    def close(self) -> None:
        """Stop the workers (each ends its loop on the stop message), the groups and the store (idempotent)."""
        self.workers.stop(encode_step(STOP) if self.broken is None and self.group is not None else None)
        if self.layers is not None:
            self.layers.prefetch.close()
        for group in (self.group, self.layers.prefetch.group if self.layers is not None else None):
            if group is not None:
                with contextlib.suppress(Exception):
                    group.close()
        self.group = self.layers = None  # type: ignore[assignment]
        self.store = None  # type: ignore[assignment]  # its listening socket closes with it
