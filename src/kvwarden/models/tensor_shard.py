"""Tensor and expert parallelism as the model sees it: which slice of each weight this rank holds, the
per-rank config its blocks are built from, and the one collective its forward pass calls.

NOTE(invariance) - the answer does not depend on the number of ranks, by construction: **no reduction
ever crosses ranks**. Every weight is split by its *output* columns (attention and MLP projections by
heads and intermediate columns, the output projections ``o_proj`` / ``down_proj`` by their output
columns too, the embedding and LM head by vocabulary rows, MoE layers by whole experts), so every number
is computed on exactly one rank, over its whole reduction, in the order one rank alone would use. Where a
projection needs inputs other ranks computed (``o_proj`` reads every head's attention output, ``down_proj``
every intermediate column), they are all-gathered first; outputs are all-gathered (concatenated in rank
order) after. A gathered value is copied, never added, so its bits are the computing rank's. What makes a
column's bits independent of how many columns its GEMM computes is the kernels' own contract (the CPU's
compiled GEMM is checked column-slice by column-slice in ``tests/test_tensor_parallel.py``; a GPU backend
must pick its tiles and split of K by the full weight's shape: GPU ranks are refused until it does).

The price is bandwidth, not arithmetic: per dense layer four all-gathers (the attention output, the
``o_proj`` output, the SwiGLU activation, the ``down_proj`` output) where Megatron-style tensor parallelism
runs two all-reduces of the hidden rows; with an intermediate size of 3-4x the hidden size that is about
twice the bytes of a ring all-reduce. ``kvwarden bench tensor_parallel`` measures both.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch

from kvwarden.models.config import ModelConfig


class ColumnGather(Protocol):
    """The collective a sharded forward pass needs (``engine/tensor_parallel/comm.py`` over gloo)."""

    def all_gather(self, x: torch.Tensor, widths: list[int]) -> list[torch.Tensor]:
        """Every rank's ``[rows, widths[r]]`` block of ``x``'s dtype, in rank order."""
        ...


def even_split(n: int, world: int) -> list[int]:
    """``n`` columns over ``world`` ranks: the first ``n % world`` ranks one more (a vocabulary need not divide)."""
    return [n // world + (1 if r < n % world else 0) for r in range(world)]


@dataclass
class TensorShard:
    """This rank's place among ``world`` tensor-parallel ranks; ``comm`` is attached once the group exists
    (the model is built before the workers start)."""

    rank: int = 0
    world: int = 1
    expert_parallel: bool = False
    comm: ColumnGather | None = None

    @property
    def active(self) -> bool:
        return self.world > 1

    def part(self, n: int) -> slice:
        """This rank's columns of ``n``."""
        widths = even_split(n, self.world)
        start = sum(widths[: self.rank])
        return slice(start, start + widths[self.rank])

    def gather(self, x: torch.Tensor, n: int) -> torch.Tensor:
        """``[rows, n]`` on every rank from each rank's ``[rows, part(n)]`` (a copy: the bits are the owner's)."""
        if not self.active:
            return x
        assert self.comm is not None, "tensor parallelism: the ranks' group is not attached"
        return torch.cat(self.comm.all_gather(x.contiguous(), even_split(n, self.world)), dim=-1)

    def owned_experts(self, num_experts: int) -> range:
        """The experts this rank holds (contiguous blocks; every expert on one rank)."""
        per = num_experts // self.world
        return range(self.rank * per, (self.rank + 1) * per)

    def experts_of(self, expert: torch.Tensor, num_experts: int) -> torch.Tensor:
        """The rank owning each expert id."""
        return torch.div(expert, num_experts // self.world, rounding_mode="floor")


def unsupported(cfg: ModelConfig, world: int, expert_parallel: bool) -> str | None:
    """Why ``cfg`` cannot run on ``world`` tensor-parallel ranks, naming the field; None when it can."""
    if world == 1:
        return None
    if cfg.recurrent_layers:
        return (
            "tensor_parallel_size: models with recurrent layers (gated DeltaNet / Mamba2: Qwen3-Next, Qwen3.5, "
            "Granite 4.0-H) are not sharded yet"
        )
    if cfg.attn_output_gate:
        return "tensor_parallel_size: gated attention outputs are not sharded yet"
    h, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    if cfg.mla is not None:
        kv = h  # latent attention: the heads' K/V come from one latent row every rank keeps whole
    if h % world:
        return f"tensor_parallel_size: {world} does not divide num_attention_heads ({h})"
    if kv % world and world % kv:
        return f"tensor_parallel_size: {world} and num_key_value_heads ({kv}): one must divide the other"
    if cfg.hidden_size % world:
        return f"tensor_parallel_size: {world} does not divide hidden_size ({cfg.hidden_size})"
    if cfg.moe is not None:
        if not expert_parallel:
            return (
                "tensor_parallel_size: a MoE model's experts are sharded whole across the ranks: pass "
                "enable_expert_parallel (--enable-expert-parallel)"
            )
        if cfg.moe.num_experts % world:
            return f"enable_expert_parallel: {world} ranks do not divide num_experts ({cfg.moe.num_experts})"
    elif expert_parallel:
        return "enable_expert_parallel: the model has no experts"
    dense = [i for i in range(cfg.num_hidden_layers) if cfg.moe is None or not cfg.moe.sparse_layers[i]]
    if dense and cfg.intermediate_size % world:
        return f"tensor_parallel_size: {world} does not divide intermediate_size ({cfg.intermediate_size})"
    return None


def local_config(cfg: ModelConfig, shard: TensorShard) -> ModelConfig:
    """The config this rank's blocks are built from: its share of the heads (KV heads replicated when
    there are fewer than ranks) and of the dense MLP's intermediate columns."""
    if not shard.active:
        return cfg
    w = shard.world
    kv = max(1, cfg.num_key_value_heads // w)
    return replace(cfg, num_attention_heads=cfg.num_attention_heads // w, num_key_value_heads=kv,
                   intermediate_size=cfg.intermediate_size // w)  # fmt: skip


def kv_heads(cfg: ModelConfig, shard: TensorShard) -> slice:
    """The KV heads this rank's query heads read (a whole group's head when KV heads are fewer than ranks)."""
    kv, w = cfg.num_key_value_heads, shard.world
    if kv >= w:
        return shard.part(kv)
    head = shard.rank * kv // w
    return slice(head, head + 1)


def _latent_rows(cfg: ModelConfig, heads: slice) -> dict[str, slice]:
    """GLM-5 / DeepSeek-V3.2: the heads' rows of ``q_b_proj`` and ``kv_b_proj`` (the latent projections, the
    latent cache and the indexer are every rank's whole)."""
    mla = cfg.mla
    if mla is None:
        return {}
    q, kv = mla.qk_nope_head_dim + mla.qk_rope_head_dim, mla.qk_nope_head_dim + mla.v_head_dim
    return {"q_b_proj": slice(heads.start * q, heads.stop * q), "kv_b_proj": slice(heads.start * kv, heads.stop * kv)}


def shard_getter(get: Any, cfg: ModelConfig, shard: TensorShard) -> Any:
    """``get`` returning this rank's slice of each weight (the module note says which, and why)."""
    if not shard.active:
        return get
    d = cfg.head_dim
    q_rows = shard.part(cfg.num_attention_heads)
    kv = kv_heads(cfg, shard)
    rows = {
        "q_proj": slice(q_rows.start * d, q_rows.stop * d),
        **_latent_rows(cfg, q_rows),
        "k_proj": slice(kv.start * d, kv.stop * d),
        "v_proj": slice(kv.start * d, kv.stop * d),
        "o_proj": shard.part(cfg.hidden_size),
        "down_proj": shard.part(cfg.hidden_size),
    }

    def sliced(name: str) -> torch.Tensor | None:
        t = get(name)
        if t is None or ".experts." in name:  # experts are whole (expert parallelism)
            return t
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return t[shard.part(cfg.vocab_size)].contiguous()
        parts = name.split(".")
        module = parts[-2] if len(parts) >= 2 else ""
        if module in rows:
            return t[rows[module]].contiguous()
        if module in ("gate_proj", "up_proj"):
            return t[shard.part(t.shape[0])].contiguous()
        return t

    return sliced
