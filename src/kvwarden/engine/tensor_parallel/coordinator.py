"""Rank 0's side of tensor parallelism: start the workers, run every step on all ranks, sample alone."""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any

import torch

from kvwarden.config import EngineConfig
from kvwarden.engine.context_parallel.group import COLLECTIVE_TIMEOUT_S, RankGroup
from kvwarden.engine.context_parallel.messages import encode_setup
from kvwarden.engine.context_parallel.workers import RankWorkers
from kvwarden.engine.model_runner import BatchEntry, ModelRunner
from kvwarden.engine.tensor_parallel.comm import GlooColumns
from kvwarden.engine.tensor_parallel.messages import FORWARD, STOP, encode_step
from kvwarden.engine.tensor_parallel.state_journal import StateJournal

log = logging.getLogger(__name__)


def unsupported(config: EngineConfig, runner: ModelRunner) -> str | None:
    """Why this engine cannot run on tensor-parallel ranks, naming the setting (the model's own limits are
    ``models/tensor_shard.py``'s); None when it can."""
    if runner.device.type != "cpu":
        # NOTE: GPU ranks need NCCL groups, a device per rank and GEMM tiles chosen by the full weight's shape
        # (a column's bits must not depend on the shard's width); nothing here has run on two GPUs yet.
        return "tensor_parallel_size: runs on the CPU only so far (device='cpu'); GPU ranks are not supported yet"
    if config.parallel.context_parallel_size > 1:
        return "tensor_parallel_size: not combined with context_parallel_size yet"
    if config.cache.host_cache_bytes:
        return "tensor_parallel_size: not supported with the host tier (host_cache_bytes) yet"
    spec = config.speculative
    if spec is not None and spec.method == "mtp":
        return "tensor_parallel_size: MTP speculation reads the full LM head on rank 0; use method 'ngram'"
    return None


def run_step(runner: ModelRunner, entries: list[BatchEntry], want: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's part of one step: the full hidden rows (every rank ends each layer with all of them) and,
    for the ``want`` rows, the full logits (each rank's vocabulary block, gathered)."""
    batch = runner.make_batch(entries)
    hidden = runner.model.forward(batch, runner.kv_caches)
    rows = torch.tensor(want, dtype=torch.long, device=runner.device)
    return hidden, runner.model.logits(hidden[rows]) if want else torch.empty((0, 0))


class TensorParallel:
    """The runner's :class:`~kvwarden.engine.model_runner.StepParallel` for tensor parallelism: every step
    runs on every rank (``every_step``), the logits come out of the step (``step_logits``)."""

    every_step = True

    def __init__(
        self, config: EngineConfig, runner: ModelRunner, num_blocks: int, journal: StateJournal | None = None
    ) -> None:
        """``journal``: a hybrid model's state-pool calls, which every step's message carries to the workers."""
        why = unsupported(config, runner)
        if why is not None:
            raise ValueError(why)
        self.world = config.parallel.tensor_parallel_size
        self.runner, self.journal = runner, journal
        self.broken: str | None = None
        self._logits: torch.Tensor | None = None
        threads = max(1, (os.cpu_count() or 1) // self.world)
        setup = encode_setup(config, num_blocks, threads)
        self.workers = RankWorkers("kvwarden.engine.tensor_parallel.worker", self.world, setup, "tensor-parallel")
        self.workers.wait_ready()
        self.group: RankGroup | None = RankGroup(self.workers.store, 0, self.world, runner.device, COLLECTIVE_TIMEOUT_S)
        self.comm = GlooColumns(self.group)
        runner.model.shard.comm = self.comm
        torch.set_num_threads(threads)  # the ranks share this host's cores
        self.steps = 0
        log.info("tensor parallelism: %d ranks on the CPU (gloo), %d threads each", self.world, threads)

    def eligible(self, rows: int) -> bool:
        return False  # no step is split by rows: every step runs whole on every rank

    def forward(self, entries: list[BatchEntry], split: bool, want_rows: list[int] | None = None) -> torch.Tensor:
        if self.broken is not None:
            raise RuntimeError(f"{self.broken} (the tensor-parallel ranks are stopped; build a new engine)")
        if self.group is None:
            raise RuntimeError("tensor parallelism: the engine was closed")
        want = want_rows or []
        self.workers.post(encode_step(FORWARD, entries, want, self.journal.take() if self.journal else None))
        try:
            hidden, self._logits = run_step(self.runner, entries, want)
        except BaseException as e:
            self.broken = f"tensor-parallel step failed: {self.workers.failure() or repr(e)}"
            self.workers.stop()
            raise RuntimeError(self.broken) from e
        self.steps += 1
        return hidden

    def step_logits(self) -> torch.Tensor:
        """The last step's logits of its wanted rows (``[rows, vocab]`` float32, the gathered blocks)."""
        assert self._logits is not None
        return self._logits

    def sync(self, entries: list[BatchEntry]) -> None:
        """Nothing: every rank ran the step itself."""

    def stats(self) -> dict[str, Any]:
        kv = self.runner.kv_caches.nbytes
        return {
            "tensor_parallel_size": self.world,
            "tensor_parallel_steps": self.steps,
            "tensor_parallel_gathered_bytes": self.comm.bytes_gathered,
            "context_parallel_size": 1,
            "kv_cache_bytes_per_rank": [kv] * self.world,
            "layer_split_buffer_bytes": 0,
            "context_parallel_split_steps": 0,
        }

    def close(self) -> None:
        """Stop the workers, the group and the store (idempotent)."""
        self.workers.stop(encode_step(STOP) if self.broken is None and self.group is not None else None)
        if self.group is not None:
            with contextlib.suppress(Exception):
                self.group.close()
        self.group = None
