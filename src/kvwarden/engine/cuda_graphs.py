"""Decode and verify steps replayed from CUDA graphs: no Python between the kernels of a step.

A step in which every request computes exactly one token (no prompt scores, no tracer) is padded up
to the next captured batch size and replayed from a graph captured at start-up: one launch for the
whole model instead of ~20 Python-dispatched kernels per layer. Wider graphs take more rows per request:
with speculative decoding ``k + 1`` (its last token and ``k`` drafts), and at the smallest batch sizes a
16 rows (a prompt's last chunk of up to 16 tokens: a warm request's uncached tail); a step replays the
narrowest that holds its widest request, every request padded up to the width (fewer drafts, none, or a
short prompt chunk). Hybrid models keep every token's recurrent state there and return to the last real
or accepted one on the device (:mod:`kvwarden.engine.verified_states`). Everything else (longer or
unfinished prompt chunks, prompt scores, more drafts than a graph holds) runs eagerly.

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
  never touched; query tiles stay aligned to absolute positions
  (:mod:`kvwarden.engine.graph_batch`), and a decode graph runs the model's
  decode tile, a wider graph its prefill tile: the tiles an eager step of
  the same requests builds;
* recurrent layers address each row's working state through a static slot
  buffer (padding rows run in the pool's scratch slot, which no request owns);
  the state at a block boundary a row reaches is the working state after the
  replay (or, in a verify graph, the state kept after that token), staged from
  there - the bits an eager step's in-kernel capture stores;
* sparse MoE routes and dispatches on the device with shapes fixed by the row
  count (``kernels/moe.py``): a padding row's pairs sit in expert tiles beside
  real ones, which the tiles' row independence makes harmless;
* sparse attention (DSA) builds its key table from the static block tables on
  the device, as wide as the longest context served: the columns past a
  request's context score ``-inf`` and are never selected ahead of a visible
  key (``models/mla_block._key_table``), so the selection is the eager one;
* only backends with no host-side decisions inside a step are captured: on the
  CPU, recurrent layers walk requests and MoE walks experts on the host.

Pending host-tier copies are waited for (as stream dependencies) before a
replay, exactly as an eager step waits for them layer by layer.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvwarden.cache.paged_kv import PagedKV
from kvwarden.cache.state_pool import StatePool
from kvwarden.engine.graph_batch import BlockTables, GraphBatch
from kvwarden.engine.verified_states import StateReturns, VerifiedStates
from kvwarden.intmath import round_up
from kvwarden.layers.kernels.attention_meta import QueryTiles
from kvwarden.models.decoder import DecoderModel

if TYPE_CHECKING:
    from kvwarden.engine.scheduler import ScheduledChunk

log = logging.getLogger(__name__)


TAIL_SIZES = 4  # a dense model's prompt-tail graphs: batch sizes up to this
MAX_Q = 16  # a graph's rows per request at most (a prompt's tail; k + 1 <= MAX_Q for verify graphs)


def graph_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, then every multiple of 16 up to ``max_num_seqs`` (rounded up)."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs]
    top = round_up(max_num_seqs, 16) if max_num_seqs > 8 else max_num_seqs
    sizes += list(range(16, top + 1, 16)) if max_num_seqs > 8 else [top]
    return sorted(set(sizes))


def graph_capable(model: DecoderModel) -> str | None:
    """Why ``model``'s decode step cannot be captured, or None when it can."""
    if model.cfg.mla is not None and not hasattr(model.ops, "k_attention"):
        return "sparse attention (DSA) on the shape-dependent backend selects keys request by request on the host"
    if model.cfg.mla is not None and model.ops.config.unsafe_topk:
        return "unsafe_topk: the incident's arrival order follows the step's real rows, so its steps run eagerly"
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
    token_states: list[tuple[torch.Tensor, torch.Tensor]] | None


@dataclass
class GraphStep:
    """What a replayed step gives the engine: ``q`` rows per request, in chunk order."""

    hidden: torch.Tensor  # [n * q, hidden]
    logits: torch.Tensor  # [n * q, vocab] float32
    q: int
    verified: VerifiedStates | None  # hybrid verify steps: the per-token states


