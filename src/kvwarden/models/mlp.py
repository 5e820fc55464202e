"""Feed-forward blocks: SwiGLU MLP (Llama/Qwen naming), Granite's fused shared MLP, sparse MoE."""

from __future__ import annotations

import torch

from kvwarden.layers.numerics import Ops
from kvwarden.models.common import WeightGetter, fuse, require, stack_experts
from kvwarden.models.config import ModelConfig
from kvwarden.models.tensor_shard import TensorShard


class MLP:
    """``down(silu(gate(x)) * up(x))``."""

    def __init__(
        self, get: WeightGetter, prefix: str, ops: Ops, bias: bool = False, shard: TensorShard | None = None
    ) -> None:
        """``bias``: the config's ``mlp_bias`` (biases are read only when announced; see AttentionBlock).
        ``shard``: under tensor parallelism ``get`` gives this rank's intermediate columns of gate and up and
        its output columns of down (models/tensor_shard.py: gathered, never summed)."""
        self.ops = ops
        self.shard = shard or TensorShard()
        gate, up = require(get, f"{prefix}.gate_proj.weight"), require(get, f"{prefix}.up_proj.weight")

        def b(name: str) -> torch.Tensor | None:
            return require(get, f"{prefix}.{name}.bias") if bias else None

        # One GEMM for gate and up (the shape of the fused weight alone picks its tiles).
        self.w_gate_up, self.b_gate_up = fuse([gate, up], [b("gate_proj"), b("up_proj")])
        self.w_down, self.b_down = require(get, f"{prefix}.down_proj.weight"), b("down_proj")

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        act = self.ops.linear_swiglu(h, self.w_gate_up, self.b_gate_up)
        return self.shard.output_linear(self.ops, act, self.w_down, self.b_down)


class GraniteMLP:
    """Granite's ``shared_mlp``: one ``input_linear`` producing [gate | up], then ``output_linear``."""

    def __init__(self, get: WeightGetter, prefix: str, ops: Ops, shard: TensorShard | None = None) -> None:
        """``shard``: as :class:`MLP`'s (this rank's gate and up columns in ``input_linear``)."""
        self.ops, self.shard = ops, shard or TensorShard()
        self.w_in = require(get, f"{prefix}.input_linear.weight")
        self.w_out = require(get, f"{prefix}.output_linear.weight")

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        return self.shard.output_linear(self.ops, self.ops.linear_swiglu(h, self.w_in), self.w_out)


