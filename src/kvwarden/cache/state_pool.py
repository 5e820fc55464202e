"""Recurrent-state memory: working states of running requests and prefix-cache snapshots.

Working states: one slot per running request holding, for every recurrent
layer, the conv window, the scan state and the pending rows (see
:mod:`kvwarden.layers.chunked_scan`). Snapshots: the (conv, scan) state at a
block boundary, keyed by that block's chained hash, as a prefix-cache entry of
its own; like vLLM's separate Mamba block group, the first writer of a state
entry need not be the first writer of the KV block with the same hash.

A snapshot lives and dies with its KV block: the pool has one snapshot slot per
KV block (so a snapshot never lacks room), the block pool's eviction drops the
snapshot of the evicted hash, and the engine sizes the KV pool with
``kv bytes + snapshot bytes`` per block.

Every working tensor has one slot more than requests may hold: the scratch
slot, which no request owns, where a decode CUDA graph's padding rows run
their (discarded) recurrence.
"""

from __future__ import annotations

import torch

from kvwarden.cache.state_spec import RecurrentLayerSpec, ring_shape
from kvwarden.layers.chunked_scan import ScanState


class StatePool:
    """Owns every recurrent-state tensor; the only place slots are handed out."""

    def __init__(
        self,
        specs: list[RecurrentLayerSpec],
        num_working: int,
        num_snapshots: int,
        chunk: int,
        device: torch.device | str = "cpu",
        pending: str = "chunked",
    ) -> None:
        """``pending``: which pending rows the working states keep. ``"chunked"``: the canonical CPU scan's
        ``chunk`` packed feature rows (:mod:`kvwarden.layers.chunked_scan`); ``"ring"``: the canonical GPU
        scan's ring of ``2 * chunk`` raw input rows, for the layers whose spec has ``grid_ring``
        (:mod:`kvwarden.layers.kernels.recurrent_grid`; other layers get an empty tensor); ``"none"``: the
        token-by-token kernels and the vendor scan keep none."""
        if pending not in ("chunked", "ring", "none"):
            raise ValueError(f"state pool: unknown pending rows {pending!r}")
        self.specs = specs
        self.chunk = chunk
        self.num_working = num_working
        self.scratch_slot = num_working  # owned by nobody (a decode graph's padding rows)

        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(*shape, device=device)

        self.conv = [zeros(num_working + 1, *s.conv_shape) for s in specs]
        self.ssm = [zeros(num_working + 1, *s.ssm_shape) for s in specs]
        if pending == "chunked":
            self.pending = [zeros(num_working + 1, chunk, s.feature_dim) for s in specs]
        elif pending == "ring":
            self.pending = [zeros(num_working + 1, *ring_shape(s, chunk)) for s in specs]
        else:
            self.pending = []
        self.snap_conv = [zeros(num_snapshots, *s.conv_shape) for s in specs]
        self.snap_ssm = [zeros(num_snapshots, *s.ssm_shape) for s in specs]
        self._free_working = list(range(num_working - 1, -1, -1))
        self.working: dict[str, int] = {}
        self._free_snapshots = list(range(num_snapshots - 1, -1, -1))
        self._snapshot_of: dict[bytes, int] = {}
        self._staged: dict[str, dict[int, list[tuple[torch.Tensor, torch.Tensor]]]] = {}
        # request -> (copies of every working tensor for a batch of slots, its row in them)
        self._checkpoints: dict[str, tuple[list[torch.Tensor], int]] = {}
        # A verify step's states after its tokens (batched kernels): request -> {position: [(conv, ssm)] per layer}.
        self._tokens: dict[str, dict[int, list[tuple[torch.Tensor, torch.Tensor]]]] = {}
        # Snapshot slots another instance writes (disaggregated decode): request -> {block index: slot}.
        self._reserved: dict[str, dict[int, int]] = {}

    @staticmethod
    def snapshot_bytes(specs: list[RecurrentLayerSpec]) -> int:
        return 4 * sum(s.snapshot_numel() for s in specs)

    # ------------------------------------------------------------- working
    @property
    def num_free_working(self) -> int:
        return len(self._free_working)

    def can_allocate_working(self, request_id: str) -> bool:
        return request_id in self.working or bool(self._free_working)

    def allocate_working(self, request_id: str) -> None:
        """A zeroed working slot for a request starting at position 0."""
        if request_id not in self.working:
            if not self._free_working:
                raise RuntimeError("state pool: no free working slot")
            self.working[request_id] = self._free_working.pop()
        slot = self.working[request_id]
        for tensors in (self.conv, self.ssm, self.pending):
            for t in tensors:
                t[slot].zero_()

    def free_working(self, request_id: str) -> None:
        slot = self.working.pop(request_id, None)
        if slot is not None:
            self._free_working.append(slot)
        self._free_snapshots.extend(self._reserved.pop(request_id, {}).values())
        self._staged.pop(request_id, None)
        self._checkpoints.pop(request_id, None)
        self._tokens.pop(request_id, None)

    # ---------------------------------------------------------- speculation
    def checkpoint(self, request_id: str) -> None:
        """Copy a request's working state before a step that scores draft tokens (see :meth:`checkpoint_many`)."""
        self.checkpoint_many([request_id])

    def checkpoint_many(self, request_ids: list[str]) -> None:
        """Copy the working states of requests whose next step scores draft tokens: one gather per tensor.

        NOTE(invariance): a verify step advances the recurrent state through
        every draft token; if any is rejected, :meth:`rollback` returns to this
        copy and the accepted tokens are recomputed by the next step, so the
        state the request carries on is always computed from accepted tokens only.
        """
        if not request_ids:
            return
        tensors = self._working_tensors()
        slots = torch.tensor([self.working[r] for r in request_ids], dtype=torch.long)
        slots = slots.to(tensors[0].device, non_blocking=True)
        saved = [t.index_select(0, slots) for t in tensors]
        for i, rid in enumerate(request_ids):
            self._checkpoints[rid] = (saved, i)

    def rollback(self, request_id: str, position: int) -> None:
        """Restore the checkpoint (the state at ``position``) and forget boundary states staged after it."""
        saved, i = self._checkpoints.pop(request_id)
        slot = self.working[request_id]
        for dst, src in zip(self._working_tensors(), saved, strict=True):
            dst[slot].copy_(src[i])
        self._drop_staged_past(request_id, position)

    def drop_checkpoint(self, request_id: str) -> None:
        self._checkpoints.pop(request_id, None)

    def keep_token(self, request_id: str, pos: int, layer: int, conv: torch.Tensor, ssm: torch.Tensor) -> None:
        """Remember a verify step's state after token ``pos - 1`` (the kernels' fresh copies, kept as they are)."""
        layers = self._tokens.setdefault(request_id, {}).setdefault(pos, [])
        assert len(layers) == layer, "token states are kept layer by layer"
        layers.append((conv, ssm))

    def return_to(self, request_id: str, pos: int) -> None:
        """After a rejected draft: the working state becomes the kept state after token ``pos - 1``, and
        boundary states staged past ``pos`` (computed through rejected drafts) are forgotten.

        NOTE(invariance): the kept state is the one the scan computed after that token in the verify step -
        what plain decoding computes there - so no token is recomputed. (The GPU's chunked scans keep the state
        at the token's grid point; the rows after it are in the ring, which a step of at most ``chunk`` rows
        leaves intact.)"""
        layers = self._tokens.pop(request_id)[pos]
        slot = self.working[request_id]
        for layer, (conv, ssm) in enumerate(layers):
            self.conv[layer][slot].copy_(conv)
            self.ssm[layer][slot].copy_(ssm)
        self._drop_staged_past(request_id, pos)

    def drop_tokens(self, request_id: str) -> None:
        self._tokens.pop(request_id, None)

    def _drop_staged_past(self, request_id: str, pos: int) -> None:
        """Forget boundary states staged after ``pos`` (computed through rejected drafts)."""
        staged = self._staged.get(request_id, {})
        for p in [p for p in staged if p > pos]:
            del staged[p]

    def _working_tensors(self) -> list[torch.Tensor]:
        return [*self.conv, *self.ssm, *self.pending]

    def transfer_tensors(self) -> list[torch.Tensor]:
        """Every working-state tensor (a slot's unit in each): what disaggregated serving moves."""
        return self._working_tensors()

    def views(self, request_id: str, layer: int) -> tuple[torch.Tensor, ScanState]:
        """(conv window, scan state) of a request's working slot for one layer."""
        slot = self.working[request_id]
        pending = self.pending[layer][slot] if self.pending else None
        return self.conv[layer][slot], ScanState(ssm=self.ssm[layer][slot], pending=pending)

    # ----------------------------------------------------------- snapshots
    def has_snapshot(self, block_hash: bytes) -> bool:
        return block_hash in self._snapshot_of

    def restore(self, request_id: str, block_hash: bytes) -> None:
        """Load the snapshot at a block boundary into the request's working slot."""
        src = self._snapshot_of[block_hash]
        slot = self.working[request_id]
        for layer in range(len(self.specs)):
            self.conv[layer][slot].copy_(self.snap_conv[layer][src])
            self.ssm[layer][slot].copy_(self.snap_ssm[layer][src])
            if self.pending:
                self.pending[layer][slot].zero_()  # a block boundary is a grid point: nothing pending

    def snapshot_to_host(self, block_hash: bytes) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A host copy of a boundary snapshot (the host tier keeps it with its block)."""
        src = self._snapshot_of[block_hash]
        pairs = zip(self.snap_conv, self.snap_ssm, strict=True)
        return [(conv[src].cpu().clone(), ssm[src].cpu().clone()) for conv, ssm in pairs]

    def restore_from(self, request_id: str, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Load a host-tier boundary state into the request's working slot."""
        slot = self.working[request_id]
        for layer, (conv, ssm) in enumerate(layers):
            self.conv[layer][slot].copy_(conv)
            self.ssm[layer][slot].copy_(ssm)
            if self.pending:
                self.pending[layer][slot].zero_()  # a block boundary is a grid point: nothing pending

    def stage(
        self, request_id: str, pos: int, layer: int, conv: torch.Tensor, ssm: torch.Tensor, owned: bool = False
    ) -> None:
        """Remember a boundary state computed this step (committed after the step); ``owned``: the tensors are
        the caller's fresh copies (kept as they are), else they are copied."""
        per_pos = self._staged.setdefault(request_id, {})
        layers = per_pos.setdefault(pos, [])
        assert len(layers) == layer, "boundary states are staged layer by layer"
        layers.append((conv, ssm) if owned else (conv.detach().clone(), ssm.detach().clone()))

    def staged_positions(self, request_id: str) -> list[int]:
        return sorted(self._staged.get(request_id, {}))

    def commit(self, request_id: str, pos: int, block_hash: bytes) -> bool:
        """Publish a staged boundary state under ``block_hash`` (first writer wins)."""
        layers = self._staged.get(request_id, {}).pop(pos, None)
        if layers is None or block_hash in self._snapshot_of or not self._free_snapshots:
            return False
        slot = self._free_snapshots.pop()
        for layer, (conv, ssm) in enumerate(layers):
            self.snap_conv[layer][slot].copy_(conv)
            self.snap_ssm[layer][slot].copy_(ssm)
        self._snapshot_of[block_hash] = slot
        return True

    def drop_staged(self, request_id: str, upto: int | None = None) -> None:
        """Forget staged states (only those at positions <= ``upto`` when given)."""
        if upto is None:
            self._staged.pop(request_id, None)
            return
        staged = self._staged.get(request_id, {})
        for pos in [p for p in staged if p <= upto]:
            del staged[pos]

    # ------------------------------------------------- disaggregated serving
    def snapshot_slot(self, block_hash: bytes) -> int | None:
        return self._snapshot_of.get(block_hash)

    def reserve_snapshots(self, request_id: str, block_indices: list[int]) -> dict[int, int]:
        """Slots for the boundary states (after each of these blocks) that a prefill instance will write.

        Fewer than asked when the pool is short: those boundaries then get no state here.
        """
        got = {}
        for i in block_indices:
            if not self._free_snapshots:
                break
            got[i] = self._free_snapshots.pop()
        self._reserved[request_id] = got
        return got

    def adopt_snapshots(self, request_id: str, hashes: dict[int, bytes]) -> int:
        """Publish the reserved slots that were written (block index -> its hash); free the others."""
        n = 0
        for i, slot in self._reserved.pop(request_id, {}).items():
            block_hash = hashes.get(i)
            if block_hash is not None and block_hash not in self._snapshot_of:
                self._snapshot_of[block_hash] = slot
                n += 1
            else:
                self._free_snapshots.append(slot)
        return n

    def snapshot_tensors(self) -> list[torch.Tensor]:
        """Every snapshot tensor (a snapshot slot's unit in each): boundary states moved between instances."""
        return [*self.snap_conv, *self.snap_ssm]

    def evict(self, block_hash: bytes) -> None:
        """Drop the snapshot of an evicted KV block."""
        slot = self._snapshot_of.pop(block_hash, None)
        if slot is not None:
            self._free_snapshots.append(slot)

    @property
    def num_snapshots(self) -> int:
        return len(self._snapshot_of)

    def snapshot_hashes(self) -> set[bytes]:
        return set(self._snapshot_of)

    def check_integrity(self) -> None:
        slots = list(self.working.values())
        assert len(slots) == len(set(slots)), "working slot handed out twice"
        assert not set(slots) & set(self._free_working), "a held working slot is also free"
        assert len(slots) + len(self._free_working) == self.num_working, "working slot leaked"
        snaps = list(self._snapshot_of.values()) + [x for r in self._reserved.values() for x in r.values()]
        assert len(snaps) == len(set(snaps)), "snapshot slot used twice"
        assert not set(snaps) & set(self._free_snapshots), "a held snapshot slot is also free"
