"""Feed-forward blocks: SwiGLU MLP (Llama/Qwen naming), Granite's fused shared MLP, sparse MoE."""

from __future__ import annotations

import torch

from kvwarden.layers.numerics import Ops
from kvwarden.models.common import WeightGetter, fuse, require
from kvwarden.models.config import ModelConfig


class MLP:
    """``down(silu(gate(x)) * up(x))``."""

    def __init__(self, get: WeightGetter, prefix: str, ops: Ops) -> None:
        self.ops = ops
        gate, up = require(get, f"{prefix}.gate_proj.weight"), require(get, f"{prefix}.up_proj.weight")
        # One GEMM for gate and up (the shape of the fused weight alone picks its tiles).
        self.w_gate_up, self.b_gate_up = fuse(
            [gate, up], [get(f"{prefix}.gate_proj.bias"), get(f"{prefix}.up_proj.bias")]
        )
        self.inter = gate.shape[0]
        self.w_down, self.b_down = require(get, f"{prefix}.down_proj.weight"), get(f"{prefix}.down_proj.bias")

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        ops = self.ops
        gate, up = ops.linear(h, self.w_gate_up, self.b_gate_up).split(self.inter, dim=-1)
        return ops.linear(ops.silu_mul(gate, up), self.w_down, self.b_down)


class GraniteMLP:
    """Granite's ``shared_mlp``: one ``input_linear`` producing [gate | up], then ``output_linear``."""

    def __init__(self, get: WeightGetter, prefix: str, ops: Ops) -> None:
        self.ops = ops
        self.w_in = require(get, f"{prefix}.input_linear.weight")
        self.w_out = require(get, f"{prefix}.output_linear.weight")

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        gate, up = self.ops.linear(h, self.w_in).chunk(2, dim=-1)
        return self.ops.linear(self.ops.silu_mul(gate.contiguous(), up.contiguous()), self.w_out)


class SparseMoE:
    """Qwen3-Next MoE: softmax router, top-k experts, plus a sigmoid-gated shared expert.

    NOTE(invariance): every expert GEMM goes through the row-tiled linear (a
    row's bits do not depend on which other tokens chose the expert), and a
    token's expert outputs are summed in rank order with explicit adds, not by
    scattered accumulation whose order would depend on the batch. On the GPU
    backends (``Ops.device_moe``) routing, dispatch, the expert GEMMs and the
    combine run on the device with the same rounding points
    (:mod:`kvwarden.layers.kernels.moe` gives the argument); on the CPU the
    experts a step chose are walked on the host.
    """

    def __init__(self, cfg: ModelConfig, get: WeightGetter, prefix: str, ops: Ops) -> None:
        assert cfg.moe is not None
        self.moe, self.ops = cfg.moe, ops
        self.router = require(get, f"{prefix}.gate.weight")
        experts = [MLP(get, f"{prefix}.experts.{e}", ops) for e in range(cfg.moe.num_experts)]
        self.on_device = ops.device_moe and all(e.b_gate_up is None and e.b_down is None for e in experts)
        if self.on_device:  # stacked [E, 2I, H] and [E, H, I]; the per-expert copies are dropped
            self.w_gate_up = torch.stack([e.w_gate_up for e in experts])
            self.w_down = torch.stack([e.w_down for e in experts])
            experts = []
        self.experts = experts
        self.shared = MLP(get, f"{prefix}.shared_expert", ops) if cfg.moe.shared_intermediate_size else None
        self.shared_gate = get(f"{prefix}.shared_expert_gate.weight")

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        ops, k = self.ops, self.moe.top_k
        rows = h.shape[0]
        if self.on_device:  # one kernel routes, one sort and one kernel dispatch, two run the experts
            weights, chosen = ops.moe_route(ops.linear(h, self.router), k, self.moe.norm_topk_prob, h.dtype)  # type: ignore[attr-defined]
            per_rank = ops.moe_experts(h, chosen, weights, self.w_gate_up, self.w_down)  # type: ignore[attr-defined]
            shared = self.shared(h) if self.shared is not None else None
            gate = ops.linear(h, self.shared_gate) if shared is not None and self.shared_gate is not None else None
            return ops.moe_combine(per_rank, shared, gate)  # type: ignore[attr-defined]
        logits = ops.linear(h, self.router).float()
        probs = ops.softmax_rows(logits)
        weights, chosen = ops.topk_rows(probs, k)
        if self.moe.norm_topk_prob:
            weights = weights / ops.sum_rows(weights)
        weights = weights.to(h.dtype)
        per_rank = h.new_zeros((rows, k, h.shape[1]))
        for e in torch.unique(chosen).tolist():
            token, rank = torch.where(chosen == e)
            out = self.experts[e](h[token])
            per_rank[token, rank] = out * weights[token, rank].unsqueeze(-1)
        combined = per_rank[:, 0]
        for r in range(1, k):
            combined = combined + per_rank[:, r]
        if self.shared is not None:
            shared = self.shared(h)
            if self.shared_gate is not None:
                shared = shared * ops.sigmoid(ops.linear(h, self.shared_gate))
            combined = combined + shared
        return combined


def build_ffn(
    cfg: ModelConfig, get: WeightGetter, index: int, ops: Ops, prefix: str | None = None
) -> MLP | GraniteMLP | SparseMoE:
    """The FFN of layer ``index`` (an extra layer under ``prefix``, like Qwen3-Next's MTP, is sparse when
    the model is)."""
    extra = prefix is not None and not prefix.startswith("model.layers.")
    prefix = prefix or f"model.layers.{index}"
    if cfg.architecture == "GraniteMoeHybridForCausalLM":
        return GraniteMLP(get, f"{prefix}.shared_mlp", ops)
    if cfg.moe is not None and (extra or cfg.moe.sparse_layers[index]):
        return SparseMoE(cfg, get, f"{prefix}.mlp", ops)
    return MLP(get, f"{prefix}.mlp", ops)
