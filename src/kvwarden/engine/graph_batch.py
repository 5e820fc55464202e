"""The static buffers a captured step reads, and how a step's requests are written into them.

A graph of batch ``size`` and width ``q`` computes ``q`` rows per request: ``q = 1`` is a plain decode
step, ``q = k + 1`` a verify step (the request's last token, then its ``k`` drafts), ``q`` = 16 the
last chunk of a prompt (a warm request's uncached tail). Every tensor a
graph reads is a slice of a buffer allocated once here, so a replay only needs the buffers refilled:
one host-built copy per buffer per step, no per-request Python inside the step.

NOTE(invariance): the rows see exactly what an eager step of the same requests would give them:
query tiles stay aligned to absolute positions, in the tiles an eager step of the same requests
builds (the model's decode tile at ``q = 1``, its prefill tile else: a request's ``q`` rows span at most
two of those; an unused second tile points at an empty request, index ``size``, whose zero queries see zero keys), a
padding request has no queries and runs its recurrence over zero tokens in the state pool's scratch
slot, and padding rows write their K/V into a slot no block owns. A request with fewer drafts than
``q - 1`` (near its ``max_tokens``, or none: an n-gram miss, its last token) is padded the same way: its
extra rows come after its real ones, so causal attention and the scan never carry them into a real row;
they write K/V to the unowned slot, their logits are not sampled, and the recurrent state they advance
is returned to the last kept token (by the verify commit, or at once for a request without drafts).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from kvwarden.engine.device_copy import pinned
from kvwarden.intmath import cdiv
from kvwarden.layers.attention import AttentionPlan
from kvwarden.layers.kernels.attention_meta import AttentionMeta, QueryTiles
from kvwarden.layers.recurrent_plan import RecurrentMeta
from kvwarden.models.decoder import ForwardBatch

if TYPE_CHECKING:
    from kvwarden.cache.state_pool import StatePool
    from kvwarden.engine.scheduler import ScheduledChunk


class BlockTables(Protocol):
    def block_row(self, request_id: str) -> np.ndarray: ...


@dataclass(frozen=True)
class _Fixed:
    """Index tensors that depend only on ``(size, q)`` (built once per captured shape)."""

    seq_row0: torch.Tensor  # [size + 1]: request i's rows start at i * q
    row_seq: torch.Tensor  # [size * q]
    cap_first: torch.Tensor  # [size]: request i's per-token states start at i * (q - 1)
    cap_count: torch.Tensor  # [size]
    cap_at: torch.Tensor  # [max(size * (q - 1), 1)]: tokens 0 .. q - 2 of each request
    chunk0: torch.Tensor  # [size]: request i's grid chunks (at most ``max_chunks``) in the scan's scratch
    max_chunks: int  # the most grid chunks q rows touch, wherever they start


class GraphBatch:
    """Buffers for batches of up to ``max_size`` requests of up to ``max_q`` rows each.

    Args:
        device, block_size, max_model_len: bound the block tables.
        pad_slot: a KV slot no block owns (padding rows write there).
        tiles: the model's attention query tiles: ``q = 1`` batches run its decode tile (one tile a
            request), wider ones its prefill tile (two a request: ``max_q`` may not exceed it).
        states: the recurrent working states (hybrid models), else None.
    """

    def __init__(
        self,
        device: torch.device,
        max_size: int,
        max_q: int,
        block_size: int,
        max_model_len: int,
        pad_slot: int,
        tiles: QueryTiles,
        states: StatePool | None,
    ) -> None:
        assert max_q <= tiles.prefill, "a request's rows must fit two query tiles"
        n, rows = max_size, max_size * max_q
        self.device, self.block_size, self.pad_slot, self.query_tiles, self.states = (
            device, block_size, pad_slot, tiles, states,
        )  # fmt: skip
        self.longs = torch.zeros((3, rows), dtype=torch.long, device=device)  # token ids, positions, slots
        # per request (one more: the empty request unused tiles point at): start, queries (0: padding),
        # first tile's position (q = 1 graphs), state slot
        self.ints = torch.zeros((4, n + 1), dtype=torch.int32, device=device)
        self.tile_buf = torch.zeros((2, 2 * n), dtype=torch.int32, device=device)  # request, first position
        self.tables = torch.zeros((n + 1, cdiv(max_model_len, block_size)), dtype=torch.int32, device=device)
        self._table = np.zeros(tuple(self.tables.shape), dtype=np.int32)  # the host side of a step's tables
        self.arange = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.cap_at = torch.full((1,), -1, dtype=torch.int32, device=device)
        self._fixed: dict[tuple[int, int], _Fixed] = {}

    # ------------------------------------------------------------------ staging
    def clear(self, size: int, q: int) -> None:
        """Every request a padding request (before a warm-up or a capture)."""
        self.longs[2, : size * q] = self.pad_slot
        self.ints[1, : size + 1] = 0
        self.tile_buf[0, : 2 * size] = size
        if self.states is not None:
            self.ints[3, :size] = self.states.scratch_slot

    def stage(
        self,
        chunks: list[ScheduledChunk],
        tables: BlockTables,
        size: int,
        q: int,
        next_ids: torch.Tensor | None = None,
    ) -> None:
        """Write the step's requests (``q`` rows each: the chunk's tokens - a decode token, or a prompt's last
        chunk - then its drafts, then padding up to ``q``). ``next_ids``: a step launched ahead (``q = 1``),
        whose tokens the previous step sampled and only the device holds yet: one per chunk, in order."""
        rows = [tables.block_row(c.request.request_id) for c in chunks]
        width = max(len(b) for b in rows)
        table = self._table[: len(chunks), :width]
        for i, b in enumerate(rows):  # columns past a row's blocks are never read (stale values stay)
            table[i, : len(b)] = b
        self.tables[: len(chunks), :width].copy_(self._pin(torch.from_numpy(table.copy())), non_blocking=True)
        if q == 1:
            self._stage_decode(chunks, rows, size, next_ids)
        else:
            assert next_ids is None
            self._stage_wide(chunks, rows, size, q)

    def _stage_decode(
        self, chunks: list[ScheduledChunk], rows: list[np.ndarray], size: int, next_ids: torch.Tensor | None
    ) -> None:
        """One row per request (a decode step): the general staging without its per-row loop."""
        bs, bq, n, pad = self.block_size, self.query_tiles.decode, len(chunks), size - len(chunks)
        starts = [c.start for c in chunks]
        ids = [c.request.all_token_ids[c.start] for c in chunks] if next_ids is None else [0] * n
        slots = [int(b[p // bs]) * bs + p % bs for b, p in zip(rows, starts, strict=True)]
        longs = [ids + [0] * pad, starts + [0] * pad, slots + [self.pad_slot] * pad]
        self.longs[:, :size].copy_(self._pinned(longs, torch.long), non_blocking=True)
        if next_ids is not None:
            assert next_ids.shape == (n,)
            self.longs[0, :n].copy_(next_ids)  # queued after the sampling that chose them
        tiles0 = [p - p % bq for p in starts]
        state = [*self._state_slots(chunks, size), 0]
        ints = [starts + [0] * (pad + 1), [1] * n + [0] * (pad + 1), tiles0 + [0] * (pad + 1), state]
        self.ints[:, : size + 1].copy_(self._pinned(ints, torch.int32), non_blocking=True)

    def _state_slots(self, chunks: list[ScheduledChunk], size: int) -> list[int]:
        """Each request's recurrent working-state slot; padding requests run in the scratch slot."""
        if self.states is None:
            return [0] * size
        pad = [self.states.scratch_slot] * (size - len(chunks))
        return [self.states.working[c.request.request_id] for c in chunks] + pad

    def _stage_wide(self, chunks: list[ScheduledChunk], rows: list[np.ndarray], size: int, q: int) -> None:
        """``q`` rows per request: a verify step, or a prompt's last chunk."""
        bs, bq, pad = self.block_size, self.query_tiles.prefill, size - len(chunks)
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        starts: list[int] = []
        tile_seq: list[int] = []
        tile_pos: list[int] = []
        for i, (c, blocks) in enumerate(zip(chunks, rows, strict=True)):
            p, req = c.start, c.request
            real = c.num_tokens + c.num_spec
            ids.extend(req.all_token_ids[p : c.end])
            ids.extend(req.spec_token_ids[: c.num_spec])
            ids.extend([0] * (q - real))
            last_real = p + real - 1
            for j in range(p, p + q):
                # padding rows: the last real row's position (a request near max_model_len would otherwise
                # address rotary rows past the table), K/V into the unowned slot
                pos.append(min(j, last_real))
                slots.append(int(blocks[j // bs]) * bs + j % bs if j <= last_real else self.pad_slot)
            starts.append(p)
            first, last = p // bq, (p + q - 1) // bq
            tile_seq += [i, i if last > first else size]
            tile_pos += [first * bq, last * bq]
        ids += [0] * (pad * q)
        pos += [0] * (pad * q)
        slots += [self.pad_slot] * (pad * q)
        nq = [q] * len(chunks) + [0] * (pad + 1)  # padding requests and the empty one have no queries
        tiles0 = [p - p % bq for p in starts]
        ints = [starts + [0] * (pad + 1), nq, tiles0 + [0] * (pad + 1), [*self._state_slots(chunks, size), 0]]
        self.longs[:, : size * q].copy_(self._pinned([ids, pos, slots], torch.long), non_blocking=True)
        self.ints[:, : size + 1].copy_(self._pinned(ints, torch.int32), non_blocking=True)
        tile_seq += [size] * (2 * pad)
        tile_pos += [0] * (2 * pad)
        self.tile_buf[:, : 2 * size].copy_(self._pinned([tile_seq, tile_pos], torch.int32), non_blocking=True)

    def _pinned(self, rows: list[list[int]], dtype: torch.dtype) -> torch.Tensor:
        return self._pin(torch.tensor(rows, dtype=dtype))

    def _pin(self, t: torch.Tensor) -> torch.Tensor:
        # NOTE: a copy from pageable memory may wait for the stream to drain, which would stall the staging of
        # a step launched ahead (engine/overlap.py) until the step before it ends
        return pinned(t, self.device)

    # ------------------------------------------------------------------ the batch a graph reads
    def forward_batch(self, size: int, q: int) -> ForwardBatch:
        """The step's :class:`ForwardBatch` over the buffers (the same tensors at every replay)."""
        rows = size * q
        # NOTE: the longest context served bounds every replay's: its splits run in parallel at the small
        # sizes (a long context's decode or warm tail); a split past a tile's keys exits at once
        bound = self.tables.shape[1] * self.block_size
        if q == 1:  # one tile per request, its own
            meta = AttentionMeta(
                seq_row0=self.arange[:size],
                seq_start=self.ints[0, :size],
                seq_nq=self.ints[1, :size],
                block_tables=self.tables[:size],
                tile_seq=self.arange[:size],
                tile_pos0=self.ints[2, :size],
                max_keys=bound,
                **self.query_tiles.meta_fields(decode_only=True),
            )
        else:
            fixed = self.fixed(size, q)
            meta = AttentionMeta(
                seq_row0=fixed.seq_row0,
                seq_start=self.ints[0, : size + 1],
                seq_nq=self.ints[1, : size + 1],
                block_tables=self.tables[: size + 1],
                tile_seq=self.tile_buf[0, : 2 * size],
                tile_pos0=self.tile_buf[1, : 2 * size],
                max_keys=bound,
                **self.query_tiles.meta_fields(decode_only=False),
            )
        recurrent = None
        if self.states is not None:  # boundary states are staged after the step, from the kept states
            fixed = self.fixed(size, q)  # q = 1: no per-token states (every count 0)
            recurrent = RecurrentMeta(
                seq_row0=fixed.seq_row0[:size],
                seq_len=self.ints[1, :size],
                seq_slot=self.ints[3, :size],
                seq_start=self.ints[0, :size],
                chunk0=fixed.chunk0,
                row_seq=fixed.row_seq,
                cap_first=fixed.cap_first,
                cap_count=fixed.cap_count,
                cap_at=fixed.cap_at,
                captures=(),
                host_seqs=(),
                per_token=q if q > 1 else 0,
                chunk=self.states.chunk,
                num_chunks=size * fixed.max_chunks,
                max_chunks=fixed.max_chunks,
            )
        return ForwardBatch(
            input_ids=self.longs[0, :rows],
            positions=self.longs[1, :rows],
            slot_mapping=self.longs[2, :rows],
            plan=AttentionPlan(seqs=(), groups=(), num_rows=rows, meta=meta),
            block_size=self.block_size,
            states=self.states,
            recurrent=recurrent,
            token_states=[] if q > 1 and self.states is not None else None,
        )

    def fixed(self, size: int, q: int) -> _Fixed:
        got = self._fixed.get((size, q))
        if got is None:
            i32 = dict(dtype=torch.int32, device=self.device)
            seqs = torch.arange(size, **i32)
            chunk = self.states.chunk if self.states is not None else 1
            max_chunks = -(-(chunk - 1 + q) // chunk)
            got = _Fixed(
                seq_row0=torch.arange(size + 1, **i32) * q,
                row_seq=seqs.repeat_interleave(q),
                cap_first=seqs * (q - 1),
                cap_count=torch.full((size,), q - 1, **i32),
                cap_at=torch.arange(q - 1, **i32).repeat(size) if q > 1 else self.cap_at,
                chunk0=seqs * max_chunks,
                max_chunks=max_chunks,
            )
            self._fixed[size, q] = got
        return got
