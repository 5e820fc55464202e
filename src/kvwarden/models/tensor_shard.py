"""Tensor and expert parallelism as the model sees it: which slice of each weight this rank holds, the
per-rank config its blocks are built from, and the one collective its forward pass calls.

NOTE(invariance) - the answer does not depend on the number of ranks, by construction: **no reduction
ever crosses ranks**. Every weight is split by its *output* columns (attention and MLP projections by
heads and intermediate columns, the output projections ``o_proj`` / ``down_proj`` by their output
columns too, the embedding and LM head by vocabulary rows, MoE layers by whole experts, a gated DeltaNet
by key-head group and a Mamba2 layer by group, with their states), so every number
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

    def output_linear(self, ops: Any, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        """An output projection (``o_proj``, ``down_proj``, ``out_proj``) of this rank's input columns ``x`` and
        output rows ``w``: every rank's input is gathered first, every rank's output columns after.
        NOTE(invariance): gathered, never summed, so each column is one rank's whole reduction, as on one rank."""
        if not self.active:
            return ops.linear(x, w, b)
        x = self.gather(x, x.shape[1] * self.world)
        return self.gather(ops.linear(x, w, b), w.shape[0] * self.world)

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
    g, m = cfg.gated_deltanet, cfg.mamba2
    if g is not None and g.num_key_heads % world:
        return (
            f"tensor_parallel_size: {world} does not divide linear_num_key_heads ({g.num_key_heads}): gated "
            "DeltaNet heads are split by key-head group"
        )
    if m is not None and (m.n_groups % world or m.num_heads % world):
        return (
            f"tensor_parallel_size: {world} must divide mamba_n_groups ({m.n_groups}) and mamba_n_heads "
            f"({m.num_heads}): Mamba2 heads are split by group, and its gated norm spans a group"
        )
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
    g, m = cfg.gated_deltanet, cfg.mamba2
    recurrent: dict[str, Any] = {}
    if g is not None:  # each rank's key-head groups with their value heads, and their states
        recurrent["gated_deltanet"] = replace(
            g, num_key_heads=g.num_key_heads // w, num_value_heads=g.num_value_heads // w
        )
    if m is not None:  # each rank's groups with their heads, and their states
        recurrent["mamba2"] = replace(m, num_heads=m.num_heads // w, n_groups=m.n_groups // w)
    return replace(cfg, num_attention_heads=cfg.num_attention_heads // w, num_key_value_heads=kv,
                   intermediate_size=cfg.intermediate_size // w, **recurrent)  # fmt: skip


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
    qd = 2 * d if cfg.attn_output_gate else d  # Qwen3-Next: each head's query then its output gate
    recurrent = _recurrent_rows(cfg, shard)
    rows = {
        "q_proj": slice(q_rows.start * qd, q_rows.stop * qd),
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
        if ".linear_attn." in name or ".mamba." in name:
            key = module if module in recurrent else parts[-1]
            return _rows(t, recurrent[key]) if key in recurrent else t
        if ".shared_mlp." in name:  # Granite's dense MLP: input_linear is [gate | up], output_linear as down_proj
            half = t.shape[0] // 2
            cols = shard.part(half) if module == "input_linear" else shard.part(cfg.hidden_size)
            return _rows(t, [cols, slice(half + cols.start, half + cols.stop)] if module == "input_linear" else [cols])
        if module in rows:
            return t[rows[module]].contiguous()
        if module in ("gate_proj", "up_proj"):
            return t[shard.part(t.shape[0])].contiguous()
        return t

    return sliced


def _rows(t: torch.Tensor, parts: list[slice]) -> torch.Tensor:
    return torch.cat([t[p] for p in parts]).contiguous()


def _scaled(part: slice, width: int, offset: int = 0) -> slice:
    return slice(offset + part.start * width, offset + part.stop * width)


def _recurrent_rows(cfg: ModelConfig, shard: TensorShard) -> dict[str, list[slice]]:
    """The rows of each recurrent-layer tensor (by module, or by parameter name) this rank holds: its
    gated-DeltaNet key-head groups (with their value heads) or its Mamba2 groups (with their heads), in each
    packed projection's layout. ``norm`` is per head and whole, ``out_proj`` split by output columns."""
    out: dict[str, list[slice]] = {"out_proj": [shard.part(cfg.hidden_size)]}
    g, m = cfg.gated_deltanet, cfg.mamba2
    if g is not None:
        kh, vh = shard.part(g.num_key_heads), shard.part(g.num_value_heads)
        dk, dv, rep, key = (
            g.key_head_dim,
            g.value_head_dim,
            g.num_value_heads // g.num_key_heads,
            g.num_key_heads * g.key_head_dim,
        )
        qkv = [_scaled(kh, dk), _scaled(kh, dk, key), _scaled(vh, dv, 2 * key)]  # q | k | v, every head's
        out |= {"in_proj_qkvz": [_scaled(kh, 2 * dk + 2 * rep * dv)], "in_proj_ba": [_scaled(kh, 2 * rep)],
                "conv1d": qkv, "in_proj_qkv": qkv, "in_proj_z": [_scaled(vh, dv)], "in_proj_b": [vh],
                "in_proj_a": [vh], "dt_bias": [vh], "A_log": [vh]}  # fmt: skip
    if m is not None:
        hp, gp, p, n, inner = shard.part(m.num_heads), shard.part(m.n_groups), m.head_dim, m.state_size, m.inner
        xbc = [_scaled(hp, p), _scaled(gp, n, inner), _scaled(gp, n, inner + m.n_groups * n)]  # x | B | C
        gate_xbc_dt = [_scaled(hp, p)] + [slice(inner + s.start, inner + s.stop) for s in xbc]
        gate_xbc_dt.append(slice(inner + m.conv_dim + hp.start, inner + m.conv_dim + hp.stop))
        out |= {"in_proj": gate_xbc_dt, "conv1d": xbc, "dt_bias": [hp], "A_log": [hp], "D": [hp],
                "norm": [_scaled(hp, p)]}  # fmt: skip
    return out
