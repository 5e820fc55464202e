"""Model configuration parsed from a Hugging Face ``config.json``.

One frozen :class:`ModelConfig` describes every supported family; the hybrid
families add a per-layer ``layer_types`` list and the recurrent layer's own
config (:class:`GatedDeltaNetConfig` or :class:`Mamba2Config`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvwarden.models.config_parts import (
    ATTENTION,
    GATED_DELTANET,
    MAMBA2,
    GatedDeltaNetConfig,
    Mamba2Config,
    MlaConfig,
    MoEConfig,
    dsa_fields,
    granite_hybrid_fields,
    qwen3_next_fields,
    qwen_moe,
    refuse_unsupported,
    sliding_window,
)
from kvwarden.models.quant import Fp8Config, parse_quantization

# The layer kinds and sub-configs are part of this module's interface (models import them from here).
__all__ = [
    "ATTENTION",
    "GATED_DELTANET",
    "MAMBA2",
    "SUPPORTED_ARCHITECTURES",
    "GatedDeltaNetConfig",
    "Mamba2Config",
    "MlaConfig",
    "MoEConfig",
    "ModelConfig",
    "rope_parameters",
]

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "Qwen3NextForCausalLM",
    "Qwen3_5ForCausalLM",
    "GraniteMoeHybridForCausalLM",
    "GlmMoeDsaForCausalLM",
    "DeepseekV32ForCausalLM",
)
_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen3_next": "Qwen3NextForCausalLM",
    "qwen3_5_text": "Qwen3_5ForCausalLM",
    "granitemoehybrid": "GraniteMoeHybridForCausalLM",
    "glm_moe_dsa": "GlmMoeDsaForCausalLM",
    "deepseek_v32": "DeepseekV32ForCausalLM",
}
# Families whose attention has a per-head q/k RMSNorm, and those with Qwen3-Next's linear attention.
_QK_NORM = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Qwen3NextForCausalLM", "Qwen3_5ForCausalLM")
_GATED_DELTANET = ("Qwen3NextForCausalLM", "Qwen3_5ForCausalLM")


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
    mla: MlaConfig | None = None  # GLM-5: latent attention with a lightning indexer (DSA) on every layer
    sliding_window: int | None = None  # Mistral: attention limited to this many keys (served up to it only)
    mtp_layers: int = 0  # GLM-5 / DeepSeek: an MTP layer stored as layer num_hidden_layers (model.layers.N.*)
    quantization: Fp8Config | None = None  # an FP8 block-quantized checkpoint (models/quant.py)
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def fp32_weights(self) -> tuple[str, ...]:
        """Name suffixes of tensors the family computes in float32 whatever the model dtype (as transformers
        keeps them): GLM-5's router, its score-correction bias and the indexer's head weights."""
        if self.mla is None:
            return ()
        return ("mlp.gate.weight", "mlp.gate.e_score_correction_bias", "indexer.weights_proj.weight")

    @property
    def attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == ATTENTION]

    @property
    def recurrent_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t != ATTENTION]

    def with_mtp_layer(self) -> ModelConfig:
        """The config seen by a DeepSeek-style MTP layer, which is layer ``num_hidden_layers``: latent
        attention with its own indexer (it runs alone: nothing to share a selection from) and, in an MoE
        model, routed experts (as vLLM builds it: a decoder layer past ``first_k_dense_replace``)."""
        mla = replace(self.mla, indexer_full=(*self.mla.indexer_full, True)) if self.mla is not None else None
        moe = replace(self.moe, sparse_layers=(*self.moe.sparse_layers, True)) if self.moe is not None else None
        return replace(self, mla=mla, moe=moe, layer_types=(*self.layer_types, ATTENTION))

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Parse a ``config.json`` dict; raises ``ValueError`` naming what is unsupported."""
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else _MODEL_TYPES.get(cfg.get("model_type") or "", str(cfg.get("model_type")))
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"config.json: architectures {archs or [arch]} is not supported; kvwarden serves "
                + ", ".join(SUPPORTED_ARCHITECTURES)
            )
        refuse_unsupported(arch, cfg)
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
            # only Llama's MLP reads mlp_bias (the others have none, whatever the field says)
            "mlp_bias": arch == "LlamaForCausalLM" and bool(cfg.get("mlp_bias", False)),
            "qk_norm": arch in _QK_NORM,
            # as each family's transformers code builds its projections: Qwen2 always biases q/k/v (never o),
            # Mistral never, the others as attention_bias says (Qwen2's and Mistral's fields are ignored there too)
            "attention_bias": arch == "Qwen2ForCausalLM"
            or (arch != "MistralForCausalLM" and bool(cfg.get("attention_bias", False))),
            "rope_parameters": rope,
            "partial_rotary_factor": float(cfg.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0))),
            "bos_token_id": cfg.get("bos_token_id"),
            "eos_token_ids": tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),)),
            "layer_types": (ATTENTION,) * int(cfg["num_hidden_layers"]),
            "sliding_window": sliding_window(arch, cfg),
            "quantization": parse_quantization(cfg),
            "raw": cfg,
        }
        if arch in _GATED_DELTANET:
            common.update(qwen3_next_fields(cfg, rope))
        elif arch == "Qwen3MoeForCausalLM":
            common["moe"] = qwen_moe(cfg, int(cfg["num_hidden_layers"]), shared=False)
        elif arch == "GraniteMoeHybridForCausalLM":
            common.update(granite_hybrid_fields(cfg))
        elif arch in ("GlmMoeDsaForCausalLM", "DeepseekV32ForCausalLM"):
            common.update(dsa_fields(arch, cfg, rope))
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


def rope_parameters(cfg: dict[str, Any]) -> dict[str, Any]:
    """Rope parameters in transformers v5 form from either v4 or v5 configs."""
    params = dict(cfg.get("rope_parameters") or {})
    legacy = cfg.get("rope_scaling") or {}
    for key, value in legacy.items():
        params.setdefault("rope_type" if key == "type" else key, value)
    params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    params.setdefault("rope_type", "default")
    return params
