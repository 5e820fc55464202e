"""Decode steps replayed from CUDA graphs: no Python between the kernels of a step.

A step in which every request decodes exactly one token (no draft tokens, no
prompt scores, no tracer) is padded up to the next captured batch size and
replayed from a graph captured at start-up: one launch for the whole model
instead of ~20 Python-dispatched kernels per layer. Everything else (prefill,
chunked prefill beside decodes, speculative verify steps) runs eagerly.

NOTE(invariance): a graph replays the very kernels an eager step launches, on
the same compiled code (row counts and block-table widths are never
specialised), so a row computes the same bits in a graph as eagerly:

* padding rows are row-local garbage: every kernel of a graph-capable model is
  row-wise (GEMMs never mix rows, norms and activations are per row, attention
  reads only the cache), so they cannot reach a real row. They attend to
  nothing (``seq_nq = 0``) and write their K/V into a scratch slot no block
  owns;
* the block table is a persistent ``[max seqs, max blocks]`` buffer; a row
  reads only the columns of its own context, so stale columns past it are
  never touched;
* recurrent layers address each row's working state through a static slot
  buffer (padding rows run in the pool's scratch slot, which no request owns);
  the state at a block boundary a row reaches is the working state after the
  replay, staged from there - the bits an eager step's in-kernel capture
  stores;
* sparse MoE routes and dispatches on the device with shapes fixed by the row
  count (``kernels/moe.py``): a padding row's pairs sit in expert tiles beside
  real ones, which the tiles' row independence makes harmless;
* only backends with no host-side decisions inside a step are captured: on the
  CPU, recurrent layers walk requests and MoE walks experts on the host.

Pending host-tier copies are waited for (as stream dependencies) before a
replay, exactly as an eager step waits for them layer by layer.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from kvwarden.cache.paged_kv import PagedKV
from kvwarden.cache.state_pool import StatePool
from kvwarden.intmath import cdiv, round_up
from kvwarden.layers.attention import AttentionPlan
from kvwarden.layers.recurrent_plan import RecurrentMeta
from kvwarden.models.decoder import DecoderModel, ForwardBatch

if TYPE_CHECKING:
    from kvwarden.engine.scheduler import ScheduledChunk

log = logging.getLogger(__name__)


class BlockTables(Protocol):
    def block_ids(self, request_id: str) -> list[int]: ...


def graph_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, then every multiple of 16 up to ``max_num_seqs`` (rounded up)."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs]
    top = round_up(max_num_seqs, 16) if max_num_seqs > 8 else max_num_seqs
    sizes += list(range(16, top + 1, 16)) if max_num_seqs > 8 else [top]
    return sorted(set(sizes))


def graph_capable(model: DecoderModel) -> str | None:
    """Why ``model``'s decode step cannot be captured, or None when it can."""
    if model.cfg.recurrent_layers and not model.ops.batched_recurrent:
        return "recurrent layers address their states per request on the host (CPU backends)"
    if model.cfg.moe is not None and not model.ops.device_moe:
        return "sparse MoE layers choose experts on the host (CPU backends)"
    if not hasattr(model.ops, "k_attention") and model.ops.device.type != "cuda":
        return "the CPU backends plan attention per request on the host"
    return None


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph | None
    hidden: torch.Tensor
    logits: torch.Tensor


