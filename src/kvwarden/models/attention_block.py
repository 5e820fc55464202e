"""Self-attention over the paged KV cache (Llama, Qwen3, Qwen3-Next, Granite flavours)."""

from __future__ import annotations

import torch

from kvwarden.layers.numerics import Ops
from kvwarden.layers.rotary import RotaryEmbedding
from kvwarden.models.common import ForwardBatch, WeightGetter, fuse, norm_weight, require
from kvwarden.models.config import ModelConfig
from kvwarden.models.tensor_shard import TensorShard


class AttentionBlock:
    """q/k/v projections, optional per-head q/k norm, rope, paged attention, output.

    Qwen3-Next doubles ``q_proj`` to carry a per-head output gate
    (``o * sigmoid(gate)``); Granite scales scores by ``attention_multiplier``
    and may use no rope.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        get: WeightGetter,
        prefix: str,
        ops: Ops,
        rope: RotaryEmbedding | None,
        shard: TensorShard | None = None,
    ) -> None:
        """``shard``: under tensor parallelism ``cfg`` holds this rank's heads and ``get`` its slices of the
        projections (``o_proj`` by output columns: every rank's heads gathered first, its output after)."""
        self.cfg, self.ops, self.rope = cfg, ops, rope
        self.shard = shard or TensorShard()
        names = ("q_proj", "k_proj", "v_proj")
        weights = [require(get, f"{prefix}.{n}.weight") for n in names]
        # Biases exactly where the config puts them (Qwen2: q, k and v only); one in the checkpoint that the
        # config does not announce is never read, so the loader refuses it rather than serve with or without it.
        qkv_bias = cfg.attention_bias
        o_bias = cfg.attention_bias and cfg.architecture != "Qwen2ForCausalLM"
        biases = [require(get, f"{prefix}.{n}.bias") if qkv_bias else None for n in names]
        # One GEMM for q, k and v: a third of the launches and a wider grid for small batches.
        # NOTE(invariance): the fused weight's shape alone picks the GEMM's tiles, as for any weight.
        self.wqkv, self.bqkv = fuse(weights, biases)
        self.qkv_split = [w.shape[0] for w in weights]
        self.wo = require(get, f"{prefix}.o_proj.weight")
        self.bo = require(get, f"{prefix}.o_proj.bias") if o_bias else None
        self.q_norm = norm_weight(cfg, get, f"{prefix}.q_norm.weight") if cfg.qk_norm else None
        self.k_norm = norm_weight(cfg, get, f"{prefix}.k_norm.weight") if cfg.qk_norm else None
        self.scale = cfg.attention_multiplier if cfg.attention_multiplier is not None else cfg.head_dim**-0.5
        self.name = "attn"

    def __call__(self, h: torch.Tensor, batch: ForwardBatch, kv: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        cfg, ops = self.cfg, self.ops
        rows, d = h.shape[0], cfg.head_dim
        q, k, v = ops.linear(h, self.wqkv, self.bqkv).split(self.qkv_split, dim=-1)
        gate = None
        if cfg.attn_output_gate:
            q, gate = q.view(rows, cfg.num_attention_heads, 2 * d).chunk(2, dim=-1)
            gate = gate.reshape(rows, -1)
        q = q.reshape(rows, cfg.num_attention_heads, d)
        k = k.reshape(rows, cfg.num_key_value_heads, d)
        v = v.reshape(rows, cfg.num_key_value_heads, d)
        norms = None
        if self.q_norm is not None and self.k_norm is not None:
            norms = (self.q_norm, self.k_norm, cfg.rms_norm_eps)
        # one kernel on a GPU: per-head norms, rotary, the K/V write (a traced step runs the very same kernel, so
        # tracing changes no bit; its rotated K is read back from the cache slots it was written to)
        q = ops.rope_write_kv(self.rope, q, k, v, batch.positions, kv, batch.slot_mapping, norms)
        batch.exchange_kv(kv)  # context parallelism: the other ranks' rows of the step, before any read
        k_cache, v_cache = kv
        if batch.tracer is not None:
            batch.trace(f"{self.name}.q", q)
            batch.trace(f"{self.name}.k", k_cache[batch.slot_mapping])
            batch.trace(f"{self.name}.v", v)
            # the context as read, cached positions included
            for seq, attn_seq in zip(batch.seqs, batch.plan.seqs, strict=True):
                slots = attn_seq.slots[: seq.start + seq.num_tokens]
                batch.tracer.record_context(f"{self.name}.k_ctx", seq.request_id, k_cache[slots])
                batch.tracer.record_context(f"{self.name}.v_ctx", seq.request_id, v_cache[slots, :, :d])
        o = ops.attention(q, kv, batch.plan, self.scale, batch.block_size).reshape(rows, -1)
        batch.trace(f"{self.name}.core", o)
        if gate is not None:
            o = o * ops.sigmoid(gate)
        return self.shard.output_linear(ops, o, self.wo, self.bo)
