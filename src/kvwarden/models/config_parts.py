"""The parts of a ``config.json`` that differ by family: recurrent layers, MoE, sliding windows, refusals.

:class:`~kvwarden.models.config.ModelConfig` is assembled from these; each
parser reads the family's own field names (as its published checkpoints carry
them) and raises ``ValueError`` naming the field it cannot serve.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from kvwarden.models.quant import parse_quantization

ATTENTION = "attention"
GATED_DELTANET = "gated_deltanet"
MAMBA2 = "mamba2"


@dataclass(frozen=True)
class GatedDeltaNetConfig:
    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int

    @property
    def conv_dim(self) -> int:
        return 2 * self.num_key_heads * self.key_head_dim + self.num_value_heads * self.value_head_dim


@dataclass(frozen=True)
class Mamba2Config:
    num_heads: int
    head_dim: int
    state_size: int
    n_groups: int
    conv_kernel: int
    conv_bias: bool
    proj_bias: bool
    time_step_limit: tuple[float, float]

    @property
    def inner(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.inner + 2 * self.n_groups * self.state_size


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    top_k: int
    intermediate_size: int
    shared_intermediate_size: int
    norm_topk_prob: bool
    sparse_layers: tuple[bool, ...]
    # "softmax_topk": softmax over every expert, then the top k (Qwen); "topk_softmax": the top k logits,
    # then a softmax over them (Granite); "sigmoid_group": DeepSeek's group-limited sigmoid routing (GLM-5)
    routing: str = "softmax_topk"
    n_group: int = 1  # sigmoid_group: experts fall into n_group groups, the best topk_group groups compete
    topk_group: int = 1
    routed_scaling_factor: float = 1.0  # sigmoid_group: the routed experts' weights are scaled by it


@dataclass(frozen=True)
class MlaConfig:
    """DeepSeek-style multi-head latent attention with a lightning indexer (GLM-5's DSA).

    The cache holds one latent row per token (``kv_lora_rank`` normalised latent, then the
    ``qk_rope_head_dim`` rotated key) and one indexer key (``index_head_dim``), not per-head keys.
    ``indexer_full[i]``: layer ``i`` runs its own indexer; otherwise it reuses the previous full layer's
    selection.
    """

    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    indexer_full: tuple[bool, ...]
    softmax_scale: float  # (qk_nope + qk_rope) ** -0.5, times yarn's mscale squared when the rope is yarn
    indexer_interleaved: bool = True  # GLM-5 turns the indexer's pairs interleaved; DeepSeek-V3.2 half-split

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim


def qwen3_next_fields(cfg: dict[str, Any], rope: dict[str, Any]) -> dict[str, Any]:
    n = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types")
    if types is None:
        interval = int(cfg.get("full_attention_interval", 4))
        types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n)]
    unknown = sorted({str(t) for t in types} - {"linear_attention", "full_attention"})
    if unknown:
        raise ValueError(f"config.json: layer_types {unknown} are not supported (linear_attention, full_attention)")
    layer_types = tuple(GATED_DELTANET if t == "linear_attention" else ATTENTION for t in types)
    moe = qwen_moe(cfg, n, shared=True)
    return {
        "layer_types": layer_types,
        "norm_offset": True,
        "attn_output_gate": True,
        "partial_rotary_factor": float(cfg.get("partial_rotary_factor", rope.get("partial_rotary_factor", 0.25))),
        "gated_deltanet": GatedDeltaNetConfig(
            num_key_heads=int(cfg["linear_num_key_heads"]),
            num_value_heads=int(cfg["linear_num_value_heads"]),
            key_head_dim=int(cfg["linear_key_head_dim"]),
            value_head_dim=int(cfg["linear_value_head_dim"]),
            conv_kernel=int(cfg.get("linear_conv_kernel_dim", 4)),
        ),
        "moe": moe,
    }


def qwen_moe(cfg: dict[str, Any], n: int, shared: bool) -> MoEConfig | None:
    """Qwen's sparse MoE (Qwen3-MoE, Qwen3-Next): which layers are sparse, the experts, the shared expert."""
    # published configs say num_experts; transformers 5 saves it as num_local_experts
    num_experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    mlp_only = set(cfg.get("mlp_only_layers") or [])
    step = int(cfg.get("decoder_sparse_step", 1) or 1)
    sparse = tuple(num_experts > 0 and i not in mlp_only and (i + 1) % step == 0 for i in range(n))
    if not any(sparse):
        return None
    return MoEConfig(
        num_experts=num_experts,
        top_k=int(cfg["num_experts_per_tok"]),
        intermediate_size=int(cfg["moe_intermediate_size"]),
        shared_intermediate_size=int(cfg.get("shared_expert_intermediate_size", 0) or 0) if shared else 0,
        norm_topk_prob=bool(cfg.get("norm_topk_prob", shared)),  # transformers' defaults: Qwen3-Next on, Qwen3-MoE off
        sparse_layers=sparse,
    )


def dsa_fields(arch: str, cfg: dict[str, Any], rope: dict[str, Any]) -> dict[str, Any]:
    """DeepSeek Sparse Attention models - GLM-5's ``glm_moe_dsa`` and DeepSeek-V3.2's ``deepseek_v32``: MLA
    with a lightning indexer on every layer, dense then sparse MLPs. GLM-5 may share a full layer's
    selection with the layers after it (``indexer_types``) and turns the indexer's rope pairs interleaved."""
    n = int(cfg["num_hidden_layers"])
    for name in ("q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"):
        if not cfg.get(name):
            raise ValueError(f"config.json: {name} {cfg.get(name)!r} is not supported (a positive size)")
    rope_type = rope.get("rope_type", "default")
    if rope_type not in ("default", "yarn"):
        raise ValueError(
            f"config.json: rope_parameters.rope_type {rope_type!r} is not supported for {arch} (default, yarn)"
        )
    if cfg.get("attention_bias"):
        raise ValueError(f"config.json: attention_bias true is not supported for {arch}")
    if int(cfg["qk_rope_head_dim"]) % 2 or int(cfg.get("index_head_dim", 128)) < int(cfg["qk_rope_head_dim"]):
        raise ValueError("config.json: qk_rope_head_dim must be even and at most index_head_dim")
    glm = arch == "GlmMoeDsaForCausalLM"
    types = cfg.get("indexer_types")
    if not glm:  # DeepSeek-V3.2: every layer runs its indexer (a config asking otherwise is not served)
        if types is not None and any(t != "full" for t in types):
            raise ValueError(f"config.json: indexer_types {types} is not supported for {arch} (every layer full)")
        types = ["full"] * n
    if types is None:  # as transformers derives it: index_topk_pattern, else index_topk_freq / offset
        pattern = cfg.get("index_topk_pattern")
        if pattern is not None:
            types = [{"F": "full", "S": "shared"}.get(c, c) for c in pattern]
        else:
            freq, offset = max(int(cfg.get("index_topk_freq", 1)), 1), int(cfg.get("index_skip_topk_offset", 2))
            types = ["full" if (max(i - offset + 1, 0) % freq) == 0 else "shared" for i in range(n)]
    unknown = sorted({str(t) for t in types} - {"full", "shared"})
    if unknown or len(types) != n:
        raise ValueError(f"config.json: indexer_types {unknown or types} is not supported (full, shared per layer)")
    if types[0] != "full":
        raise ValueError("config.json: indexer_types[0] must be 'full' (a shared layer reuses an earlier selection)")
    kinds = cfg.get("mlp_layer_types")
    if kinds is None:
        dense = min(int(cfg.get("first_k_dense_replace", 3)), n)
        kinds = ["dense"] * dense + ["sparse"] * (n - dense)
    if sorted({str(k) for k in kinds} - {"dense", "sparse"}):
        raise ValueError(f"config.json: mlp_layer_types {kinds} is not supported (dense, sparse per layer)")
    experts = int(cfg.get("n_routed_experts") or cfg.get("num_local_experts") or 0)
    groups, topk_group = int(cfg.get("n_group", 1) or 1), int(cfg.get("topk_group", 1) or 1)
    if experts % groups or not 1 <= topk_group <= groups or (experts and experts // groups < 2):
        raise ValueError(
            f"config.json: n_group {groups} / topk_group {topk_group} do not split {experts} experts into "
            "groups of two or more"
        )
    sparse = tuple(k == "sparse" for k in kinds)
    moe = None
    if experts and any(sparse):
        moe = MoEConfig(
            num_experts=experts,
            top_k=int(cfg["num_experts_per_tok"]),
            intermediate_size=int(cfg["moe_intermediate_size"]),
            shared_intermediate_size=int(cfg["moe_intermediate_size"]) * int(cfg.get("n_shared_experts", 0) or 0),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
            sparse_layers=sparse,
            routing="sigmoid_group",
            n_group=groups,
            topk_group=topk_group,
            routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
        )
    qk = int(cfg["qk_nope_head_dim"]) + int(cfg["qk_rope_head_dim"])
    scale = qk**-0.5
    if rope_type != "default" and rope.get("mscale_all_dim"):  # as transformers: yarn's mscale, squared
        mscale = 0.1 * float(rope["mscale_all_dim"]) * math.log(float(rope["factor"])) + 1.0
        scale = scale * mscale * mscale if float(rope["factor"]) > 1 else scale
    mla = MlaConfig(
        q_lora_rank=int(cfg["q_lora_rank"]),
        kv_lora_rank=int(cfg["kv_lora_rank"]),
        qk_nope_head_dim=int(cfg["qk_nope_head_dim"]),
        qk_rope_head_dim=int(cfg["qk_rope_head_dim"]),
        v_head_dim=int(cfg["v_head_dim"]),
        index_n_heads=int(cfg.get("index_n_heads", 32)),
        index_head_dim=int(cfg.get("index_head_dim", 128)),
        index_topk=int(cfg.get("index_topk", 2048)),
        indexer_full=tuple(t == "full" for t in types),
        softmax_scale=scale,
        indexer_interleaved=glm,
    )
    mtp_layers = int(cfg.get("num_nextn_predict_layers", 0) or 0)
    if mtp_layers > 1:  # DeepSeek's later MTP layers chain on the first's output; vLLM drafts with one too
        raise ValueError(
            f"config.json: num_nextn_predict_layers {mtp_layers} is not supported (0 or 1: kvwarden drafts with "
            "one MTP layer)"
        )
    # rope turns the qk_rope_head_dim slice only: the rotary table is that wide (transformers points
    # head_dim at it too)
    return {"mla": mla, "moe": moe, "head_dim": mla.qk_rope_head_dim, "qk_norm": False, "mtp_layers": mtp_layers}


def granite_hybrid_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    experts = int(cfg.get("num_local_experts", 0) or 0)
    n = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types") or cfg.get("layers_block_type") or ["mamba"] * n
    layer_types = tuple(MAMBA2 if t in ("mamba", "linear_attention") else ATTENTION for t in types)
    hidden = int(cfg["hidden_size"])
    inner = int(cfg.get("mamba_expand", 2) * hidden)
    heads = int(cfg["mamba_n_heads"])
    d_head = cfg.get("mamba_d_head", "auto")
    limit = cfg.get("time_step_limit") or (0.0, float("inf"))
    limit = tuple(float("inf") if isinstance(v, dict) else float(v) for v in limit)
    return {
        "layer_types": layer_types,
        "intermediate_size": int(cfg["shared_intermediate_size"]),
        "use_rope": cfg.get("position_embedding_type") == "rope",
        "attention_multiplier": float(cfg.get("attention_multiplier", 1.0)),
        "embedding_multiplier": float(cfg.get("embedding_multiplier", 1.0)),
        "residual_multiplier": float(cfg.get("residual_multiplier", 1.0)),
        "logits_scaling": float(cfg.get("logits_scaling", 1.0)),
        "moe": MoEConfig(
            num_experts=experts,
            top_k=int(cfg["num_experts_per_tok"]),
            intermediate_size=int(cfg["intermediate_size"]),
            shared_intermediate_size=0,  # Granite's shared_mlp is its own FFN, added after the experts
            norm_topk_prob=False,
            sparse_layers=(True,) * n,
            routing="topk_softmax",
        )
        if experts > 0
        else None,
        "mamba2": Mamba2Config(
            num_heads=heads,
            head_dim=inner // heads if d_head == "auto" else int(d_head),
            state_size=int(cfg["mamba_d_state"]),
            n_groups=int(cfg.get("mamba_n_groups", 1)),
            conv_kernel=int(cfg.get("mamba_d_conv", 4)),
            conv_bias=bool(cfg.get("mamba_conv_bias", True)),
            proj_bias=bool(cfg.get("mamba_proj_bias", False)),
            time_step_limit=(limit[0], limit[1]),
        ),
    }


def sliding_window(arch: str, cfg: dict[str, Any]) -> int | None:
    """The attention window of a sliding-window model, or None when no layer slides.

    Mistral slides on every layer; Qwen2 only with ``use_sliding_window`` and then on the layers from
    ``max_window_layers`` on (as transformers builds its ``layer_types``). Either way kvwarden serves such a
    model up to the window, where sliding and full attention are the same computation.
    """
    window = cfg.get("sliding_window")
    if window is None or arch not in ("MistralForCausalLM", "Qwen2ForCausalLM"):
        return None  # Qwen3 configs carry a window with use_sliding_window false (refused when true)
    if arch == "Qwen2ForCausalLM":
        n = int(cfg["num_hidden_layers"])
        if not cfg.get("use_sliding_window", False) or int(cfg.get("max_window_layers", n)) >= n:
            return None
    return int(window)


def refuse_unsupported(arch: str, cfg: dict[str, Any]) -> None:
    """Refuse, naming the field, what kvwarden would otherwise ignore and serve wrongly."""
    parse_quantization(cfg)  # fp8 block-wise is read (models/quant.py); any other method is refused, named
    act = cfg.get("hidden_act", cfg.get("hidden_activation", "silu"))
    if act not in ("silu", "swish"):
        raise ValueError(f"config.json: hidden_act {act!r} is not supported (silu)")
    if cfg.get("use_sliding_window") and arch not in ("Qwen2ForCausalLM", "MistralForCausalLM"):
        raise ValueError(f"config.json: use_sliding_window is not supported for {arch}")
    # Qwen3.5's mrope (mrope_section, mrope_interleaved) is understood, not ignored: with text alone the
    # temporal, height and width positions are the same, so every frequency rotates by the token's position.
