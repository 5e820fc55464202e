"""The parts of a ``config.json`` that differ by family: recurrent layers, MoE, sliding windows, refusals.

:class:`~kvwarden.models.config.ModelConfig` is assembled from these; each
parser reads the family's own field names (as its published checkpoints carry
them) and raises ``ValueError`` naming the field it cannot serve.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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
    # then a softmax over them (Granite)
    routing: str = "softmax_topk"


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
    quant = cfg.get("quantization_config")
    if quant:
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else quant
        raise ValueError(f"config.json: quantization_config ({method}) is not supported: kvwarden loads dense weights")
    act = cfg.get("hidden_act", cfg.get("hidden_activation", "silu"))
    if act not in ("silu", "swish"):
        raise ValueError(f"config.json: hidden_act {act!r} is not supported (silu)")
    if cfg.get("use_sliding_window") and arch not in ("Qwen2ForCausalLM", "MistralForCausalLM"):
        raise ValueError(f"config.json: use_sliding_window is not supported for {arch}")
    # Qwen3.5's mrope (mrope_section, mrope_interleaved) is understood, not ignored: with text alone the
    # temporal, height and width positions are the same, so every frequency rotates by the token's position.
