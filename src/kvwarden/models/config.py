"""Model configuration parsed from a Hugging Face ``config.json``.

One frozen :class:`ModelConfig` describes every supported family; the hybrid
families add a per-layer ``layer_types`` list and the recurrent layer's own
config (:class:`GatedDeltaNetConfig` or :class:`Mamba2Config`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3NextForCausalLM",
    "GraniteMoeHybridForCausalLM",
)
_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_next": "Qwen3NextForCausalLM",
    "granitemoehybrid": "GraniteMoeHybridForCausalLM",
}
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


@dataclass(frozen=True)
class ModelConfig:
    """The fields of a decoder-only model that kvwarden uses (Hugging Face names)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    qk_norm: bool
    rope_parameters: dict[str, Any]
    partial_rotary_factor: float = 1.0
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    layer_types: tuple[str, ...] = ()
    norm_offset: bool = False  # Qwen3-Next norms scale by (1 + w)
    attn_output_gate: bool = False  # Qwen3-Next: sigmoid gate on the attention output
    use_rope: bool = True
    attention_multiplier: float | None = None  # Granite: replaces head_dim ** -0.5
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    gated_deltanet: GatedDeltaNetConfig | None = None
    mamba2: Mamba2Config | None = None
    moe: MoEConfig | None = None
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == ATTENTION]

    @property
    def recurrent_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t != ATTENTION]

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Parse a ``config.json`` dict; raises ``ValueError`` naming what is unsupported."""
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else _MODEL_TYPES.get(cfg.get("model_type") or "", str(cfg.get("model_type")))
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"config.json: architecture {arch!r} is not supported (supported: {SUPPORTED_ARCHITECTURES})"
            )
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        eos = cfg.get("eos_token_id")
        rope = rope_parameters(cfg)
        common: dict[str, Any] = {
            "architecture": arch,
            "vocab_size": int(cfg["vocab_size"]),
            "hidden_size": hidden,
            "intermediate_size": int(cfg.get("intermediate_size") or cfg.get("shared_intermediate_size") or 0),
            "num_hidden_layers": int(cfg["num_hidden_layers"]),
            "num_attention_heads": heads,
            "num_key_value_heads": int(cfg.get("num_key_value_heads") or heads),
            "head_dim": int(cfg.get("head_dim") or hidden // heads),
            "rms_norm_eps": float(cfg.get("rms_norm_eps", 1e-6)),
            "max_position_embeddings": int(cfg.get("max_position_embeddings", 2048)),
            "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", False)),
            "attention_bias": bool(cfg.get("attention_bias", False)),
            "mlp_bias": bool(cfg.get("mlp_bias", False)),
            "qk_norm": arch in ("Qwen3ForCausalLM", "Qwen3NextForCausalLM"),
            "rope_parameters": rope,
            "partial_rotary_factor": float(cfg.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0))),
            "bos_token_id": cfg.get("bos_token_id"),
            "eos_token_ids": tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),)),
            "layer_types": (ATTENTION,) * int(cfg["num_hidden_layers"]),
            "raw": cfg,
        }
        if arch == "Qwen3NextForCausalLM":
            common.update(_qwen3_next(cfg, rope))
        elif arch == "GraniteMoeHybridForCausalLM":
            common.update(_granite_hybrid(cfg))
        return cls(**common)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no config.json (is {model_dir} a Hugging Face model directory?)")
        try:
            cfg = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: invalid JSON ({exc})") from exc
        return cls.from_dict(cfg)


def _qwen3_next(cfg: dict[str, Any], rope: dict[str, Any]) -> dict[str, Any]:
    n = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types")
    if types is None:
        interval = int(cfg.get("full_attention_interval", 4))
        types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n)]
    layer_types = tuple(GATED_DELTANET if t == "linear_attention" else ATTENTION for t in types)
    num_experts = int(cfg.get("num_experts", 0) or 0)
    mlp_only = set(cfg.get("mlp_only_layers") or [])
    step = int(cfg.get("decoder_sparse_step", 1) or 1)
    sparse = tuple(num_experts > 0 and i not in mlp_only and (i + 1) % step == 0 for i in range(n))
    moe = None
    if any(sparse):
        moe = MoEConfig(
            num_experts=num_experts,
            top_k=int(cfg["num_experts_per_tok"]),
            intermediate_size=int(cfg["moe_intermediate_size"]),
            shared_intermediate_size=int(cfg.get("shared_expert_intermediate_size", 0) or 0),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
            sparse_layers=sparse,
        )
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


def _granite_hybrid(cfg: dict[str, Any]) -> dict[str, Any]:
    experts = int(cfg.get("num_local_experts", 0) or 0)
    if experts > 0:
        raise ValueError(
            f"config.json: num_local_experts = {experts}: GraniteMoeHybrid with routed experts is not supported "
            "(the dense form only: num_local_experts 0)"
        )
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


def rope_parameters(cfg: dict[str, Any]) -> dict[str, Any]:
    """Rope parameters in transformers v5 form from either v4 or v5 configs."""
    params = dict(cfg.get("rope_parameters") or {})
    legacy = cfg.get("rope_scaling") or {}
    for key, value in legacy.items():
        params.setdefault("rope_type" if key == "type" else key, value)
    params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    params.setdefault("rope_type", "default")
    return params
