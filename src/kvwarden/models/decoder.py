"""The decoder stack shared by every family: embeddings, layers, final norm, LM head.

A layer is ``x + r * mixer(norm(x))`` then ``x + r * ffn(norm(x))`` where the
mixer is attention, a gated-DeltaNet or a Mamba2 block and the FFN a dense MLP
or a sparse MoE, as the config's ``layer_types`` and MoE settings say. Family
quirks (Qwen3-Next's ``1 + w`` norms, Granite's multipliers) are config fields,
not subclasses.
"""

from __future__ import annotations

import torch

from kvwarden.cache.state_spec import RecurrentLayerSpec
from kvwarden.layers.numerics import Ops
from kvwarden.layers.rotary import RotaryEmbedding
from kvwarden.models.attention_block import AttentionBlock
from kvwarden.models.common import ForwardBatch, SeqSlice, WeightGetter, norm_weight, require
from kvwarden.models.config import ATTENTION, GATED_DELTANET, ModelConfig
from kvwarden.models.mla_block import MlaBlock
from kvwarden.models.mlp import build_ffn
from kvwarden.models.recurrent_blocks import GatedDeltaNetBlock, Mamba2Block
from kvwarden.models.tensor_shard import TensorShard, even_split

__all__ = ["DecoderModel", "ForwardBatch", "SeqSlice"]


