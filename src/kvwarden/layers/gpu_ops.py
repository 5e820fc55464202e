"""The two GPU backends behind the :class:`~kvwarden.layers.numerics.Ops` seam.

* :class:`TritonOps` - ``numerics="canonical"`` on CUDA: every GEMM, row
  reduction, activation, rotary, attention and recurrent scan is one of the
  Triton kernels in :mod:`kvwarden.layers.kernels`, each invariant by
  construction (the argument is in each kernel file's docstring).
* :class:`CudaOps` - ``numerics="shape-dependent"`` on CUDA: cuBLAS GEMMs,
  PyTorch's fused attention per request and the vendor-style scans, on
  whatever shape the scheduler produced. It is the labelled fast path the cost
  of invariance is measured against, and it shows vendor behaviour on real
  GPU kernels (no emulation needed: cuBLAS picks its algorithm by shape).

Model files never see which one they got.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kvwarden.config import NumericsConfig
from kvwarden.layers.attention import AttentionPlan, SeqAttn, shape_dependent_attention
from kvwarden.layers.kernels.attention_meta import QueryTiles
from kvwarden.layers.numerics import Ops
from kvwarden.layers.rotary import RotaryEmbedding


class DeviceKernels(Ops):
    """What both GPU backends share, and only that: kernels whose results are invariant by their own
    argument, so a change made for the fast path's speed here cannot silently change the canonical one's bits.

    * ``causal_conv`` (``kernels/conv.py``): one program per (row, channel block), a fixed window of taps.
    * ``rms_norm_gated`` (``kernels/rows.py``): one program per row, the row's own reduction.
    * ``moe_route`` / ``moe_experts`` / ``moe_combine`` (``kernels/moe.py``): row-wise routing, expert tiles
      fixed by the weight's shape, ranks added in rank order (its docstring gives the argument).
    * ``new_kv_cache`` / ``write_kv``: allocation and copies, no arithmetic.

    Every shape-dependent choice (cuBLAS, PyTorch's attention, the vendor-style scans) lives in
    :class:`CudaOps` alone; :class:`TritonOps` defines its own GEMMs, attention, rows and scans.
    ``tests/test_triton_engine.py`` checks that TritonOps takes nothing from CudaOps.
    """

    batched_recurrent = True
    device_moe = True

    def __init__(self, config: NumericsConfig, device: torch.device) -> None:
        super().__init__(config)
        self.device = device
        from kvwarden.layers.kernels import conv, moe, recurrent, rows  # Triton, where it is used

        self.k_conv, self.k_moe, self.k_recurrent, self.k_rows = conv, moe, recurrent, rows

    def causal_conv(self, *args: Any) -> torch.Tensor:
        return self.k_conv.causal_conv(*args)

    def rms_norm_gated(self, *args: Any) -> torch.Tensor:
        return self.k_rows.rms_norm_gated(*args)

    def moe_route(self, *args: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_moe.route(*args)

    def moe_experts(self, *args: Any) -> torch.Tensor:
        return self.k_moe.experts(*args)

    def moe_combine(self, *args: torch.Tensor | None) -> torch.Tensor:
        return self.k_moe.combine(*args)

    def new_kv_cache(self, slots: int, heads: int, dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return (
            torch.zeros(slots, heads, dim, dtype=dtype, device=self.device),
            torch.zeros(slots, heads, dim, dtype=dtype, device=self.device),
        )

    def write_kv(
        self, kv: tuple[torch.Tensor, torch.Tensor], slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        kv[0].index_copy_(0, slots, k.to(kv[0].dtype))
        kv[1].index_copy_(0, slots, v.to(kv[1].dtype))


class CudaOps(DeviceKernels):
    """Library kernels on CUDA, on whatever shape arrives (not invariant).

    Recurrent layers and sparse MoE run the batched device kernels of :class:`DeviceKernels` (one launch per
    layer for every request, nothing read back to the host, so hybrid decode steps are captured in CUDA
    graphs); the fast path keeps vLLM's align-mode rule of saving a recurrent state only where a chunk ends
    on a block boundary, and scans token by token.
    """

    name = "shape-dependent"
    kernels = "cuda"

    def gated_delta_step(self, *args: Any, ring: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        # token by token (the vendor engines' decode kernel; the fast path has no pending rows)
        return self.k_recurrent.gated_delta(*args)

    def mamba2_step(self, *args: Any, ring: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_recurrent.mamba2(*args)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        # cuBLAS chooses its algorithm (split-K included) from the problem shape: the real thing.
        return torch.nn.functional.linear(x, weight, bias)

    def linear_heads(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return torch.bmm(x.transpose(0, 1), weight.transpose(1, 2)).transpose(0, 1)  # cuBLAS's batched GEMM

    def attention_plan(
        self,
        seqs: list[SeqAttn],
        num_rows: int,
        block_ids: list[list[int]],
        null_slot: int,
        block_size: int,
        tiles: QueryTiles,
    ) -> AttentionPlan:
        # Slots go to the device once per step; decode requests (one query each) are batched into one
        # padded attention call per layer, the way vendor engines batch decode.
        seqs = [SeqAttn(s.row_start, s.num_queries, s.start_pos, s.slots.to(self.device)) for s in seqs]
        decode = [s for s in seqs if s.num_queries == 1]
        meta = None
        if len(decode) > 1:
            width = max(s.start_pos + 1 for s in decode)
            slots = torch.full((len(decode), width), null_slot, dtype=torch.long)
            for i, s in enumerate(decode):
                slots[i, : s.start_pos + 1] = s.slots[: s.start_pos + 1].cpu()
            rows = torch.tensor([s.row_start for s in decode], dtype=torch.long)
            meta = {
                "rows": rows.to(self.device),
                "slots": slots.to(self.device),
                "mask": (slots != null_slot).to(self.device)[:, None, None, :],
                "others": tuple(s for s in seqs if s.num_queries != 1),
            }
        return AttentionPlan(seqs=tuple(seqs), groups=(), num_rows=num_rows, meta=meta)

    def attention(
        self, q: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor], plan: AttentionPlan, scale: float, block_size: int
    ) -> torch.Tensor:
        if plan.meta is None:
            return shape_dependent_attention(q, kv[0], kv[1], plan, scale)
        if not isinstance(plan.meta, dict):  # a decode CUDA graph's step: static shapes need the paged kernel
            from kvwarden.layers.kernels.attention import paged_attention

            return paged_attention(q, kv[0], kv[1], plan.meta, block_size, scale)
        meta = plan.meta
        others = AttentionPlan(seqs=meta["others"], groups=(), num_rows=plan.num_rows)
        out = shape_dependent_attention(q, kv[0], kv[1], others, scale)  # prefill chunks, one call each
        rep = q.shape[1] // kv[0].shape[1]
        k = kv[0][meta["slots"]].repeat_interleave(rep, dim=2).transpose(1, 2)  # [B, Hq, L, D]
        v = kv[1][meta["slots"]].repeat_interleave(rep, dim=2).transpose(1, 2)
        qd = q[meta["rows"]].unsqueeze(2)  # [B, Hq, 1, D]
        o = torch.nn.functional.scaled_dot_product_attention(qd, k, v, attn_mask=meta["mask"], scale=scale)
        out[meta["rows"]] = o[:, :, 0, :]
        return out


class TritonOps(DeviceKernels):
    """Canonical numerics on CUDA: the Triton kernels of :mod:`kvwarden.layers.kernels`."""

    name = "canonical"
    kernels = "triton"
    block_fp8 = True  # FP8 weights dequantized per tile inside the GEMMs (kernels/gemm.py, kernels/moe.py)

    def __init__(self, config: NumericsConfig, device: torch.device) -> None:
        super().__init__(config, device)
        # Recurrent scans token by token, or chunks on the absolute grid (numerics.recurrent_scan="chunked":
        # kernels/recurrent_grid.py for gated delta, kernels/ssd_grid.py for Mamba2, their pending rows in the
        # state pool's rings).
        self.scan_mode = "grid" if config.recurrent_scan == "chunked" else "recurrent"
        # Imported here: the kernels need Triton, which a CPU-only install may lack.
        from kvwarden.layers.kernels import attention, gemm, gemm_forms, pointwise, recurrent_grid, rotary, ssd_grid

        self.k_attention, self.k_gemm, self.k_pointwise, self.k_rotary = attention, gemm, pointwise, rotary
        self.k_gemm_forms = gemm_forms
        self.k_grid, self.k_ssd = recurrent_grid, ssd_grid
        # Arrival counters that let GEMV-shaped launches run their fixed splits of K in parallel (speed only:
        # kernels/gemm.py). One stream runs this backend's launches in turn, and each leaves them zero.
        self.gemm_counters = gemm.new_counters(device)
        self._named: dict[Callable[..., Any], str] = {
            torch.sigmoid: "sigmoid",
            torch.nn.functional.silu: "silu",
            torch.nn.functional.softplus: "softplus",
            torch.exp: "exp",
        }

    def gated_delta_step(self, *args: Any, ring: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if self.scan_mode == "recurrent":
            return self.k_recurrent.gated_delta(*args)
        if ring is None:
            raise ValueError("the chunked GPU scan needs the state pool's pending rows (pending='ring')")
        return self.k_grid.gated_delta_grid(*args[:5], ring, *args[5:])

    def mamba2_step(self, *args: Any, ring: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if self.scan_mode == "recurrent":
            return self.k_recurrent.mamba2(*args)
        if ring is None:
            raise ValueError("the chunked GPU scan needs the state pool's pending rows (pending='ring')")
        return self.k_ssd.mamba2_grid(*args[:6], ring, *args[6:])

    # ------------------------------------------------------------- element-wise and rows
    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self.k_gemm.linear(x, weight, bias, counters=self.gemm_counters)

    def linear_heads(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return self.k_gemm_forms.linear_heads(x, weight, counters=self.gemm_counters)

    def linear_swiglu(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        # NOTE(invariance): one launch with the bits of linear() then silu_mul() (kernels/gemm_forms.py)
        return self.k_gemm_forms.linear_swiglu(x, weight, bias, counters=self.gemm_counters)

    def rows(self, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("TritonOps has no generic row op: call a named one (softmax_rows, sum_rows, ...)")

    def pointwise(self, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        name = self._named.get(fn)
        if name is None:
            raise NotImplementedError(f"TritonOps has no kernel for {fn!r}")
        return self.k_pointwise.unary(name, x)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        shape = x.shape
        return self.k_rows.rms_norm(x.reshape(-1, shape[-1]), weight, eps)[0].view(shape)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # NOTE(invariance): the kernel rounds residual + x to the model's dtype before normalising, exactly
        # as the separate add would; one program per row as the plain norm.
        y, h = self.k_rows.rms_norm(x, weight, eps, residual)
        assert h is not None
        return y, h

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return self.k_pointwise.silu_mul(gate, up)

    def exp(self, x: torch.Tensor) -> torch.Tensor:
        return self.k_pointwise.unary("exp", x)

    def log_softmax(self, x: torch.Tensor) -> torch.Tensor:
        return self.k_rows.log_softmax(x)

    def softmax_rows(self, x: torch.Tensor) -> torch.Tensor:
        return self.k_rows.softmax(x)

    def sum_rows(self, x: torch.Tensor) -> torch.Tensor:
        return self.k_rows.row_sum(x)

    def l2_norm_rows(self, x: torch.Tensor, eps: float) -> torch.Tensor:
        return self.k_rows.l2_norm(x, eps)

    def topk_rows(self, x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        # NOTE(invariance): a stable sort is a function of the row's values alone (ties keep index
        # order), whatever algorithm the library runs; torch.topk leaves tie order unspecified.
        values, indices = torch.sort(x, dim=-1, descending=True, stable=True)
        return values[:, :k], indices[:, :k]

    def rope(self, rope: RotaryEmbedding, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.k_rotary.apply_rotary(x, positions, rope.cos, rope.sin)

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
        fused_norm = qk_norm is None or self.k_rotary.fusable_norm(q, qk_norm[0], qk_norm[1])
        if rope is None or kv[0].dtype != k.dtype or not fused_norm:  # norm, rotary, write one by one
            return super().rope_write_kv(rope, q, k, v, positions, kv, slots, qk_norm)
        # NOTE(invariance): every step (traced or not) runs this one kernel: a head row's norm has one order
        return self.k_rotary.rope_write_kv(q, k, v, positions, rope.cos, rope.sin, kv[0], kv[1], slots, qk_norm)

    # ------------------------------------------------------------------- attention
    def attention_plan(
        self,
        seqs: list[SeqAttn],
        num_rows: int,
        block_ids: list[list[int]],
        null_slot: int,
        block_size: int,
        tiles: QueryTiles,
    ) -> AttentionPlan:
        shares = [(s.row_start, s.start_pos, s.num_queries, b) for s, b in zip(seqs, block_ids, strict=True)]
        meta = self.k_attention.AttentionMeta.for_step(shares, self.device, tiles)
        return AttentionPlan(seqs=tuple(seqs), groups=(), num_rows=num_rows, meta=meta)

    def attention(
        self, q: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor], plan: AttentionPlan, scale: float, block_size: int
    ) -> torch.Tensor:
        return self.k_attention.paged_attention(q, kv[0], kv[1], plan.meta, block_size, scale)
