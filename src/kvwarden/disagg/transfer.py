"""Moving a request's KV blocks (and recurrent working state) between engines, through NIXL.

Disaggregated serving: the decode instance allocates a request's blocks, the
prefill instance computes the prompt and *writes* its KV straight into them
(one-sided RDMA-style writes; NIXL over UCX, TCP on a CPU-only host). Each
engine registers its KV tensors and state tensors once; a peer describes its
memory as a :class:`Layout` (base address and bytes per unit of every tensor:
a block of a KV tensor, a slot of a state tensor), sent with each request over
the control channel (``kvwarden.disagg.protocol``).

A transfer is cut into slices (one per attention layer, plus one for the
recurrent state) posted one after another, so an abort can arrive *during* a
transfer: the prefill side then stops posting, waits for what it posted, and
only then answers "safe to reclaim" (see ``kvwarden.disagg.prefill``).

Why NIXL (vLLM's transfer library): it is a pip wheel that runs here on UCX's
TCP transport (~1.2 GB/s over loopback), reports a dead peer within about
0.1 s, and its writes land in the target's memory without the target's
engine taking part; docs/architecture.md records what else was tried.
"""

from __future__ import annotations

import importlib
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger("kvwarden.pd")

# UCX reads these when the agent starts. Loopback TCP is the default that works on any host;
# set UCX_NET_DEVICES (and UCX_TLS for RDMA) to move KV between machines.
UCX_DEFAULTS = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}


def load_nixl() -> Any:
    """The NIXL Python API (``nixl-cu12`` wheel), or a clear error naming the install."""
    errors = []
    for name in ("nixl_cu12._api", "nixl_cu13._api", "nixl._api"):  # the CUDA 12 / 13 wheels, the meta package
        try:
            return importlib.import_module(name)
        except ImportError as exc:
            errors.append(f"{name}: {exc}")
    raise RuntimeError(
        "--role prefill/decode moves KV through NIXL: pip install 'kvwarden[pd]' (nixl-cu12==1.5.1, or nixl-cu13 "
        f"with a CUDA 13 torch); tried {'; '.join(errors)}"
    )


@dataclass(frozen=True)
class Region:
    """One registered tensor: ``units`` units of ``unit_bytes`` each, starting at ``addr``."""

    addr: int
    unit_bytes: int
    units: int
    device: int  # -1: host memory

    def at(self, unit: int) -> tuple[int, int, int]:
        """NIXL descriptor ``(address, length, device id)`` of one unit."""
        assert 0 <= unit < self.units, f"unit {unit} outside [0, {self.units})"
        return self.addr + unit * self.unit_bytes, self.unit_bytes, max(self.device, 0)


