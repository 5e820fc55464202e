"""Rank 0's side of context parallelism: start the workers, split long steps, keep their caches whole."""

from __future__ import annotations

import logging
import os
import pickle
import subprocess
import sys
import time
import weakref

import torch

from kvwarden.config import EngineConfig
from kvwarden.engine.context_parallel.exchange import sync_rows
from kvwarden.engine.context_parallel.group import COLLECTIVE_TIMEOUT_S, RankGroup, as_bytes
from kvwarden.engine.context_parallel.layer_split import LayerSplitKV, layer_split_kv
from kvwarden.engine.context_parallel.step import forward_share
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
    if runner.device.type == "cuda" and torch.cuda.device_count() < config.parallel.context_parallel_size:
        n = torch.cuda.device_count()
        return f"context_parallel_size: {config.parallel.context_parallel_size} ranks need as many GPUs; {n} visible"
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
        self._step = 0
        self.store = RankGroup.open_store(self.world, COLLECTIVE_TIMEOUT_S)
        threads = max(1, (os.cpu_count() or 1) // self.world)
        self.store.set("config", pickle.dumps((config, num_blocks, threads)))
        self.procs = [self._spawn(rank) for rank in range(1, self.world)]
        self._finalizer = weakref.finalize(self, _stop_all, self.procs)
        self._wait_ready()
        self.group = RankGroup(self.store, 0, self.world, runner.device, COLLECTIVE_TIMEOUT_S)
        self.every_step = par.layer_split
        self.layers = layer_split_kv(runner, self.store, 0, config) if par.layer_split else None
        self.split_steps = 0
        self.synced_steps = 0
        log.info("context parallelism: %d ranks, steps of >= %d rows split", self.world, self.min_tokens)

    def _spawn(self, rank: int) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "kvwarden.engine.context_parallel.worker", "--port", str(self.store.port)]
        cmd += ["--rank", str(rank), "--world", str(self.world), "--timeout", str(COLLECTIVE_TIMEOUT_S)]
        return subprocess.Popen(cmd, stdin=subprocess.DEVNULL)

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        waiting = set(range(1, self.world))
        while waiting:
            for rank in sorted(waiting):
                if self.store.check([f"ready{rank}"]):
                    waiting.discard(rank)
            failed = self._failure()
            if failed:
                self.close()
                raise RuntimeError(failed)
            if time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"context parallelism: ranks {sorted(waiting)} not ready in {START_TIMEOUT_S:.0f} s")
            time.sleep(0.05)

    def _failure(self) -> str | None:
        """A worker's reported error (its traceback), or which one exited, or None."""
        for rank, proc in enumerate(self.procs, start=1):
            if self.store.check([f"error{rank}"]):
                return f"context-parallel rank {rank} failed:\n{self.store.get(f'error{rank}').decode()}"
            if proc.poll() is not None:
                return f"context-parallel rank {rank} exited with code {proc.returncode}"
        return None

    def eligible(self, rows: int) -> bool:
        """Whether a step of ``rows`` rows is split (else rank 0 runs it and :meth:`sync` copies its K/V)."""
        return rows >= self.min_tokens

    def forward(self, entries: list[BatchEntry], split: bool) -> torch.Tensor:
        """The step's final hidden rows ``[rows, hidden]``: each rank computing its share (``split``), or
        rank 0 all of them with the others serving their layers (layer split, a short step)."""
        self._post(("forward", entries, split))
        try:
            hidden, counts = forward_share(self.runner, entries, self.group, split, self.layers)
            parts = self.group.gather_rows(as_bytes(hidden), counts)
        except RuntimeError as e:
            raise RuntimeError(f"context-parallel step failed: {self._failure() or e}") from e
        self.split_steps += split
        return torch.cat(parts).view(hidden.dtype).view(sum(counts), -1)

    def sync(self, entries: list[BatchEntry]) -> None:
        """Copy the K/V rows a step rank 0 ran alone wrote into every worker's cache."""
        if not entries:
            return
        self._post(("sync", entries))
        try:
            sync_rows(self.runner, entries, self.group)
        except RuntimeError as e:
            raise RuntimeError(f"context-parallel sync failed: {self._failure() or e}") from e
        self.synced_steps += 1

    def _post(self, msg: tuple) -> None:
        """One key per worker (``step{n}/{rank}``): each worker deletes its own after reading it."""
        data = pickle.dumps(msg)
        for rank in range(1, self.world):
            self.store.set(f"step{self._step}/{rank}", data)
        self._step += 1

    def close(self) -> None:
        """Stop the workers: each ends its loop on the stop message (idempotent)."""
        if not self._finalizer.alive:
            return
        if self.layers is not None:
            self.layers.prefetch.close()
        try:
            self._post(("stop",))
            for proc in self.procs:
                proc.wait(timeout=10)
        except Exception:  # the store is gone or a worker is stuck: the finalizer ends them
            pass
        self._finalizer()


def _stop_all(procs: list[subprocess.Popen]) -> None:
    """Garbage collection or interpreter exit without :meth:`ContextParallel.close`: end the workers now
    (they hold nothing worth keeping: a copy of the weights and of rank 0's cache)."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
