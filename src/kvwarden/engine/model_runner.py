"""Turns a scheduled step into tensors, runs the model, returns logits rows.

Owns the KV tensors: per attention layer a flat ``[num_blocks * block_size + 2,
kv_heads, head_dim]`` K and V, in the layout the numerics backend asks for (the
CPU's canonical kernel wants a ones column on V; see ``Ops.new_kv_cache``). The
first extra slot (the null slot) stays zero forever; the canonical CPU kernel
points every key past a request's context at it. The second is scratch: the
padding rows of a decode CUDA graph write their K/V there and nothing reads it.
Step tensors are built on the host and copied to the backend's device once per
step; pure decode steps replay a CUDA graph (:mod:`kvwarden.engine.cuda_graphs`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Protocol

import torch

from kvwarden.cache.paged_kv import PagedKV
from kvwarden.cache.state_pool import StatePool
from kvwarden.config import NumericsConfig
from kvwarden.engine.cuda_graphs import DecodeGraphs, graph_capable
from kvwarden.engine.scheduler import ScheduledChunk, SchedulerOutput
from kvwarden.engine.verified_states import VerifiedStates
from kvwarden.layers.attention import SeqAttn
from kvwarden.layers.kernels.attention_meta import query_tiles
from kvwarden.layers.recurrent_plan import RecurrentMeta
from kvwarden.models.common import TraceSink
from kvwarden.models.decoder import DecoderModel, ForwardBatch, SeqSlice

log = logging.getLogger(__name__)


class KVCacheView(Protocol):
    """What the runner needs from the cache manager: a request's block table."""

    def block_ids(self, request_id: str) -> list[int]: ...


class StepParallel(Protocol):
    """Context parallelism as the runner sees it (:class:`kvwarden.engine.context_parallel.ContextParallel`)."""

    every_step: bool  # the layer split: no rank holds every layer, so every step runs on all ranks

    def eligible(self, rows: int) -> bool: ...

    def forward(self, entries: list[BatchEntry], split: bool, want_rows: list[int] | None = None) -> torch.Tensor: ...

    def sync(self, entries: list[BatchEntry]) -> None: ...


@dataclass
class StepLogits:
    """Logits the sampler needs from one step.

    Attributes:
        logits: ``[rows, vocab]`` float32.
        sample_rows: request id -> rows whose logits give its next token, then
            (when it carried drafts) the token after each draft token; always
            consecutive rows.
        prompt_rows: request id -> (first prompt position, logits rows) for
            requests that want scores of their prompt positions.
        hidden: ``[batch rows, hidden]`` final hidden states of every row (the
            MTP head's input), and ``hidden_rows``: request id -> its first row.
        verified: a hybrid's verify step replayed from a graph: every token's recurrent state,
            from which the speculator keeps the last accepted one (else None: the eager
            checkpoint and rollback).
        replayed: the rows per request of the graph the step replayed, 0 when it ran eagerly.
    """

    logits: torch.Tensor
    sample_rows: dict[str, list[int]]
    prompt_rows: dict[str, tuple[int, list[int]]]
    hidden: torch.Tensor | None = None
    hidden_rows: dict[str, int] | None = None
    verified: VerifiedStates | None = None
    replayed: int = 0  # rows per request of the graph this step replayed (0: eager)


@dataclass(frozen=True)
class BatchEntry:
    """Rows of one request in a step: ``token_ids`` at positions ``start ..``, over its blocks."""

    request_id: str
    token_ids: list[int]
    start: int
    block_ids: list[int]


def kv_bytes_per_block(model: DecoderModel, block_size: int) -> int:
    """Upper bound of one block's KV bytes over every attention layer (V may carry a ones column)."""
    return model.num_attention_layers * block_size * model.kv_bytes_per_token()