class DecoderLayer:
    def __init__(
        self,
        cfg: ModelConfig,
        get: WeightGetter,
        index: int,
        ops: Ops,
        rope: RotaryEmbedding | None,
        prefix: str | None = None,
        kind: str | None = None,
        shard: TensorShard | None = None,
    ) -> None:
        """Layer ``index`` of the stack, or (``prefix`` and ``kind`` given) an extra layer such as the MTP head's."""
        prefix = prefix or f"model.layers.{index}"
        self.cfg, self.ops = cfg, ops
        self.kind = kind or cfg.layer_types[index]
        self.input_norm = norm_weight(cfg, get, f"{prefix}.input_layernorm.weight")
        self.post_norm = norm_weight(cfg, get, f"{prefix}.post_attention_layernorm.weight")
        self.name = f"L{index}" if prefix.startswith("model.layers.") else prefix
        self.mixer: AttentionBlock | MlaBlock | GatedDeltaNetBlock | Mamba2Block
        if self.kind == ATTENTION and cfg.mla is not None:
            self.mixer = MlaBlock(cfg, get, f"{prefix}.self_attn", ops, rope, index, shard)
        elif self.kind == ATTENTION:
            self.mixer = AttentionBlock(cfg, get, f"{prefix}.self_attn", ops, rope, shard)
        elif self.kind == GATED_DELTANET:
            self.mixer = GatedDeltaNetBlock(cfg, get, f"{prefix}.linear_attn", ops, shard)
        else:
            self.mixer = Mamba2Block(cfg, get, f"{prefix}.mamba", ops, shard)
        self.mixer.name = f"{self.name}.{'attn' if self.kind == ATTENTION else 'rec'}"
        self.ffn = build_ffn(cfg, get, index, ops, prefix, shard)
        self.kv_index = -1  # index into the KV caches (attention layers)
        self.state_index = -1  # index into the state pool (recurrent layers)

    def __call__(
        self,
        h: torch.Tensor,
        batch: ForwardBatch,
        kv: list[tuple[torch.Tensor, torch.Tensor]],
        pending: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(h, out)``: the residual stream and this layer's scaled FFN output, not yet added.

        ``pending`` is the previous layer's such output: each residual add is
        done inside the next RMSNorm (``Ops.add_rms_norm``; one kernel on a GPU),
        rounded to the model's dtype exactly as a separate add.
        """
        eps, r = self.cfg.rms_norm_eps, self.cfg.residual_multiplier
        if pending is None:
            x = self.ops.rms_norm(h, self.input_norm, eps)
        else:
            x, h = self.ops.add_rms_norm(pending, h, self.input_norm, eps)
        batch.trace(f"{self.name}.input_norm", x)
        if self.kind == ATTENTION:
            mixed = self.mixer(x, batch, kv[self.kv_index])
        else:
            mixed = self.mixer(x, batch, self.state_index)
        batch.trace(f"{self.name}.mixer", mixed)
        x, h = self.ops.add_rms_norm(mixed * r if r != 1.0 else mixed, h, self.post_norm, eps)
        out = self.ffn(x)
        batch.trace(f"{self.name}.ffn", out)
        out = out * r if r != 1.0 else out
        if batch.tracer is not None:  # the stream after the layer, as the next norm will form it
            batch.trace(f"{self.name}.out", h + out)
        return h, out


class DecoderModel:
    """Decoder-only model of any supported family over the paged cache."""

    def __init__(
        self, cfg: ModelConfig, get: WeightGetter, ops: Ops, max_positions: int, shard: TensorShard | None = None
    ) -> None:
        """``shard``: this rank's place under tensor parallelism (``cfg`` is then the rank's own share of the
        heads, ``get`` its slices; ``models/tensor_shard.py``)."""
        self.cfg, self.ops = cfg, ops
        self.shard = shard or TensorShard()
        self.embed = require(get, "model.embed_tokens.weight")
        rope = None
        if cfg.use_rope and cfg.attention_layers:
            rope = RotaryEmbedding(cfg.head_dim, cfg.rotary_dim, cfg.rope_parameters, max_positions, ops.device)
        self.rope = rope
        self.layers = [DecoderLayer(cfg, get, i, ops, rope, shard=shard) for i in range(cfg.num_hidden_layers)]
        for kv_i, i in enumerate(cfg.attention_layers):
            self.layers[i].kv_index = kv_i
        for st_i, i in enumerate(cfg.recurrent_layers):
            self.layers[i].state_index = st_i
        self.norm = norm_weight(cfg, get, "model.norm.weight")
        head = get("lm_head.weight")
        self.lm_head = self.embed if (cfg.tie_word_embeddings or head is None) else head

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    def kv_shape(self) -> tuple[int, int]:
        """(kv heads, head dim) of every attention layer's cache."""
        return self.cfg.num_key_value_heads, self.cfg.head_dim

    def new_kv_cache(self, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One attention layer's cache tensors, all zero (the null slot's rows stay so).

        Per-head K and V in the numerics backend's layout; GLM-5's sparse attention keeps the latent row
        ``[c | k_rope]`` per token in the first tensor and the indexer's key in the second (one head each).
        """
        mla = self.cfg.mla
        if mla is None:
            heads, dim = self.kv_shape()
            return self.ops.new_kv_cache(slots, heads, dim, self.dtype)
        dev = self.ops.device
        return (
            torch.zeros(slots, 1, mla.latent_dim, dtype=self.dtype, device=dev),
            torch.zeros(slots, 1, mla.index_head_dim, dtype=self.dtype, device=dev),
        )

    def kv_bytes_per_token(self) -> int:
        """Bytes one token occupies in one attention layer's cache (an upper bound: V may carry a ones column)."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        if self.cfg.mla is not None:
            return (self.cfg.mla.latent_dim + self.cfg.mla.index_head_dim) * elem
        heads, dim = self.kv_shape()
        return heads * (2 * dim + 1) * elem

    @property
    def num_attention_layers(self) -> int:
        return len(self.cfg.attention_layers)

    def recurrent_specs(self) -> list[RecurrentLayerSpec]:
        return [self.layers[i].mixer.spec() for i in self.cfg.recurrent_layers]  # type: ignore[union-attr]

    def forward(self, batch: ForwardBatch, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Hidden states ``[rows, hidden]`` after the final norm."""
        h = self._embed(batch.input_ids)
        if self.cfg.embedding_multiplier != 1.0:
            h = h * self.cfg.embedding_multiplier
        batch.trace("embed", h)
        pending = None
        batch.dsa_selection = batch.dsa_keys = batch.dsa_rope = None
        for layer in self.layers:
            h, pending = layer(h, batch, kv_caches, pending)
        if pending is None:
            h = self.ops.rms_norm(h, self.norm, self.cfg.rms_norm_eps)
        else:
            h = self.ops.add_rms_norm(pending, h, self.norm, self.cfg.rms_norm_eps)[0]
        batch.trace("final_norm", h)
        return h

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Embedding rows; under tensor parallelism each rank holds a block of the vocabulary, and every
        rank takes each row from the rank that holds it (a copy: the same bits as one table)."""
        shard = self.shard
        if not shard.active:
            return self.embed[ids]
        vocab = shard.part(self.cfg.vocab_size)
        mine = (ids >= vocab.start) & (ids < vocab.stop)
        local = self.embed[torch.where(mine, ids - vocab.start, torch.zeros_like(ids))]
        assert shard.comm is not None
        hidden = self.embed.shape[1]
        blocks = shard.comm.all_gather(local.view(-1, hidden), [hidden] * shard.world)
        owner = torch.zeros_like(ids)
        bounds = even_split(self.cfg.vocab_size, shard.world)
        for r in range(1, shard.world):
            owner += ids >= sum(bounds[:r])
        return torch.stack(blocks)[owner, torch.arange(ids.shape[0], device=ids.device)]

    def logits(self, hidden: torch.Tensor, head: torch.Tensor | None = None) -> torch.Tensor:
        """Float32 logits ``[rows, vocab]`` for selected hidden rows (``head``: an MTP head's own LM head);
        under tensor parallelism every rank computes its vocabulary block, gathered in rank order."""
        logits = self.ops.linear(hidden, self.lm_head if head is None else head)
        if head is None and self.shard.active:
            logits = self.shard.gather(logits, self.cfg.vocab_size)
        logits = logits.float()
        return logits / self.cfg.logits_scaling if self.cfg.logits_scaling != 1.0 else logits