@dataclass(frozen=True)
class Layout:
    """An engine's transferable memory: KV tensors (unit = block) per attention layer, state tensors (unit = slot).

    ``kv`` holds ``(K, V)`` regions per attention layer; ``state`` every recurrent
    tensor of the working slots (conv windows, scan states, pending rows);
    ``snapshot`` every tensor of the boundary-state snapshots (unit = snapshot slot).
    """

    block_size: int
    kv: tuple[tuple[Region, Region], ...]
    state: tuple[Region, ...]
    snapshot: tuple[Region, ...] = ()

    def to_json(self) -> dict[str, Any]:
        def r(x: Region) -> list[int]:
            return [x.addr, x.unit_bytes, x.units, x.device]

        return {
            "block_size": self.block_size,
            "kv": [[r(k), r(v)] for k, v in self.kv],
            "state": [r(s) for s in self.state],
            "snapshot": [r(s) for s in self.snapshot],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Layout:
        return cls(
            block_size=int(data["block_size"]),
            kv=tuple((Region(*k), Region(*v)) for k, v in data["kv"]),
            state=tuple(Region(*s) for s in data["state"]),
            snapshot=tuple(Region(*s) for s in data.get("snapshot", [])),
        )

    def mismatch(self, other: Layout) -> str | None:
        """Why blocks of ``self`` cannot be written into ``other`` (another model or block size), or None."""
        if self.block_size != other.block_size:
            return f"block size {self.block_size} here, {other.block_size} there"

        def sizes(x: Layout) -> list[tuple[int, ...]]:
            return [(k.unit_bytes, v.unit_bytes) for k, v in x.kv] + [(s.unit_bytes,) for s in x.state + x.snapshot]

        mine, theirs = sizes(self), sizes(other)
        if mine != theirs:
            return "the KV or state tensors differ in number or size (another model, dtype or numerics?)"
        return None


def tensor_region(t: torch.Tensor, units: int) -> Region:
    assert t.is_contiguous() and t.numel() % units == 0
    unit_bytes = t.numel() // units * t.element_size()
    return Region(t.data_ptr(), unit_bytes, units, t.device.index or 0 if t.is_cuda else -1)


@dataclass(frozen=True)
class Slice:
    """Descriptors of one posted write: matching local and remote units."""

    local: list[tuple[int, int, int]]
    remote: list[tuple[int, int, int]]

    @property
    def num_bytes(self) -> int:
        return sum(length for _, length, _ in self.local)


class TransferAgent:
    """One NIXL agent per engine: registers its KV and state tensors, writes units into peers' memory.

    Not thread-safe: the server calls it from its event loop only. The engine
    never calls it; a peer's writes land in registered memory on their own.
    """

    def __init__(
        self,
        name: str,
        kv: list[tuple[torch.Tensor, torch.Tensor]],
        states: list[torch.Tensor],
        snapshots: list[torch.Tensor],
        block_size: int,
    ) -> None:
        on_gpu = bool(kv) and kv[0][0].is_cuda
        for key, value in UCX_DEFAULTS.items():
            # GPU memory: UCX's CUDA transports (IPC between processes of one host, staged copies otherwise)
            os.environ.setdefault(key, f"{value},cuda_copy,cuda_ipc" if key == "UCX_TLS" and on_gpu else value)
        api = load_nixl()
        self.name = name
        # NOTE: no NIXL progress thread: it polls without pause (a whole core per instance, measured);
        # the server drives progress itself, only while a transfer is under way.
        self._agent = api.nixl_agent(name, api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        self._mem = "VRAM" if on_gpu else "DRAM"
        tensors = [t for pair in kv for t in pair] + list(states) + list(snapshots)
        for t in tensors:
            self._agent.register_memory(t)
        slots = states[0].shape[0] if states else 0
        num_blocks = kv[0][0].shape[0] // block_size if kv else 0  # the null and scratch slots are never sent
        self.layout = Layout(
            block_size,
            tuple((_blocks(k, block_size, num_blocks), _blocks(v, block_size, num_blocks)) for k, v in kv),
            tuple(tensor_region(s, slots) for s in states),
            tuple(tensor_region(s, snapshots[0].shape[0]) for s in snapshots),
        )
        self._peers: set[str] = set()

    @property
    def metadata(self) -> bytes:
        return self._agent.get_agent_metadata()

    def connect(self, peer: str, metadata: bytes) -> None:
        """Make a peer's memory writable (once per peer name)."""
        if peer not in self._peers:
            self._agent.add_remote_agent(metadata)
            self._peers.add(peer)

    def plan(
        self,
        peer: Layout,
        local_blocks: list[int],
        remote_blocks: list[int],
        local_slot: int | None,
        remote_slot: int | None,
        snapshots: list[tuple[int, int]] | None = None,
    ) -> list[Slice]:
        """The writes that copy ``local_blocks`` into ``remote_blocks``, layer by layer, then (one last
        slice) the working state and the ``(local, remote)`` snapshot slots of the boundary states."""
        assert len(local_blocks) == len(remote_blocks)
        slices = []
        for (k, v), (pk, pv) in zip(self.layout.kv, peer.kv, strict=True):
            local = [r.at(b) for r in (k, v) for b in local_blocks]
            remote = [r.at(b) for r in (pk, pv) for b in remote_blocks]
            if local:
                slices.append(Slice(local, remote))
        local, remote = [], []
        if self.layout.state and local_slot is not None and remote_slot is not None:
            for s, p in zip(self.layout.state, peer.state, strict=True):
                local.append(s.at(local_slot))
                remote.append(p.at(remote_slot))
        for mine, theirs in snapshots or []:
            for s, p in zip(self.layout.snapshot, peer.snapshot, strict=True):
                local.append(s.at(mine))
                remote.append(p.at(theirs))
        if local:
            slices.append(Slice(local, remote))
        return slices

    def post(self, peer: str, piece: Slice, notif: bytes = b"") -> Any:
        """Start one write; returns its handle (poll :meth:`state`, then :meth:`release`)."""
        local = self._agent.get_xfer_descs(piece.local, self._mem)
        remote = self._agent.get_xfer_descs(piece.remote, self._mem)
        handle = self._agent.initialize_xfer("WRITE", local, remote, peer, notif)
        state = self._agent.transfer(handle)
        if state == "ERR":
            raise RuntimeError(f"NIXL write to {peer} failed at post")
        return handle

    def state(self, handle: Any) -> str:
        """``"PROC"`` while in flight, ``"DONE"`` once the data is in the peer's memory, ``"ERR"``."""
        return self._agent.check_xfer_state(handle)

    def release(self, handle: Any) -> None:
        self._agent.release_xfer_handle(handle)

    def notifications(self) -> dict[str, list[bytes]]:
        """Notifications peers attached to completed writes, by peer name (drains them).

        Also the target side's progress: a peer's writes into this agent's memory move
        only while this is called (or :meth:`state`, on the initiating side).
        """
        return self._agent.get_new_notifs()


def _blocks(t: torch.Tensor, block_size: int, num_blocks: int) -> Region:
    row = t[0].numel() * t.element_size()
    return Region(t.data_ptr(), row * block_size, num_blocks, t.device.index or 0 if t.is_cuda else -1)
