"""The MTP head's drafting after a verify graph, replayed from CUDA graphs (one per batch size).

After a step that replayed a verify graph (every request: its last token and up to ``k`` drafts,
``q = k + 1`` rows), the head runs over each request's kept rows (its last token and the accepted
drafts, the tokens at ``p + 1`` being the emitted ones), gathers the row of the newest token on the
device, and drafts ``k`` tokens: ``k`` greedy picks (``argmax``, lowest id on ties) with ``k - 1`` head
passes between them. All of it is one graph reading the verify graph's own hidden-state output, so a
speculative step costs two replays and one read-back of the drafts, with no per-request Python in
between. A request that finished in the step runs as a padding request; one with room for fewer than
``k`` drafts (near its ``max_tokens``) skips the rounds it does not need (no queries, K/V to the
unowned slot) and keeps the first drafts.

NOTE: drafts only decide how many tokens a step may keep, never which (verification chooses every
token as speculation-off would). The eager proposer picks with the same ``argmax`` over the same
head rows (the kernels are row-invariant; rows past a request's kept tokens write their K/V to a
slot no block owns and attend causally, so they cannot reach a kept row), so the graph drafts what
the eager proposer drafts.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from kvwarden.intmath import cdiv
from kvwarden.layers.attention import AttentionPlan
from kvwarden.layers.kernels.attention_meta import AttentionMeta
from kvwarden.models.common import ForwardBatch
from kvwarden.models.mtp import MtpHead

if TYPE_CHECKING:
    from kvwarden.engine.cuda_graphs import DecodeGraphs
    from kvwarden.engine.scheduler import ScheduledChunk

BlockIds = Callable[[str], list[int]]
log = logging.getLogger(__name__)


class MtpGraphs:
    """Static buffers and one captured drafting graph per batch size of the target's verify graphs.

    Args:
        head: the MTP head; kv: its paged KV tensors (``pad_slot`` is owned by no block).
        target: the target's graphs (their verify graphs' hidden output is this graph's input).
        k: drafts per request; capture: record graphs (False: run the same static step eagerly).
    """

    def __init__(
        self,
        head: MtpHead,
        kv: list[tuple[torch.Tensor, torch.Tensor]],
        pad_slot: int,
        target: DecodeGraphs,
        k: int,
        max_model_len: int,
        capture: bool,
    ) -> None:
        self.head, self.kv, self.pad_slot, self.target, self.k, self.q = head, kv, pad_slot, target, k, k + 1
        # the target's query tiles: round 0's kept rows in its prefill tile, later rounds' one row in its decode tile
        self.tiles, self.block_size = target.tiles, target.block_size
        n, dev = target.max_size, head.ops.device
        self.sizes = target.sizes
        self.longs = torch.zeros((3, n * self.q + n * k), dtype=torch.long, device=dev)  # ids, positions, slots
        self.kept = torch.zeros(n, dtype=torch.long, device=dev)  # index of each request's newest kept row
        # per request: start, queries (fill rows, then one per round), first tile; request n + 1 is empty
        self.ints = torch.zeros((k, 3, n + 1), dtype=torch.int32, device=dev)
        self.tile_buf = torch.zeros((2, 2 * n), dtype=torch.int32, device=dev)  # round 0's: request, first position
        self.tables = torch.zeros((n + 1, cdiv(max_model_len, self.block_size)), dtype=torch.int32, device=dev)
        self.arange = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.replays = 0
        self.capture_error: str | None = None
        if capture:
            self._capture_all()

    # ------------------------------------------------------------------ run
    def run(
        self, chunks: list[ScheduledChunk], rooms: list[int | None], hidden: torch.Tensor, block_ids: BlockIds
    ) -> list[list[int]]:
        """The drafts of every request of a verify-graph step whose tokens were just emitted: ``rooms[i]``
        (at most ``k``) for chunk ``i``; 0 runs the head over its kept rows only (its head KV), None (it
        finished) makes it a padding request."""
        n = len(chunks)
        size = self.target.size_for(n)
        self._stage(chunks, rooms, size, block_ids)
        captured = self.graphs.get(size)
        if captured is None:
            full = hidden.new_zeros((size * self.q, hidden.shape[1]))
            full[: n * self.q] = hidden
            drafts = self._draft(size, full)
        else:
            graph, drafts = captured
            graph.replay()
        self.replays += 1
        return [row[: room or 0] for row, room in zip(drafts[:n].tolist(), rooms, strict=True)]

    def _stage(self, chunks: list[ScheduledChunk], rooms: list[int | None], size: int, block_ids: BlockIds) -> None:
        q, k, bs = self.q, self.k, self.block_size
        bq, bq1 = self.tiles.prefill, self.tiles.decode
        ids: list[int] = []
        slots: list[int] = []
        pos: list[int] = []
        kept, starts, nq, tiles, tables = [], [], [], [[], []], []
        rounds: list[tuple[list[int], list[int], list[int]]] = [([], [], []) for _ in range(k - 1)]
        for i, (c, room) in enumerate(zip(chunks, rooms, strict=True)):
            req = c.request
            if room is None:  # finished: a padding request, no queries, its K/V (none) to the unowned slot
                ids += [0] * q
                pos += [0] * q
                slots += [self.pad_slot] * q
                kept.append(i * q)
                starts.append(0)
                nq.append(0)
                tiles[0] += [size, size]
                tiles[1] += [0, 0]
                tables.append([])
            else:
                p, blocks = c.start, block_ids(req.request_id)
                rows = req.num_tokens - 1 - p  # the last token and the accepted drafts: rows p .. num_tokens - 2
                tokens = req.all_token_ids[p + 1 : p + 1 + rows]
                ids += tokens + [0] * (q - rows)
                pos += [min(j, p + rows - 1) for j in range(p, p + q)]  # padding rows: the last real position
                slots += [blocks[j // bs] * bs + j % bs for j in range(p, p + rows)] + [self.pad_slot] * (q - rows)
                kept.append(i * q + rows - 1)
                starts.append(p)
                nq.append(rows)
                first, last = p // bq, (p + rows - 1) // bq
                tiles[0] += [i, i if last > first else size]
                tiles[1] += [first * bq, last * bq]
                tables.append(blocks)
            for r, (r_pos, r_slots, r_nq) in enumerate(rounds):  # round r + 1 writes position num_tokens - 1 + r
                if r + 2 > (room or 0):  # its draft r + 2 is not wanted (or it finished): padding in this round
                    r_pos.append(0)
                    r_slots.append(self.pad_slot)
                    r_nq.append(0)
                    continue
                j = req.num_tokens - 1 + r
                r_pos.append(j)
                r_slots.append(blocks[j // bs] * bs + j % bs)
                r_nq.append(1)
        pad = size - len(chunks)
        ids += [0] * (pad * q)
        pos += [0] * (pad * q)
        slots += [self.pad_slot] * (pad * q)
        kept += [0] * pad
        tiles[0] += [size] * (2 * pad)
        tiles[1] += [0] * (2 * pad)
        longs = [ids, pos, slots]
        for r_pos, r_slots, _ in rounds:
            longs[1] += r_pos + [0] * pad
            longs[2] += r_slots + [self.pad_slot] * pad
        fill_ints = [starts + [0] * (pad + 1), nq + [0] * (pad + 1), [0] * (size + 1)]
        ints = [fill_ints] + [
            [
                r_pos + [0] * (pad + 1),
                r_nq + [0] * (pad + 1),
                [j - j % bq1 for j in r_pos] + [0] * (pad + 1),
            ]
            for r_pos, _, r_nq in rounds
        ]
        width = max(1, max(len(b) for b in tables))
        table = torch.tensor([b + [0] * (width - len(b)) for b in tables], dtype=torch.int32)
        rows = size * q + size * (k - 1)
        self.longs[1:, :rows].copy_(torch.tensor(longs[1:], dtype=torch.long), non_blocking=True)
        self.longs[0, : size * q].copy_(torch.tensor(ids, dtype=torch.long), non_blocking=True)
        self.kept[:size].copy_(torch.tensor(kept, dtype=torch.long), non_blocking=True)
        self.ints[:, :, : size + 1].copy_(torch.tensor(ints, dtype=torch.int32), non_blocking=True)
        self.tile_buf[:, : 2 * size].copy_(torch.tensor(tiles, dtype=torch.int32), non_blocking=True)
        self.tables[: len(chunks), :width].copy_(table, non_blocking=True)

    # ------------------------------------------------------------------ the graph's body
    def _batch(self, size: int, r: int, ids: torch.Tensor) -> ForwardBatch:
        """Round ``r``'s head batch: ``r = 0`` the kept rows (``q`` per request), then one row per request."""
        q, rows = self.q, size * self.q
        lo, hi = (0, rows) if r == 0 else (rows + (r - 1) * size, rows + r * size)
        ints = self.ints[r]
        bound = self.tables.shape[1] * self.block_size  # the longest context served (graph_batch.py)
        if r == 0:
            meta = AttentionMeta(
                seq_row0=self.arange[: size + 1] * q,
                seq_start=ints[0, : size + 1],
                seq_nq=ints[1, : size + 1],
                block_tables=self.tables[: size + 1],
                tile_seq=self.tile_buf[0, : 2 * size],
                tile_pos0=self.tile_buf[1, : 2 * size],
                max_keys=bound,
                **self.tiles.meta_fields(decode_only=False),
            )
        else:
            meta = AttentionMeta(
                seq_row0=self.arange[:size],
                seq_start=ints[0, :size],
                seq_nq=ints[1, :size],
                block_tables=self.tables[:size],
                tile_seq=self.arange[:size],
                tile_pos0=ints[2, :size],
                max_keys=bound,
                **self.tiles.meta_fields(decode_only=True),
            )
        return ForwardBatch(
            input_ids=ids,
            positions=self.longs[1, lo:hi],
            slot_mapping=self.longs[2, lo:hi],
            plan=AttentionPlan(seqs=(), groups=(), num_rows=hi - lo, meta=meta),
            block_size=self.block_size,
        )

    def _draft(self, size: int, hidden: torch.Tensor) -> torch.Tensor:
        """``[size, k]`` drafts from the verify step's hidden rows ``[size * q, hidden]``."""
        out = self.head.forward(self._batch(size, 0, self.longs[0, : size * self.q]), hidden, self.kv)
        current = out.index_select(0, self.kept[:size])
        drafts = []
        for r in range(self.k):
            token = self.head.logits(current).argmax(dim=-1)  # ties: the lowest id
            drafts.append(token)
            if r + 1 < self.k:
                current = self.head.forward(self._batch(size, r + 1, token), current, self.kv)
        return torch.stack(drafts, dim=1)

    # ------------------------------------------------------------------ capture
    def _capture_all(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            verify = self.target.graphs.get((size, self.q))
            if verify is None:
                continue
            self.longs[2] = self.pad_slot
            self.ints.zero_()
            self.tile_buf[0, : 2 * size] = size
            self._draft(size, verify.hidden)  # warm-up: compiles for this launch shape
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                    drafts = self._draft(size, verify.hidden)
            except RuntimeError as e:  # the head drafts from the same static buffers, uncaptured, loudly
                self.capture_error = f"batch {size}: {e}"
                self.graphs.clear()
                log.warning("MTP drafting graphs disabled: %s", self.capture_error)
                torch.cuda.synchronize()
                return
            self.graphs[size] = (graph, drafts)
        torch.cuda.synchronize()
