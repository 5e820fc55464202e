"""The canonical CPU backend on compiled kernels (:mod:`kvwarden.layers.cpu_kernels`).

Same contract as :class:`~kvwarden.layers.numerics.CanonicalOps` - a row's bits
depend on its own row and absolute position only - from kernels that hold it by
construction instead of by calling a library at measured shapes:

* GEMM: each output element one fused multiply-add chain over ``k`` in order, so
  no row padding to a 16-row tile, no per-machine calibration and no one-thread
  fallback; the same bits on every x86-64 CPU and thread count.
* attention: reads K/V from the paged cache in place (no gathers), each query
  row over keys ``0..p`` in a fixed order; no padded query tiles.
* RMSNorm with the residual add, SwiGLU, and q/k norm + rotary + the K/V write:
  one call each instead of a cluster of small torch calls.

Float32 only (the CPU's dtype for served models): other dtypes take the
PyTorch path of the parent class, per call. A cache's layout is fixed when it is
made: float32 caches have no ones column on V (the compiled attention sums the
softmax itself), so they are only ever read by the compiled attention.
"""

from __future__ import annotations

import torch

from kvwarden.config import NumericsConfig
from kvwarden.layers.attention import AttentionPlan, SeqAttn
from kvwarden.layers.cpu_kernels.library import CpuAttentionMeta, CpuKernels
from kvwarden.layers.kernels.attention_meta import QueryTiles
from kvwarden.layers.numerics import CanonicalOps
from kvwarden.layers.rotary import RotaryEmbedding

F32 = torch.float32


def _f32(*tensors: torch.Tensor | None) -> bool:
    """Whether every tensor given is float32 (a CPU engine's tensors are all on the CPU; the library checks
    the device again before any pointer reaches C). A loop, not a generator: this runs ~40 times a step."""
    for t in tensors:  # noqa: SIM110 (all() over a generator costs a frame per call)
        if t is not None and t.dtype is not F32:
            return False
    return True


def _matrix(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a matrix with contiguous rows (a copy only when its last dimension is strided)."""
    x = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    return x if x.stride(1) == 1 else x.contiguous()


class CompiledCpuOps(CanonicalOps):
    """Canonical numerics on the CPU through the compiled kernels."""

    kernels = "compiled"

    def __init__(self, config: NumericsConfig, kernels: CpuKernels) -> None:
        super().__init__(config)
        self.compiled = kernels
        # Set by the first cache made (every attention layer of an engine shares the model's dtype): whether
        # steps plan for the compiled attention (float32 caches) or the parent's tiles.
        self.in_place_attention: bool | None = None

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.dtype is not F32 or weight.dtype is not F32 or (bias is not None and bias.dtype is not F32):
            return super().linear(x, weight, bias)  # (another dtype: the parent's tiles; a CPU engine's tensors)
        if weight.stride(1) != 1:
            return super().linear(x, weight, bias)
        return self.compiled.linear(_matrix(x), weight, bias.contiguous() if bias is not None else None)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if not _f32(x, weight):
            return super().rms_norm(x, weight, eps)
        return self.compiled.rms_norm(_matrix(x), weight.contiguous(), eps)[0].view(x.shape)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not _f32(x, residual, weight) or x.shape != residual.shape:
            return super().add_rms_norm(x, residual, weight, eps)
        normed, h = self.compiled.rms_norm(_matrix(x), weight.contiguous(), eps, _matrix(residual))
        assert h is not None
        return normed.view(x.shape), h.view(x.shape)

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if not _f32(gate, up) or gate.dim() != 2 or gate.stride(1) != 1 or up.stride(1) != 1:
            return super().silu_mul(gate, up)
        return self.compiled.silu_mul(gate, up)

    def new_kv_cache(self, slots: int, heads: int, dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if self.in_place_attention is None:
            self.in_place_attention = dtype == F32
        if not self.in_place_attention:
            return super().new_kv_cache(slots, heads, dim, dtype)
        return torch.zeros(slots, heads, dim, dtype=F32), torch.zeros(slots, heads, dim, dtype=F32)

    def write_kv(
        self, kv: tuple[torch.Tensor, torch.Tensor], slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        if kv[1].shape[-1] != v.shape[-1]:  # the parent's layout (a ones column on V)
            return super().write_kv(kv, slots, k, v)
        kv[0].index_copy_(0, slots, k.to(kv[0].dtype))
        kv[1].index_copy_(0, slots, v.to(kv[1].dtype))

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
        tables = (rope.cos, rope.sin) if rope is not None else None
        norms = (qk_norm[0].contiguous(), qk_norm[1].contiguous(), qk_norm[2]) if qk_norm is not None else None
        fits = (
            _f32(q, k, v, *(tables or ()), *(norms[:2] if norms else ()))
            and kv[1].shape[-1] == v.shape[-1]
            and q.shape[-1] <= 1024
            and min(q.stride(2), k.stride(2), v.stride(2)) == 1
        )
        if not fits:
            return super().rope_write_kv(rope, q, k, v, positions, kv, slots, qk_norm)
        return self.compiled.rope_write_kv(q, k, v, positions, slots, tables, norms, kv)

    def attention_plan(
        self,
        seqs: list[SeqAttn],
        num_rows: int,
        block_ids: list[list[int]],
        null_slot: int,
        block_size: int,
        tiles: QueryTiles,
    ) -> AttentionPlan:
        if not self.in_place_attention:
            return super().attention_plan(seqs, num_rows, block_ids, null_slot, block_size, tiles)
        shares = [(s.row_start, s.num_queries, s.start_pos) for s in seqs]
        meta = CpuAttentionMeta.build(shares, block_ids, block_size, num_rows)
        return AttentionPlan(seqs=tuple(seqs), num_rows=num_rows, meta=meta)

    def attention(
        self, q: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor], plan: AttentionPlan, scale: float, block_size: int
    ) -> torch.Tensor:
        if not isinstance(plan.meta, CpuAttentionMeta):
            return super().attention(q, kv, plan, scale, block_size)
        return self.compiled.attention(q.contiguous(), kv, plan.meta, scale)
