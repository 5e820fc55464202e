"""Row-wise kernels in two flavours: canonical (shape-invariant) and shape-dependent.

Every model layer calls its GEMMs, norms and activations through an :class:`Ops`
object, so the whole model switches numerics by switching one object.

Why canonical mode is needed (measured on this machine's torch 2.13 + MKL):

* ``X @ W.T`` returns different bits for the same row of ``X`` depending on how
  many rows ``X`` has (e.g. K=1536, N=576: rows differ for M < 16 and for some
  M up to 192), because MKL picks kernels and thread splits by shape.
* torch's element-wise transcendental kernels (silu) take a SIMD path for the
  bulk of a tensor and a scalar path for its tail, and the two differ in the
  last bit, so an element's result depends on where it sits in the tensor.
* A row reduction of a single row is split across threads once the row is
  long enough (49152 floats), but not when there are several rows.

Canonical mode answers each of these by construction:

* GEMMs give every row the bits of a call of exactly ``row_tile`` rows
  (zero rows padded): a fixed shape, whose row results depend on the row
  only. Larger calls are used only at the row counts measured on this machine
  to reproduce the tile calls bit for bit (``layers/gemm_rows.py``; MKL's
  choice differs by CPU). Other dtypes keep one call per tile.
* Row reductions of rows up to ``pointwise_chunk`` elements run in one call
  (one fixed vectorised loop per row, parallelised over rows); longer rows,
  which torch would split across threads when alone, run on tiles of exactly
  ``row_tile`` rows.
* Transcendental element-wise kernels run in one call over the flat tensor,
  zero padded to a length at which every thread's share is a whole number of
  SIMD blocks, so every element takes the
  vectorised path (``pointwise_length``).
* Everything else is IEEE basic arithmetic (+, -, *, /, sqrt, max), whose
  result does not depend on position or vector width. We write ``1/sqrt(x)``
  rather than ``rsqrt`` and ``x*x`` rather than ``pow`` to stay inside it.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import accumulate, pairwise

import torch

from kvwarden.config import NumericsConfig
from kvwarden.intmath import round_up
from kvwarden.layers.attention import AttentionPlan, SeqAttn, shape_dependent_attention
from kvwarden.layers.canonical_attention import build_tile_plan, canonical_attention
from kvwarden.layers.gemm_rows import GemmRowSizes
from kvwarden.layers.kernels.attention_meta import QueryTiles
from kvwarden.layers.pointwise_split import pointwise_length
from kvwarden.layers.rotary import RotaryEmbedding

RowFn = Callable[[torch.Tensor], torch.Tensor]


class Ops:
    """Shape-dependent ops: library kernels called on whatever shape arrives.

    This is what vendor engines do. It is the fast path of
    ``numerics="shape-dependent"`` and the baseline the canonical path is
    measured against.
    """

    name = "shape-dependent"
    # Which kernels compute (/metrics' scheduler_config_info and the serve log say it): "torch" (PyTorch's CPU
    # kernels), "compiled" (layers/cpu_kernels), "triton" (layers/kernels), "cuda" (cuBLAS, PyTorch's attention).
    kernels = "torch"
    # How recurrent layers scan: "vendor" (grid from the chunk's start, state only at chunk ends),
    # "chunked" (kvwarden's absolute 16-row grid, CPU), "recurrent" (token by token, GPU) or "grid" (the GPU's
    # chunked scans on the absolute grid with rings of pending rows, numerics.recurrent_scan="chunked").
    scan_mode = "vendor"
    # GPU backends: recurrent layers run once per layer for every request of a step (causal_conv,
    # gated_delta_step, mamba2_step, rms_norm_gated), sparse MoE routes and dispatches on the device
    # (moe_experts, moe_combine); the CPU walks requests and experts on the host.
    batched_recurrent = False
    device_moe = False
    # Whether linear(), linear_swiglu() and moe_experts() take FP8 block-quantized weights (models/quant.py's
    # BlockFp8) and dequantize them per tile; other backends get the dequantized tensor at load.
    block_fp8 = False

    def __init__(self, config: NumericsConfig) -> None:
        self.config = config
        self.device = torch.device("cpu")

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ weight.T (+ bias)`` for ``x`` of shape ``[rows, in]``.

        Emulates GPU GEMM heuristics (split-K chosen by problem shape): the
        reduction is split into ``1 + rows % 5`` parts summed in order, so the
        bits of a row depend on how many rows came with it, as they do on
        vendor kernels (on top of what MKL itself does on this CPU).
        """
        splits = 1 + x.shape[0] % 5
        k = x.shape[1]
        if splits == 1 or k < 2 * splits:
            return torch.nn.functional.linear(x, weight, bias)
        bounds = [k * i // splits for i in range(splits + 1)]
        parts = [torch.nn.functional.linear(x[:, lo:hi], weight[:, lo:hi]) for lo, hi in pairwise(bounds)]
        out = parts[0]
        for part in parts[1:]:
            out = out + part
        return out if bias is None else out + bias

    def linear_heads(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``y[:, h] = linear(x[:, h], weight[h])`` for ``x [rows, H, in]``, ``weight [H, out, in]``:
        one GEMM per head here; the Triton backend runs them in one launch with the same bits."""
        return torch.stack([self.linear(x[:, h].contiguous(), weight[h]) for h in range(weight.shape[0])], 1)

    def linear_swiglu(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``silu(gate) * up`` of ``linear(x, weight, bias)`` for a fused ``[gate; up]`` weight: the two ops
        here; the Triton backend fuses them into one launch with the same bits."""
        gate, up = self.linear(x, weight, bias).chunk(2, dim=-1)
        return self.silu_mul(gate, up)

    def rows(self, fn: RowFn, x: torch.Tensor) -> torch.Tensor:
        """Apply a row-wise function (each output row depends on its input row only)."""
        return fn(x)

    def pointwise(self, fn: RowFn, x: torch.Tensor) -> torch.Tensor:
        """Apply an element-wise function (exp, silu, ...)."""
        return fn(x)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm over the last dimension, computed in float32."""
        return self.rows(lambda t: _rms_norm(t, weight, eps), x)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``h = residual + x`` (rounded to the model's dtype, as a separate add would) and ``rms_norm(h)``;
        returns ``(normed, h)``. The GPU backend fuses the two into one kernel."""
        h = residual + x
        return self.rms_norm(h, weight, eps), h

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` (SwiGLU)."""
        return self.pointwise(torch.nn.functional.silu, gate) * up

    def exp(self, x: torch.Tensor) -> torch.Tensor:
        return self.pointwise(torch.exp, x)

    def log_softmax(self, x: torch.Tensor) -> torch.Tensor:
        """Float32 log-softmax over the last dimension of ``[rows, vocab]``."""
        return self.rows(lambda t: torch.log_softmax(t.float(), dim=-1), x)

    # Named element-wise and row ops: what the models call, so that a backend without
    # generic callables (Triton) can supply a kernel for each.
    def sigmoid(self, x: torch.Tensor) -> torch.Tensor:
        return self.pointwise(torch.sigmoid, x)

    def silu(self, x: torch.Tensor) -> torch.Tensor:
        return self.pointwise(torch.nn.functional.silu, x)

    def softplus(self, x: torch.Tensor) -> torch.Tensor:
        return self.pointwise(torch.nn.functional.softplus, x)

    def softmax_rows(self, x: torch.Tensor) -> torch.Tensor:
        """Softmax over the last dimension of ``[rows, n]``."""
        return self.rows(lambda t: torch.softmax(t, dim=-1), x)

    def sum_rows(self, x: torch.Tensor) -> torch.Tensor:
        """``x.sum(-1, keepdim=True)`` for ``[rows, n]``."""
        return self.rows(lambda t: t.sum(dim=-1, keepdim=True), x)

    def l2_norm_rows(self, x: torch.Tensor, eps: float) -> torch.Tensor:
        """``sqrt(sum(x * x) + eps)`` per row of ``[rows, n]`` (keepdim)."""
        return self.rows(lambda t: torch.sqrt((t * t).sum(dim=-1, keepdim=True) + eps), x)

    def topk_rows(self, x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``k`` largest values of each row and their indices."""
        return torch.topk(x, k, dim=-1)

    def rope(self, rope: RotaryEmbedding, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotary embedding of ``x [tokens, heads, head_dim]`` at absolute ``positions``."""
        return rope.apply(x, positions)

    def rope_write_kv(
        self,
        rope: RotaryEmbedding | None,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor,
        kv: tuple[torch.Tensor, torch.Tensor],
        slots: torch.Tensor,
        qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
    ) -> torch.Tensor:
        """Normalise ``q`` and ``k`` per head (``qk_norm``: Qwen3's ``(q_weight, k_weight, eps)``), rotate them
        (when the model uses rope), write K/V at ``slots``; returns the rotated ``q``. The GPU backend does all
        of it in one kernel."""
        if qk_norm is not None:
            q_w, k_w, eps = qk_norm
            q = self.rms_norm(q.reshape(-1, q.shape[-1]), q_w, eps).view(q.shape)
            k = self.rms_norm(k.reshape(-1, k.shape[-1]), k_w, eps).view(k.shape)
        if rope is not None:
            q, k = self.rope(rope, q, positions), self.rope(rope, k, positions)
        self.write_kv(kv, slots, k, v)
        return q

    # Attention over the paged cache: its layout, writes, per-step plan and kernel.
    def new_kv_cache(self, slots: int, heads: int, dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K ``[slots, heads, dim]`` and V ``[slots, heads, dim + 1]``: V carries a ones column so the
        canonical CPU kernel gets softmax row sums from the same fixed-shape product as the numerator."""
        return torch.zeros(slots, heads, dim, dtype=dtype), torch.zeros(slots, heads, dim + 1, dtype=dtype)

    def write_kv(
        self, kv: tuple[torch.Tensor, torch.Tensor], slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Write a step's K/V rows at their cache slots."""
        k_cache, v_cache = kv
        k_cache.index_copy_(0, slots, k.to(k_cache.dtype))
        ones = v.new_ones((v.shape[0], v.shape[1], 1))
        v_cache.index_copy_(0, slots, torch.cat([v, ones], -1).to(v_cache.dtype))

    def attention_plan(
        self,
        seqs: list[SeqAttn],
        num_rows: int,
        block_ids: list[list[int]],
        null_slot: int,
        block_size: int,
        tiles: QueryTiles,
    ) -> AttentionPlan:
        """Everything the attention layers need for one step, built once per step: each request's share
        (``seqs``, with its slot table), its block table (``block_ids``, positions ``block_size`` to a block),
        the all-zero slot that padded reads use. ``tiles``: the model's query tiles, which the Triton
        kernel's plan is cut into (the other backends' plans are per request or per key tile)."""
        return AttentionPlan(seqs=tuple(seqs), num_rows=num_rows)

    def attention(
        self, q: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor], plan: AttentionPlan, scale: float, block_size: int
    ) -> torch.Tensor:
        """Causal attention of ``q [rows, Hq, D]`` over each request's cached context."""
        return shape_dependent_attention(q, kv[0], kv[1], plan, scale)


class CanonicalOps(Ops):
    """Ops whose per-row results are independent of batch and chunk shape."""

    name = "canonical"
    scan_mode = "chunked"

    def __init__(self, config: NumericsConfig) -> None:
        super().__init__(config)
        self.gemm_sizes = GemmRowSizes(config.row_tile)

    def attention(
        self, q: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor], plan: AttentionPlan, scale: float, block_size: int
    ) -> torch.Tensor:
        return canonical_attention(q, kv[0], kv[1], plan, scale, self.exp, self.config.key_tile)

    def attention_plan(
        self,
        seqs: list[SeqAttn],
        num_rows: int,
        block_ids: list[list[int]],
        null_slot: int,
        block_size: int,
        tiles: QueryTiles,
    ) -> AttentionPlan:
        return build_tile_plan(seqs, num_rows, self.config.key_tile, null_slot)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        wt = weight.t()
        tile = self.config.row_tile
        if x.dtype == torch.float32 and weight.dtype == torch.float32:
            # NOTE(invariance): every row gets the bits of a one-thread row_tile-row call: rows are
            # zero padded to a multiple of the tile and cut into calls whose sizes (and thread
            # count) were measured on this machine to reproduce those calls exactly
            # (layers/gemm_rows.py; one call for most batches, tiles where MKL's kernel choice for
            # larger calls differs, one thread where it splits the reduction across threads).
            rows = x.shape[0]
            padded = round_up(rows, tile)
            if padded != rows:
                x = torch.cat([x, x.new_zeros((padded - rows, x.shape[1]))])
            elif not x.is_contiguous():
                x = x.contiguous()  # the layout the call sizes were measured with
            calls = self.gemm_sizes.calls(wt)
            pieces = calls.pieces(padded)
            with calls.threads():
                if len(pieces) <= 1:
                    out = torch.mm(x, wt)[:rows]
                else:
                    starts = [0, *accumulate(pieces)]
                    out = torch.cat([torch.mm(x[a:b], wt) for a, b in pairwise(starts)])[:rows]
        else:
            # NOTE(invariance): unmeasured dtypes keep one torch.mm per tile of exactly row_tile rows;
            # the padded rows are zeros and are dropped. Same call shape every time.
            out = _tiled_rows(lambda t: torch.mm(t, wt), x, tile)
        return out if bias is None else out + bias

    def rows(self, fn: RowFn, x: torch.Tensor) -> torch.Tensor:
        # NOTE(invariance): torch reduces a contiguous row with one fixed vectorised loop, in one
        # thread, whatever the row count, as long as a single row stays under the parallel grain
        # (a lone long row is split across threads; the vocabulary's log-softmax can be one). Rows
        # up to pointwise_chunk elements therefore run in one call; longer ones keep fixed
        # [row_tile, n] calls, parallelised over rows, never within a row.
        if x.shape[-1] <= self.config.pointwise_chunk:
            return fn(x)
        return _tiled_rows(fn, x, self.config.row_tile)

    def pointwise(self, fn: RowFn, x: torch.Tensor) -> torch.Tensor:
        # NOTE(invariance): one call over the flat tensor, zero padded to a length at which every
        # thread's share is a whole number of SIMD blocks (see pointwise_length): every element
        # then takes the vectorised path, whatever the tensor's size or the element's place, and
        # both cores work on it (fixed pieces below the parallel grain ran on one).
        flat = x.reshape(-1)
        n = flat.numel()
        padded_n = pointwise_length(n, torch.get_num_threads())
        if padded_n != n:
            flat = torch.cat([flat, flat.new_zeros(padded_n - n)])
        return fn(flat.contiguous())[:n].view(x.shape)


def _tiled_rows(fn: RowFn, x: torch.Tensor, tile: int) -> torch.Tensor:
    """Run ``fn`` on consecutive ``[tile, ...]`` slices of ``x``; the last one zero padded."""
    x = x.contiguous()
    rows = x.shape[0]
    full = rows - rows % tile
    out: torch.Tensor | None = None
    for start in range(0, full, tile):
        part = fn(x[start : start + tile])
        if out is None:
            out = part.new_empty((rows, *part.shape[1:]))
        out[start : start + tile] = part
    if full < rows:
        last = x.new_zeros((tile, *x.shape[1:]))
        last[: rows - full] = x[full:]
        part = fn(last)
        if out is None:
            out = part.new_empty((rows, *part.shape[1:]))
        out[full:] = part[: rows - full]
    assert out is not None, "no rows"
    return out


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # As transformers: normalise in float32, cast back, then scale by the weight (Llama, Qwen3);
    # a float32 weight on a lower-precision row scales in float32 and rounds once (Qwen3-Next).
    xf = x.float()
    variance = (xf * xf).mean(dim=-1, keepdim=True)
    normed = xf * (1.0 / torch.sqrt(variance + eps))
    if weight.dtype == torch.float32 and x.dtype != torch.float32:
        return (weight * normed).to(x.dtype)
    return weight * normed.to(x.dtype)