class SparseMoE:
    """Sparse MoE: a router, top-k experts (SwiGLU), and a shared expert (Qwen3-Next: sigmoid-gated;
    Granite: its ``shared_mlp``, ungated; Qwen3-MoE: none).

    Routing follows the family (``MoEConfig.routing``): Qwen takes the softmax over every expert, then
    the top k (renormalised when ``norm_topk_prob``); Granite the top k logits, then their softmax;
    GLM-5 (DeepSeek's group-limited routing) the sigmoid of float32 logits, a bias-corrected choice
    within the best ``topk_group`` of ``n_group`` groups, the chosen sigmoids renormalised and scaled.

    NOTE(invariance): every expert GEMM goes through the row-tiled linear (a
    row's bits do not depend on which other tokens chose the expert), and a
    token's expert outputs are summed in rank order with explicit adds, not by
    scattered accumulation whose order would depend on the batch. On the GPU
    backends (``Ops.device_moe``) routing, dispatch, the expert GEMMs and the
    combine run on the device with the same rounding points
    (:mod:`kvwarden.layers.kernels.moe` gives the argument); on the CPU the
    experts a step chose are walked on the host.
    """

    def __init__(
        self, cfg: ModelConfig, get: WeightGetter, prefix: str, ops: Ops, shard: TensorShard | None = None
    ) -> None:
        """``shard``: under expert parallelism this rank holds a block of whole experts (the router and any
        shared expert whole too): each (token, rank) pair is computed by its expert's rank, then every rank
        takes it from there (models/tensor_shard.py)."""
        assert cfg.moe is not None
        self.moe, self.ops = cfg.moe, ops
        self.shard = shard or TensorShard()
        self.owned = self.shard.owned_experts(cfg.moe.num_experts) if self.shard.active else range(cfg.moe.num_experts)
        self.topk_first = cfg.moe.routing == "topk_softmax"
        self.grouped = cfg.moe.routing == "sigmoid_group"
        self.on_device = ops.device_moe
        self.shared_gate: torch.Tensor | None = None
        self.shared: MLP | GraniteMLP | None = None
        self.score_bias: torch.Tensor | None = None
        if cfg.architecture == "GraniteMoeHybridForCausalLM":  # stacked experts in the checkpoint
            moe = f"{prefix}.block_sparse_moe"
            self.router = require(get, f"{moe}.router.layer.weight")
            w_gate_up = require(get, f"{moe}.input_linear.weight")  # [E, 2I, H]: gate rows, then up rows
            w_down = require(get, f"{moe}.output_linear.weight")  # [E, H, I]
            if self.shard.active:  # expert parallelism: this rank's block of whole experts
                w_gate_up = w_gate_up[self.owned.start : self.owned.stop].contiguous()
                w_down = w_down[self.owned.start : self.owned.stop].contiguous()
            self.shared = GraniteMLP(get, f"{prefix}.shared_mlp", ops, self.shard)
        else:
            mlp = f"{prefix}.mlp"
            self.router = require(get, f"{mlp}.gate.weight")
            experts = [MLP(get, f"{mlp}.experts.{e}", ops) for e in self.owned]
            w_gate_up = stack_experts([e.w_gate_up for e in experts])
            w_down = stack_experts([e.w_down for e in experts])
            del experts
            if self.grouped:  # float32 router and score-correction bias; ungated shared experts
                self.router = self.router.float()
                self.score_bias = require(get, f"{mlp}.gate.e_score_correction_bias").float()
                if cfg.moe.shared_intermediate_size:
                    self.shared = MLP(get, f"{mlp}.shared_experts", ops, shard=self.shard)
            elif cfg.moe.shared_intermediate_size:
                self.shared = MLP(get, f"{mlp}.shared_expert", ops, shard=self.shard)
                self.shared_gate = get(f"{mlp}.shared_expert_gate.weight")
        self.w_gate_up, self.w_down = w_gate_up, w_down
        self.inter = w_gate_up.shape[1] // 2

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        ops, k = self.ops, self.moe.top_k
        if self.shard.active:
            weights, chosen = self._route(h)
            per_rank = self._from_owners(self._experts(h, weights, chosen), chosen)
        elif self.on_device:  # one kernel routes, one sort and one kernel dispatch, two run the experts
            if self.grouped:  # group-limited routing: row-wise library ops on the device, nothing read back
                weights, chosen = self._route_grouped(h)
            else:
                weights, chosen = ops.moe_route(  # type: ignore[attr-defined]
                    ops.linear(h, self.router), k, self.moe.norm_topk_prob, h.dtype, self.topk_first
                )
            per_rank = ops.moe_experts(h, chosen, weights, self.w_gate_up, self.w_down)  # type: ignore[attr-defined]
        else:
            weights, chosen = self._route(h)
            per_rank = self._experts(h, weights, chosen)
        shared = self.shared(h) if self.shared is not None else None
        gate = ops.linear(h, self.shared_gate) if shared is not None and self.shared_gate is not None else None
        if self.on_device and not self.shard.active:
            return ops.moe_combine(per_rank, shared, gate)  # type: ignore[attr-defined]
        combined = per_rank[:, 0]
        for r in range(1, k):
            combined = combined + per_rank[:, r]
        if shared is not None:
            combined = combined + (shared * ops.sigmoid(gate) if gate is not None else shared)
        return combined

    def _route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights [rows, k]`` in the model dtype, ``chosen [rows, k])`` on the CPU."""
        ops, k = self.ops, self.moe.top_k
        if self.grouped:
            return self._route_grouped(h)
        logits = ops.linear(h, self.router).float()
        if self.topk_first:
            top, chosen = ops.topk_rows(logits, k)
            weights = ops.softmax_rows(top)
        else:
            weights, chosen = ops.topk_rows(ops.softmax_rows(logits), k)
            if self.moe.norm_topk_prob:
                weights = weights / ops.sum_rows(weights)
        return weights.to(h.dtype), chosen

    def _route_grouped(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """DeepSeek's group-limited sigmoid routing (GLM-5), in float32 as transformers computes it.

        NOTE(invariance): every step is row-wise (GEMM rows through the row-tiled linear, element-wise
        IEEE arithmetic, per-row top-k and sums): a token's experts and weights depend on its row alone.
        """
        ops, moe = self.ops, self.moe
        assert self.score_bias is not None
        scores = ops.sigmoid(ops.linear(h.float(), self.router))
        choice = scores + self.score_bias
        rows = choice.shape[0]
        per_group = choice.view(rows, moe.n_group, -1)
        best_two = ops.topk_rows(per_group.reshape(rows * moe.n_group, -1), 2)[0].view(rows, moe.n_group, 2)
        group_scores = best_two[..., 0] + best_two[..., 1]
        groups = ops.topk_rows(group_scores, moe.topk_group)[1]
        allowed = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)
        choice = per_group.masked_fill(~allowed.unsqueeze(-1), float("-inf")).view(rows, -1)
        chosen = ops.topk_rows(choice, moe.top_k)[1]
        weights = scores.gather(1, chosen)
        if moe.norm_topk_prob:
            weights = weights / (ops.sum_rows(weights) + 1e-20)
        return (weights * moe.routed_scaling_factor).to(h.dtype), chosen

    def _from_owners(self, per_rank: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """Each (token, rank) pair's output as its expert's rank computed it (every rank computed zeros for
        the pairs it does not own): gathered, then picked by owner - a copy, never a sum."""
        shard = self.shard
        rows, k, hidden = per_rank.shape
        blocks = shard.gather(per_rank.reshape(rows, k * hidden), k * hidden * shard.world)
        by_rank = blocks.view(rows, shard.world, k, hidden)
        owner = shard.experts_of(chosen, self.moe.num_experts)  # [rows, k]
        return by_rank.gather(1, owner.view(rows, 1, k, 1).expand(rows, 1, k, hidden)).squeeze(1)

    def _experts(self, h: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """``[rows, k, H]``: each (token, rank) through its expert, times its weight (experts walked on the host)."""
        ops = self.ops
        per_rank = h.new_zeros((h.shape[0], self.moe.top_k, h.shape[1]))
        for e in torch.unique(chosen).tolist():
            if e not in self.owned:  # another rank's expert (expert parallelism)
                continue
            token, rank = torch.where(chosen == e)
            local = e - self.owned.start
            gate, up = ops.linear(h[token], self.w_gate_up[local]).split(self.inter, dim=-1)
            out = ops.linear(ops.silu_mul(gate, up), self.w_down[local])
            per_rank[token, rank] = out * weights[token, rank].unsqueeze(-1)
        return per_rank


def build_ffn(
    cfg: ModelConfig,
    get: WeightGetter,
    index: int,
    ops: Ops,
    prefix: str | None = None,
    shard: TensorShard | None = None,
) -> MLP | GraniteMLP | SparseMoE:
    """The FFN of layer ``index`` (an extra layer under ``prefix``, like Qwen3-Next's MTP, is sparse when
    the model is)."""
    extra = prefix is not None and not prefix.startswith("model.layers.")
    prefix = prefix or f"model.layers.{index}"
    if cfg.moe is not None and (extra or cfg.moe.sparse_layers[index]):
        return SparseMoE(cfg, get, prefix, ops, shard)
    if cfg.architecture == "GraniteMoeHybridForCausalLM":
        return GraniteMLP(get, f"{prefix}.shared_mlp", ops, shard)
    return MLP(get, f"{prefix}.mlp", ops, bias=cfg.mlp_bias, shard=shard)
