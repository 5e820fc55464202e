"""Llama and Qwen3 decoder models over the paged KV cache.

One class serves both: Qwen3 is Llama plus per-head RMSNorm on q and k and an
explicit ``head_dim``. Weights are plain tensors named as in Hugging Face
checkpoints; every GEMM and row-wise op goes through the numerics ``Ops`` so
the canonical/shape-dependent switch covers the whole model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvwarden.layers.attention import AttentionPlan, canonical_attention, shape_dependent_attention
from kvwarden.layers.numerics import Ops
from kvwarden.layers.rotary import RotaryEmbedding
from kvwarden.models.config import ModelConfig

WeightGetter = Callable[[str], torch.Tensor | None]


@dataclass
class ForwardBatch:
    """Inputs of one model step (built by the model runner).

    Attributes:
        input_ids: ``[rows]`` tokens of every request's chunk, concatenated.
        positions: ``[rows]`` absolute position of each token in its request.
        slot_mapping: ``[rows]`` flat KV-cache slot each token's K/V is written to.
        plan: attention tiling for the step.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    plan: AttentionPlan


class AttentionBlock:
    def __init__(self, cfg: ModelConfig, get: WeightGetter, prefix: str, ops: Ops, rope: RotaryEmbedding) -> None:
        self.cfg, self.ops, self.rope = cfg, ops, rope
        self.wq, self.bq = _req(get, f"{prefix}.q_proj.weight"), get(f"{prefix}.q_proj.bias")
        self.wk, self.bk = _req(get, f"{prefix}.k_proj.weight"), get(f"{prefix}.k_proj.bias")
        self.wv, self.bv = _req(get, f"{prefix}.v_proj.weight"), get(f"{prefix}.v_proj.bias")
        self.wo, self.bo = _req(get, f"{prefix}.o_proj.weight"), get(f"{prefix}.o_proj.bias")
        self.q_norm = _req(get, f"{prefix}.q_norm.weight") if cfg.qk_norm else None
        self.k_norm = _req(get, f"{prefix}.k_norm.weight") if cfg.qk_norm else None
        self.scale = cfg.head_dim**-0.5

    def __call__(self, h: torch.Tensor, batch: ForwardBatch, kv: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        cfg, ops = self.cfg, self.ops
        rows = h.shape[0]
        d = cfg.head_dim
        q = ops.linear(h, self.wq, self.bq).view(rows, cfg.num_attention_heads, d)
        k = ops.linear(h, self.wk, self.bk).view(rows, cfg.num_key_value_heads, d)
        v = ops.linear(h, self.wv, self.bv).view(rows, cfg.num_key_value_heads, d)
        if self.q_norm is not None and self.k_norm is not None:
            q = ops.rms_norm(q.reshape(-1, d), self.q_norm, cfg.rms_norm_eps).view(q.shape)
            k = ops.rms_norm(k.reshape(-1, d), self.k_norm, cfg.rms_norm_eps).view(k.shape)
        q = self.rope.apply(q, batch.positions)
        k = self.rope.apply(k, batch.positions)
        k_cache, v_cache = kv
        k_cache.index_copy_(0, batch.slot_mapping, k.to(k_cache.dtype))
        v_cache.index_copy_(
            0, batch.slot_mapping, torch.cat([v, v.new_ones((rows, v.shape[1], 1))], -1).to(v_cache.dtype)
        )
        if ops.name == "canonical":
            nc = ops.config
            o = canonical_attention(q, k_cache, v_cache, batch.plan, self.scale, ops.exp, nc.row_tile, nc.key_tile)
        else:
            o = shape_dependent_attention(q, k_cache, v_cache, batch.plan, self.scale)
        return ops.linear(o.reshape(rows, -1), self.wo, self.bo)


class MLPBlock:
    def __init__(self, get: WeightGetter, prefix: str, ops: Ops) -> None:
        self.ops = ops
        self.w_gate, self.b_gate = (
            _req(get, f"{prefix}.gate_proj.weight"),
            get(f"{prefix}.gate_proj.bias"),
        )
        self.w_up, self.b_up = _req(get, f"{prefix}.up_proj.weight"), get(f"{prefix}.up_proj.bias")
        self.w_down, self.b_down = (
            _req(get, f"{prefix}.down_proj.weight"),
            get(f"{prefix}.down_proj.bias"),
        )

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        ops = self.ops
        gate = ops.linear(h, self.w_gate, self.b_gate)
        up = ops.linear(h, self.w_up, self.b_up)
        return ops.linear(ops.silu_mul(gate, up), self.w_down, self.b_down)


class DecoderLayer:
    def __init__(self, cfg: ModelConfig, get: WeightGetter, index: int, ops: Ops, rope: RotaryEmbedding) -> None:
        prefix = f"model.layers.{index}"
        self.cfg, self.ops = cfg, ops
        self.input_norm = _req(get, f"{prefix}.input_layernorm.weight")
        self.post_norm = _req(get, f"{prefix}.post_attention_layernorm.weight")
        self.attn = AttentionBlock(cfg, get, f"{prefix}.self_attn", ops, rope)
        self.mlp = MLPBlock(get, f"{prefix}.mlp", ops)

    def __call__(self, h: torch.Tensor, batch: ForwardBatch, kv: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        eps = self.cfg.rms_norm_eps
        h = h + self.attn(self.ops.rms_norm(h, self.input_norm, eps), batch, kv)
        return h + self.mlp(self.ops.rms_norm(h, self.post_norm, eps))


class LlamaModel:
    """Decoder-only transformer (``LlamaForCausalLM`` / ``Qwen3ForCausalLM``)."""

    def __init__(self, cfg: ModelConfig, get: WeightGetter, ops: Ops, max_positions: int) -> None:
        self.cfg, self.ops = cfg, ops
        self.embed = _req(get, "model.embed_tokens.weight")
        rope = RotaryEmbedding(cfg.head_dim, cfg.rotary_dim, cfg.rope_parameters, max_positions)
        self.layers = [DecoderLayer(cfg, get, i, ops, rope) for i in range(cfg.num_hidden_layers)]
        self.norm = _req(get, "model.norm.weight")
        head = get("lm_head.weight")
        self.lm_head = self.embed if (cfg.tie_word_embeddings or head is None) else head

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    def kv_shape(self) -> tuple[int, int]:
        """(kv heads, head dim) of every attention layer's cache."""
        return self.cfg.num_key_value_heads, self.cfg.head_dim

    @property
    def num_attention_layers(self) -> int:
        return len(self.layers)

    def forward(self, batch: ForwardBatch, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Hidden states ``[rows, hidden]`` after the final norm."""
        h = self.embed[batch.input_ids]
        for layer, kv in zip(self.layers, kv_caches, strict=True):
            h = layer(h, batch, kv)
        return self.ops.rms_norm(h, self.norm, self.cfg.rms_norm_eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits ``[rows, vocab]`` for selected hidden rows."""
        return self.ops.linear(hidden, self.lm_head).float()


def _req(get: WeightGetter, name: str) -> torch.Tensor:
    tensor = get(name)
    if tensor is None:
        raise ValueError(f"checkpoint: missing tensor {name!r}")
    return tensor
