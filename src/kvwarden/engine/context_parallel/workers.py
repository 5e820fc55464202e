"""Worker processes of one host for rank 0: started, watched, told each step, stopped - whatever they compute.

Context parallelism and tensor parallelism both run ranks 1.. as ``python -m MODULE --port P --rank R
--world N --timeout T`` processes that read rank 0's messages from a TCP store on loopback (JSON, never
pickle: ``context_parallel/group.py``) and exchange tensors through the ranks' gloo group.
"""

from __future__ import annotations

import subprocess
import sys
import time
import weakref

import torch.distributed as dist

from kvwarden.engine.context_parallel.group import COLLECTIVE_TIMEOUT_S, RankGroup

START_TIMEOUT_S = 600.0  # a worker loads the checkpoint before it reports ready


class RankWorkers:
    """Ranks ``1 .. world - 1`` of ``module``: :meth:`post` a message to all, :meth:`failure` names a dead
    or failed one, :meth:`stop` ends them (also at garbage collection or interpreter exit)."""

    def __init__(self, module: str, world: int, setup: bytes, what: str) -> None:
        self.module, self.world, self.what = module, world, what
        self.store: dist.TCPStore = RankGroup.open_store(world, COLLECTIVE_TIMEOUT_S)
        self.store.set("config", setup)
        self.procs = [self._spawn(rank) for rank in range(1, world)]
        self._finalizer = weakref.finalize(self, _stop_all, self.procs)
        self._step = 0

    @property
    def alive(self) -> bool:
        return self._finalizer.alive

    def _spawn(self, rank: int) -> subprocess.Popen:
        cmd = [sys.executable, "-m", self.module, "--port", str(self.store.port), "--rank", str(rank)]
        cmd += ["--world", str(self.world), "--timeout", str(COLLECTIVE_TIMEOUT_S)]
        # its own session: a Ctrl-C meant for the server reaches rank 0 alone, which then stops the workers
        return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, start_new_session=True)

    def wait_ready(self) -> None:
        """Until every worker has loaded and said so; raises naming the rank that failed or is late."""
        deadline = time.monotonic() + START_TIMEOUT_S
        waiting = set(range(1, self.world))
        while waiting:
            for rank in sorted(waiting):
                if self.store.check([f"ready{rank}"]):
                    waiting.discard(rank)
            failed = self.failure()
            if failed:
                self.stop()
                raise RuntimeError(failed)
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{self.what}: ranks {sorted(waiting)} not ready in {START_TIMEOUT_S:.0f} s")
            time.sleep(0.05)

    def failure(self) -> str | None:
        """A worker's reported error (its traceback), or which one exited, or None."""
        for rank, proc in enumerate(self.procs, start=1):
            if self.store.check([f"error{rank}"]):
                return f"{self.what} rank {rank} failed:\n{self.store.get(f'error{rank}').decode()}"
            if proc.poll() is not None:
                return f"{self.what} rank {rank} exited with code {proc.returncode}"
        return None

    def post(self, data: bytes) -> None:
        """One key per worker (``step{n}/{rank}``): each worker deletes its own after reading it."""
        for rank in range(1, self.world):
            self.store.set(f"step{self._step}/{rank}", data)
        self._step += 1

    def stop(self, goodbye: bytes | None = None) -> None:
        """Post ``goodbye`` (their stop message) and wait for them; end whoever is left (idempotent)."""
        if self._finalizer.alive and goodbye is not None:
            try:
                self.post(goodbye)
                for proc in self.procs:
                    proc.wait(timeout=10)
            except Exception:  # the store is gone or a worker is stuck: the finalizer ends them
                pass
        self._finalizer()


def _stop_all(procs: list[subprocess.Popen]) -> None:
    """End the workers now (they hold nothing worth keeping: weights and a cache copy)."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