class ModelRunner:
    def __init__(
        self,
        model: DecoderModel,
        num_blocks: int,
        block_size: int,
        numerics: NumericsConfig,
        states: StatePool | None = None,
        unsafe_host_load: bool = False,
        graphs: tuple[str, int, int] = ("off", 0, 0),
        spec_tokens: int = 0,
        owned_layers: set[int] | None = None,
    ) -> None:
        """``graphs``: ``(mode, max_model_len, max_num_seqs)`` of the decode CUDA graphs (``mode`` as
        ``EngineConfig.cuda_graphs``); ``spec_tokens``: drafts per verify step (verify graphs too);
        ``owned_layers``: under context parallelism's layer split, the attention layers whose cache this
        rank stores (the others get no slots); None: every layer."""
        self.model = model
        self.states = states
        self.tracer: TraceSink | None = None  # set by tools that trace activations
        self.block_size = block_size
        self._block_offsets = torch.arange(block_size)
        self.numerics = numerics
        self.ops = model.ops
        self.device = model.ops.device
        self.null_slot = num_blocks * block_size
        cfg = model.cfg
        # the Triton attention's query tiles: of the model's heads, dtype and device, never of the step
        arch = torch.cuda.get_device_capability(self.device) if self.device.type == "cuda" else None
        heads = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
        self.query_tiles = query_tiles(*heads, model.dtype, arch)
        slots = self.null_slot + 2  # the null slot stays all zero; the last one is the graphs' scratch
        layers = model.num_attention_layers
        # Layer i's tensors are reached only through kv_caches[i], which waits for its pending host-tier copies.
        owned = range(layers) if owned_layers is None else owned_layers
        caches = [model.new_kv_cache(slots if i in owned else 0) for i in range(layers)]
        self.kv_caches = PagedKV(caches, unsafe_host_load)
        self.graphs = self._make_graphs(*graphs, spec_tokens)
        self.parallel: StepParallel | None = None  # context parallelism (attach_parallel)

    def attach_parallel(self, parallel: StepParallel) -> None:
        """Split long steps across ranks from now on; every other step's K/V is copied to them."""
        self.parallel = parallel

    def _make_graphs(self, mode: str, max_model_len: int, max_num_seqs: int, spec_tokens: int) -> DecodeGraphs | None:
        if mode == "off" or (mode == "auto" and self.device.type != "cuda"):
            return None
        why = graph_capable(self.model)
        if why is not None:
            if mode == "emulate":
                raise ValueError(f"cuda_graphs: 'emulate' needs a graph-capable model; {why}")
            log.info("decode steps run eagerly: %s", why)
            return None
        pad_slot = self.null_slot + 1
        return DecodeGraphs(
            self.model,
            self.kv_caches,
            pad_slot,
            self.block_size,
            max_model_len,
            max_num_seqs,
            mode == "auto",
            self.states,
            spec_tokens,
            tiles=self.query_tiles,
        )

    def will_replay(self, out: SchedulerOutput) -> bool:
        """Whether :meth:`execute` runs this step from the graphs' static buffers."""
        if self.parallel is not None and self.parallel.every_step:
            return False
        return self.graphs is not None and self.tracer is None and self.graphs.fits(out.chunks)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, kv: KVCacheView) -> StepLogits:
        if self.graphs is not None and self.will_replay(out):
            return self._replay(out.chunks, kv)
        entries = self._step_entries(out, kv)
        sample_rows: dict[str, list[int]] = {}
        hidden_rows: dict[str, int] = {}
        prompt_rows: dict[str, tuple[int, list[int]]] = {}
        want_rows: list[int] = []
        row0 = 0
        for chunk, entry in zip(out.chunks, entries, strict=True):
            req, ids = chunk.request, entry.token_ids
            hidden_rows[req.request_id] = row0
            scored = min(chunk.end, req.num_prompt_tokens) - chunk.start
            if req.wants_prompt_scores and scored > 0:
                # Row of position j holds the distribution of token j+1.
                prompt_rows[req.request_id] = (chunk.start, list(range(len(want_rows), len(want_rows) + scored)))
                want_rows.extend(range(row0, row0 + scored))
            if chunk.completes:
                first = len(want_rows)
                sample_rows[req.request_id] = list(range(first, first + 1 + chunk.num_spec))
                want_rows.extend(range(row0 + chunk.num_tokens - 1, row0 + len(ids)))
            row0 += len(ids)
        # A verify chunk keeps its state after the last real token and each draft but the last (batched kernels).
        tokens = {
            c.request.request_id: range(c.num_tokens - 1, c.num_tokens - 1 + c.num_spec)
            for c in out.chunks
            if c.num_spec
        }
        par = self.parallel
        split = par is not None and self.tracer is None and par.eligible(row0)
        ran_parallel = par is not None and (split or par.every_step)
        if ran_parallel:
            hidden = par.forward(entries, split, want_rows)  # NOTE(invariance): shares are chunks (context_parallel)
        else:
            batch = self.make_batch(entries, tokens=tokens)
            hidden = self.model.forward(batch, self.kv_caches)
            if par is not None:
                par.sync(entries)
        from_step = getattr(par, "step_logits", None) if ran_parallel else None
        if want_rows and from_step is not None:  # tensor parallelism: every rank computed its vocabulary block
            logits = from_step()
        elif want_rows:
            logits = self.model.logits(hidden[torch.tensor(want_rows, dtype=torch.long).to(self.device)])
        else:
            logits = torch.empty((0, 0), device=self.device)
        return StepLogits(logits, sample_rows, prompt_rows, hidden, hidden_rows)

    @torch.inference_mode()
    def execute_ahead(self, chunks: list[ScheduledChunk], kv: KVCacheView, next_ids: torch.Tensor) -> StepLogits:
        """A decode step launched before the host holds its tokens (``engine/overlap.py``): ``next_ids`` are
        the chunks' tokens, on the device; the step replays a decode graph like any other."""
        assert self.graphs is not None and self.parallel is None
        return self._replay(chunks, kv, next_ids)

    def _replay(
        self, chunks: list[ScheduledChunk], kv: KVCacheView, next_ids: torch.Tensor | None = None
    ) -> StepLogits:
        assert self.graphs is not None
        got = self.graphs.run(chunks, kv, next_ids)
        if self.parallel is not None:
            self.parallel.sync(self._step_entries(SchedulerOutput(chunks), kv))
        q = got.q
        first = {c.request.request_id: i * q for i, c in enumerate(chunks)}
        # a request samples its real rows only: its last token's (a prompt chunk's last), then its drafts'
        sample = {
            c.request.request_id: list(range(i * q + c.num_tokens - 1, i * q + c.num_tokens + c.num_spec))
            for i, c in enumerate(chunks)
        }
        return StepLogits(got.logits, sample, {}, got.hidden, first, got.verified, q)

    @staticmethod
    def _step_entries(out: SchedulerOutput, kv: KVCacheView) -> list[BatchEntry]:
        """Every chunk's rows as batch entries; draft tokens are scored after the chunk as if they were the
        request's next tokens."""
        entries = []
        for c in out.chunks:
            req = c.request
            ids = req.all_token_ids[c.start : c.end] + req.spec_token_ids[: c.num_spec]
            entries.append(BatchEntry(req.request_id, ids, c.start, kv.block_ids(req.request_id)))
        return entries

    def slot_rows(self, entries: list[BatchEntry]) -> torch.Tensor:
        """The flat cache slot of every row of ``entries``, in row order (host tensor)."""
        if not entries:
            return torch.empty(0, dtype=torch.long)
        return torch.cat([self._slots(e.block_ids, e.start + len(e.token_ids))[e.start :] for e in entries])

    def make_batch(
        self,
        entries: list[BatchEntry],
        with_states: bool = True,
        tokens: dict[str, range] | None = None,
        null_slot: int | None = None,
        prefill_tiles: bool = False,
    ) -> ForwardBatch:
        """The step's tensors for rows of several requests (host-built, copied to the device once).

        ``with_states=False``: a forward without recurrent layers (the MTP head's). ``tokens``: per verify
        chunk, the rows after which the batched kernels keep its recurrent state (the return after a
        rejected draft). ``null_slot``: the all-zero slot of the caches the step reads when they are not
        the pool's (layer split's view buffers). ``prefill_tiles``: attention in the model's prefill tiles
        even where every entry has one row (the MTP head's fill, which its drafting graph runs so; a
        context-parallel rank's share of a step that has longer entries)."""
        ids: list[int] = []
        positions: list[int] = []
        slot_list: list[torch.Tensor] = []
        seqs: list[SeqAttn] = []
        slices: list[SeqSlice] = []
        block_ids: list[list[int]] = [e.block_ids for e in entries]
        table = self._slots([b for blocks in block_ids for b in blocks])  # every request's slots, in one op
        first = 0
        for e in entries:
            row0, end = len(ids), e.start + len(e.token_ids)
            if len(e.block_ids) * self.block_size < end:
                raise IndexError(f"{len(e.block_ids)} blocks hold fewer than {end} positions")
            ids.extend(e.token_ids)
            positions.extend(range(e.start, end))
            slots = table[first : first + end]  # a view: positions 0 .. end of this request
            first += len(e.block_ids) * self.block_size
            slot_list.append(slots[e.start : end])
            seqs.append(SeqAttn(row0, len(e.token_ids), e.start, slots))
            slices.append(SeqSlice(e.request_id, row0, len(e.token_ids), e.start))
        null = self.null_slot if null_slot is None else null_slot
        tiles = self.query_tiles
        if prefill_tiles:  # NOTE(invariance): the tiles the drafting graph's first round (or the whole step) builds
            tiles = replace(tiles, decode=tiles.prefill, decode_warps=tiles.prefill_warps)
        plan = self.ops.attention_plan(seqs, len(ids), block_ids, null, self.block_size, tiles)
        dev = self.device
        recurrent = None
        if with_states and self.states is not None and self.ops.batched_recurrent:
            slots = self.states.working
            rec = [(s.request_id, s.row_start, s.num_tokens, s.start, slots[s.request_id]) for s in slices]
            # NOTE(invariance): kvwarden captures the state at every boundary its rows cross; the fast path
            # keeps vLLM's align rule (only where a chunk ends on a boundary), the hazard it demonstrates.
            every = self.ops.scan_mode != "vendor"
            recurrent = RecurrentMeta.build(rec, self.block_size, every, dev, tokens, self.numerics.scan_chunk)
        return ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.long).to(dev, non_blocking=True),
            positions=torch.tensor(positions, dtype=torch.long).to(dev, non_blocking=True),
            slot_mapping=torch.cat(slot_list).to(dev, non_blocking=True),
            plan=plan,
            seqs=slices,
            states=self.states,
            block_size=self.block_size,
            scan_chunk=self.numerics.scan_chunk,
            tracer=self.tracer,
            recurrent=recurrent,
        )

    def _slots(self, block_ids: list[int], num_tokens: int | None = None) -> torch.Tensor:
        """Flat cache slot of every position ``[0, num_tokens)`` (None: every slot of the blocks)."""
        if num_tokens is not None and len(block_ids) * self.block_size < num_tokens:
            raise IndexError(f"{len(block_ids)} blocks hold fewer than {num_tokens} positions")
        blocks = torch.tensor(block_ids, dtype=torch.long)
        slots = (blocks[:, None] * self.block_size + self._block_offsets).view(-1)  # three small ops, no division
        return slots if num_tokens is None else slots[:num_tokens]