class DecodeGraphs:
    """Static buffers, one captured graph per (batch size, width), and the replay of a step.

    Args:
        model: the target model (must be :func:`graph_capable`).
        kv: the paged KV tensors; ``pad_slot`` is a slot no block owns.
        block_size, max_model_len, max_num_seqs: bound the buffers.
        capture: record CUDA graphs (a GPU); False runs the same padded
            static-buffer step eagerly (tests of the padding on the CPU).
        states: the recurrent working states (hybrid models), else None.
        spec_tokens: drafts per verify step (speculative decoding), 0 for decode graphs only.
        tiles: the model's attention query tiles (decode graphs run its decode tile, wider ones its prefill's).
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
        spec_tokens: int = 0,
        *,
        tiles: QueryTiles,
    ) -> None:
        self.model, self.kv, self.block_size, self.states = model, kv, block_size, states
        self.sizes = graph_sizes(max_num_seqs)
        self.max_size = self.sizes[-1]
        # A graph holds up to MAX_Q rows a request (two prefill tiles at most); longer drafts verify eagerly.
        self.widths = (1, spec_tokens + 1) if 0 < spec_tokens < MAX_Q else (1,)
        if spec_tokens >= MAX_Q:
            log.info("verify steps of %d drafts run eagerly (graphs hold up to %d)", spec_tokens, MAX_Q - 1)
        self.tiles = tiles
        # (size, rows per request) captured: decode and verify at every size; the last chunk of a prompt (up
        # to MAX_Q tokens, e.g. a warm request's uncached tail) at the smallest sizes - a hybrid keeps every
        # row's recurrent state in them, so only batch 1 there
        tails = [s for s in self.sizes if s <= (1 if states is not None else TAIL_SIZES)]
        self.shapes = sorted({(s, q) for s in self.sizes for q in self.widths} | {(s, MAX_Q) for s in tails})
        dev = model.ops.device
        self.buffers = GraphBatch(dev, self.max_size, MAX_Q, block_size, max_model_len, pad_slot, tiles, states)
        self.graphs: dict[tuple[int, int], _Captured] = {}
        self.returns = StateReturns(states, self.max_size, capture) if states is not None else None
        self.replays = 0
        self.tail_replays = 0  # replays with a prompt's last chunk of several tokens
        self.verify_replays = 0
        self.padded_replays = 0  # verify replays where some request had fewer drafts than the width
        self.undrafted_rows = 0  # requests without drafts that rode in a verify replay
        self.capture = capture
        self.capture_error: str | None = None
        if capture:
            self._capture_all()

    # ------------------------------------------------------------------ fit
    def width(self, chunks: list[ScheduledChunk]) -> int | None:
        """Rows per request when the step can replay a graph, else None: every chunk is sampled (a decode
        token with up to as many drafts as a graph holds, or the last chunk of a prompt of up to a query
        tile of tokens), nothing else asked of a row. A request with fewer rows than the graph's width is
        padded (``GraphBatch.stage``); the recurrent state its padding rows advance is returned to its last
        real token (:meth:`run`, or the verify commit for drafts)."""
        if not chunks or len(chunks) > self.max_size:
            return None
        for c in chunks:
            if not c.completes or c.request.wants_prompt_scores or (c.num_tokens > 1 and c.num_spec):
                return None
        most = max(c.num_tokens + c.num_spec for c in chunks)
        size = self.size_for(len(chunks))
        return next((q for s, q in self.shapes if s == size and q >= most), None)

    def fits(self, chunks: list[ScheduledChunk]) -> bool:
        return self.width(chunks) is not None

    def size_for(self, n: int) -> int:
        return next(s for s in self.sizes if s >= n)

    # ------------------------------------------------------------------ run
    def run(self, chunks: list[ScheduledChunk], tables: BlockTables, next_ids: torch.Tensor | None = None) -> GraphStep:
        """Replay (or, uncaptured, run) the step of ``chunks``; ``q`` rows per request. ``next_ids``: a
        decode step launched ahead (``engine/overlap.py``): each chunk's one token is on the device only, and
        its request does not hold it yet."""
        q = self.width(chunks) if next_ids is None else 1
        assert q is not None, "run() needs a step that fits"
        n = len(chunks)
        size = self.size_for(n)
        self.buffers.stage(chunks, tables, size, q, next_ids)
        for i in range(len(self.kv)):
            self.kv[i]  # pending host-tier copies become stream dependencies before the replay
        captured = self.graphs.get((size, q))
        if captured is None or captured.graph is None:
            captured = self._forward(size, q)
        else:
            captured.graph.replay()
        self.replays += 1
        verified = None
        if q == 1:
            self._stage_boundaries(chunks)
        else:
            drafted = any(c.num_spec for c in chunks)
            self.verify_replays += drafted
            self.tail_replays += any(c.num_tokens > 1 for c in chunks)
            self.padded_replays += drafted and any(c.num_spec + 1 < q for c in chunks)
            self.undrafted_rows += sum(not c.num_spec for c in chunks) if drafted else 0
            if captured.token_states is not None and self.states is not None:
                index = {c.request.request_id: i for i, c in enumerate(chunks)}
                assert self.returns is not None
                verified = VerifiedStates(self.states, captured.token_states, q, index, self.block_size, self.returns)
                for c in chunks:
                    if not c.num_spec:  # no drafts, no verify commit: every token is kept, its state returns now
                        # NOTE(invariance): staged before the scheduler publishes the blocks it completes
                        verified.keep(c.request, c.start, c.num_tokens - 1)
                if not drafted:  # nobody else will: return the padded requests to their last token now
                    verified.flush()
                    verified = None
        # Copies: the graph's outputs are overwritten by the next replay of any size.
        rows = n * q
        return GraphStep(captured.hidden[:rows].clone(), captured.logits[:rows].clone(), q, verified)

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

    def _forward(self, size: int, q: int) -> _Captured:
        batch = self.buffers.forward_batch(size, q)
        layers = [self.kv.raw(i) for i in range(len(self.kv))]
        hidden = self.model.forward(batch, layers)
        return _Captured(None, hidden, self.model.logits(hidden), batch.token_states)

    # ------------------------------------------------------------------ capture
    def _capture_all(self) -> None:
        from kvwarden.layers.kernels.attention import precompile

        # the eager prefill kernels too, so that no request pays a first-use compile (sparse attention has its
        # own kernels: the dense attention's would be compiled for nothing)
        if len(self.kv) and self.model.cfg.mla is None:
            precompile(self.model.cfg.num_attention_heads, *self.kv.raw(0), self.block_size, self.tiles)
        pool = torch.cuda.graph_pool_handle()
        # largest first: smaller graphs reuse its memory
        for size, q in sorted(self.shapes, key=lambda sq: -sq[0] * sq[1]):
            self.buffers.clear(size, q)
            self._forward(size, q)  # warm-up: compiles every kernel for this launch shape
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                    out = self._forward(size, q)
            except RuntimeError as e:  # a kernel the capture refused: these steps run eagerly, loudly
                self.capture_error = f"batch {size} x {q} rows: {e}"
                self.graphs.clear()
                if self.returns is not None:  # they read the discarded graphs' buffers
                    self.returns.graphs.clear()
                log.warning("CUDA graphs disabled, steps run eagerly: %s", self.capture_error)
                torch.cuda.synchronize()
                return
            out.graph = graph
            self.graphs[size, q] = out
            if self.returns is not None and out.token_states is not None:
                try:  # the return to the last kept token, too
                    self.returns.prepare(size, q, out.token_states)
                except RuntimeError as e:  # it then runs eagerly from the same buffers, loudly
                    log.warning("state-return graph for batch %d x %d rows not captured: %s", size, q, e)
        torch.cuda.synchronize()
        log.info("captured CUDA graphs (batch size, rows per request): %s", self.shapes)
