"""The ranks of one host as a process group: a TCP store and gloo, both on loopback only.

The group is built from torch's process-group classes directly, not ``torch.distributed``'s default
group: an engine is one object among others in the user's process (tests build several), and the
default group is process-wide state that only one of them could own.

NOTE(security): the store's listening socket is bound to 127.0.0.1 by us (``master_listen_fd``; torch's
own would listen on every interface), gloo's pairs to 127.0.0.1, and what travels through the store is
JSON, never pickle: a local process that writes a key cannot run code in a worker.
"""

from __future__ import annotations

import datetime
import math
import socket

import torch
import torch.distributed as dist

HOST = "127.0.0.1"  # every rank is on this host: nothing listens beyond loopback
# A collective waits this long for a slower rank (one layer of a long prefill on a busy CPU) before
# it fails the step: long enough for any real step, short enough that a dead worker surfaces.
COLLECTIVE_TIMEOUT_S = 600.0


class RankGroup:
    """This process's rank among ``world`` and the collectives the engine needs, on byte rows.

    Payloads travel as ``uint8`` rows: a K/V row or a hidden row is copied bit for bit whatever its
    dtype (gloo has no bfloat16 reductions, and nothing here reduces).
    """

    def __init__(self, store: dist.Store, rank: int, world: int, device: torch.device, timeout_s: float) -> None:
        if device.type != "cpu":
            raise ValueError(f"context parallelism: gloo groups hold CPU tensors, not {device.type}")
        self.rank, self.world, self.device = rank, world, device
        opts = dist.ProcessGroupGloo._Options()
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=HOST)]
        opts._timeout = datetime.timedelta(seconds=timeout_s)
        self.pg = dist.ProcessGroupGloo(store, rank, world, opts)

    @staticmethod
    def open_store(world: int, timeout_s: float) -> dist.TCPStore:
        """Rank 0's store on a free port of 127.0.0.1 (``store.port``); the workers connect to it."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind((HOST, 0))
        sock.listen(64)
        port = sock.getsockname()[1]
        timeout = datetime.timedelta(seconds=timeout_s)
        # the store owns the listening descriptor from here on (detach: Python will not close it)
        return dist.TCPStore(HOST, port, world, True, timeout, wait_for_workers=False, master_listen_fd=sock.detach())

    @staticmethod
    def connect_store(port: int, world: int, timeout_s: float) -> dist.TCPStore:
        return dist.TCPStore(HOST, port, world, False, timeout=datetime.timedelta(seconds=timeout_s))

    def all_gather_rows(self, rows: torch.Tensor, counts: list[int]) -> list[torch.Tensor]:
        """Every rank's ``[counts[r], width]`` byte rows, in rank order (this rank's ``rows`` among them)."""
        padded = _pad(rows, max(counts))
        out = [torch.empty_like(padded) for _ in range(self.world)]
        self.pg.allgather([out], [padded]).wait()
        return [o[:n] for o, n in zip(out, counts, strict=True)]

    def gather_rows(self, rows: torch.Tensor, counts: list[int]) -> list[torch.Tensor]:
        """Rank 0: every rank's byte rows in rank order; the other ranks: an empty list."""
        padded = _pad(rows, max(counts))
        opts = dist.GatherOptions()
        opts.rootRank = 0
        out = [[torch.empty_like(padded) for _ in range(self.world)]] if self.rank == 0 else []
        self.pg.gather(out, [padded], opts).wait()
        return [o[:n] for o, n in zip(out[0], counts, strict=True)] if self.rank == 0 else []

    def broadcast_rows(self, rows: torch.Tensor, root: int = 0) -> torch.Tensor:
        """Rank ``root``'s ``rows`` on every rank (the others pass a tensor of the same shape to fill)."""
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        self.pg.broadcast([rows], opts).wait()
        return rows

    def close(self) -> None:
        shutdown = getattr(self.pg, "shutdown", None)
        if shutdown is not None:
            shutdown()


def _pad(rows: torch.Tensor, n: int) -> torch.Tensor:
    if rows.shape[0] == n:
        return rows.contiguous()
    out = rows.new_zeros((n, rows.shape[1]))
    out[: rows.shape[0]] = rows
    return out


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """``[rows, ...]`` as ``[rows, bytes]`` ``uint8`` (a view when contiguous)."""
    return t.contiguous().view(t.shape[0], math.prod(t.shape[1:])).view(torch.uint8)