class DecodeGraphs:
    """Static buffers, one captured graph per batch size, and the replay of a pure decode step.

    Args:
        model: the target model (must be :func:`graph_capable`).
        kv: the paged KV tensors; ``pad_slot`` is a slot no block owns.
        block_size, max_model_len, max_num_seqs: bound the buffers.
        capture: record CUDA graphs (a GPU); False runs the same padded
            static-buffer step eagerly (tests of the padding on the CPU).
        states: the recurrent working states (hybrid models), else None.
    """

    def __init__(
        self,
        model: DecoderModel,
        kv: PagedKV,
        pad_slot: int,
        block_size: int,
        max_model_len: int,
        max_num_seqs: int,
        capture: bool,
        states: StatePool | None = None,
    ) -> None:
        from kvwarden.layers.kernels.attention import BLOCK_Q, AttentionMeta  # Triton: GPU backends only

        self.model, self.kv, self.pad_slot, self.block_size = model, kv, pad_slot, block_size
        self.states = states
        self.block_q = BLOCK_Q
        self.sizes = graph_sizes(max_num_seqs)
        self.max_size = self.sizes[-1]
        dev = model.ops.device
        n, width = self.max_size, cdiv(max_model_len, block_size)
        self.longs = torch.zeros((3, n), dtype=torch.long, device=dev)  # token ids, positions, slots
        # seq start, queries (1, or 0 for padding: also the recurrent rows), tile start, state slot
        self.ints = torch.zeros((4, n), dtype=torch.int32, device=dev)
        self.no_captures = torch.zeros(n, dtype=torch.int32, device=dev)
        self.cap_at = torch.full((1,), -1, dtype=torch.int32, device=dev)
        self.tables = torch.zeros((n, width), dtype=torch.int32, device=dev)
        self.arange = torch.arange(n, dtype=torch.int32, device=dev)
        self._meta = AttentionMeta
        self.graphs: dict[int, _Captured] = {}
        self.replays = 0
        self.capture = capture
        self.capture_error: str | None = None
        if capture:
            self._capture_all()

    # ------------------------------------------------------------------ fit
    def fits(self, chunks: list[ScheduledChunk]) -> bool:
        """True when every chunk decodes one token with nothing else asked of its row."""
        if not chunks or len(chunks) > self.max_size:
            return False
        for c in chunks:
            if c.num_tokens != 1 or c.num_spec or not c.completes or c.request.wants_prompt_scores:
                return False
        return True

    def size_for(self, n: int) -> int:
        return next(s for s in self.sizes if s >= n)

    # ------------------------------------------------------------------ run
    def run(self, chunks: list[ScheduledChunk], tables: BlockTables) -> tuple[torch.Tensor, torch.Tensor]:
        """Hidden states ``[n, hidden]`` and float32 logits ``[n, vocab]`` of a pure decode step."""
        n = len(chunks)
        size = self.size_for(n)
        self._stage(chunks, tables, size)
        for i in range(len(self.kv)):
            self.kv[i]  # pending host-tier copies become stream dependencies before the replay
        captured = self.graphs.get(size)
        if captured is None or captured.graph is None:
            hidden, logits = self._forward(size)
        else:
            captured.graph.replay()
            hidden, logits = captured.hidden, captured.logits
        self.replays += 1
        self._stage_boundaries(chunks)
        # Copies: the graph's outputs are overwritten by the next replay of any size.
        return hidden[:n].clone(), logits[:n].clone()

    def _stage_boundaries(self, chunks: list[ScheduledChunk]) -> None:
        """Rows that completed a block: their working states are the states at that boundary."""
        states = self.states
        if states is None:
            return
        for c in chunks:
            if (c.start + 1) % self.block_size == 0:
                rid = c.request.request_id
                slot = states.working[rid]
                for layer in range(len(states.specs)):
                    states.stage(rid, c.start + 1, layer, states.conv[layer][slot], states.ssm[layer][slot])

    def _stage(self, chunks: list[ScheduledChunk], tables: BlockTables, size: int) -> None:
        bs, pad = self.block_size, size - len(chunks)
        ids, pos, slots, rows = [], [], [], []
        for c in chunks:
            p = c.start
            blocks = tables.block_ids(c.request.request_id)
            ids.append(c.request.all_token_ids[p])
            pos.append(p)
            slots.append(blocks[p // bs] * bs + p % bs)
            rows.append(blocks)
        starts = [p - p % self.block_q for p in pos]
        longs = torch.tensor([ids + [0] * pad, pos + [0] * pad, slots + [self.pad_slot] * pad], dtype=torch.long)
        ones = [1] * len(chunks) + [0] * pad  # padding rows have no query: they attend to nothing
        states = self.states
        state_slots = [states.working[c.request.request_id] for c in chunks] if states is not None else []
        scratch = states.scratch_slot if states is not None else 0
        state_slots += [scratch] * (size - len(state_slots))
        ints = torch.tensor([pos + [0] * pad, ones, starts + [0] * pad, state_slots], dtype=torch.int32)
        width = max(len(b) for b in rows)
        table = torch.tensor([b + [0] * (width - len(b)) for b in rows], dtype=torch.int32)
        self.longs[:, :size].copy_(longs, non_blocking=True)
        self.ints[:, :size].copy_(ints, non_blocking=True)
        self.tables[: len(chunks), :width].copy_(table, non_blocking=True)

    def _forward(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        meta = self._meta(
            seq_row0=self.arange[:size],
            seq_start=self.ints[0, :size],
            seq_nq=self.ints[1, :size],
            block_tables=self.tables[:size],
            tile_seq=self.arange[:size],
            tile_pos0=self.ints[2, :size],
        )
        recurrent = None
        if self.states is not None:  # one row per request; captures are taken after the step
            recurrent = RecurrentMeta(
                seq_row0=self.arange[:size],
                seq_len=self.ints[1, :size],
                seq_slot=self.ints[3, :size],
                row_seq=self.arange[:size],
                cap_first=self.no_captures[:size],
                cap_count=self.no_captures[:size],
                cap_at=self.cap_at,
                captures=(),
                host_seqs=(),
            )
        batch = ForwardBatch(
            input_ids=self.longs[0, :size],
            positions=self.longs[1, :size],
            slot_mapping=self.longs[2, :size],
            plan=AttentionPlan(seqs=(), groups=(), num_rows=size, meta=meta),
            block_size=self.block_size,
            states=self.states,
            recurrent=recurrent,
        )
        layers = [self.kv.raw(i) for i in range(len(self.kv))]
        hidden = self.model.forward(batch, layers)
        return hidden, self.model.logits(hidden)

    # ------------------------------------------------------------------ capture
    def _capture_all(self) -> None:
        from kvwarden.layers.kernels.attention import precompile

        if len(self.kv):  # the eager prefill kernels too: no request pays a first-use compile
            precompile(self.model.cfg.num_attention_heads, *self.kv.raw(0), self.block_size)
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):  # largest first: smaller graphs reuse its memory
            self.longs[2, :size] = self.pad_slot
            self.ints[1, :size] = 0
            if self.states is not None:
                self.ints[3, :size] = self.states.scratch_slot
            self._forward(size)  # warm-up: compiles every kernel for this launch shape
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                    hidden, logits = self._forward(size)
            except RuntimeError as e:  # a kernel the capture refused: decode runs eagerly, loudly
                self.capture_error = f"batch {size}: {e}"
                self.graphs.clear()
                log.warning("decode CUDA graphs disabled, steps run eagerly: %s", self.capture_error)
                torch.cuda.synchronize()
                return
            self.graphs[size] = _Captured(graph, hidden, logits)
        torch.cuda.synchronize()
        log.info("captured decode CUDA graphs for batch sizes %s", self.sizes)
