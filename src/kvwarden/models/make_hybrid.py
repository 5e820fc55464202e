"""Configs and seeded weights for the hybrid families (Qwen3-Next, GraniteMoeHybrid).

Used by :func:`kvwarden.models.make_model.make_model`; the checkpoints load in
transformers and in kvwarden alike.
"""

from __future__ import annotations

from typing import Any

import torch


class Init:
    """Seeded weight sampler: one generator, draws in a fixed order."""

    def __init__(self, seed: int) -> None:
        self.gen = torch.Generator().manual_seed(seed)

    def normal(self, *shape: int, std: float) -> torch.Tensor:
        # in place: the same products as `randn * std`, without a second tensor of the shape (a 150K-token
        # vocabulary's embedding is 3 GB in float32; published configurations' sweeps draw several)
        return torch.randn(*shape, generator=self.gen).mul_(std)

    def uniform(self, *shape: int, low: float, high: float) -> torch.Tensor:
        return low + (high - low) * torch.rand(*shape, generator=self.gen)


QWEN3_NEXT_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "full_attention_interval": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32,
        "mlp_only_layers": [0],
    },
    "small": {
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 8,
        "full_attention_interval": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "linear_num_key_heads": 4,
        "linear_num_value_heads": 8,
        "linear_key_head_dim": 32,
        "linear_value_head_dim": 32,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 128,
        "shared_expert_intermediate_size": 128,
        "mlp_only_layers": [0],
    },
}

# Dimensions that vLLM's CPU kernels accept (attention head 64, linear-attention heads 128),
# so the same checkpoint can be served by vLLM and kvwarden side by side.
QWEN3_NEXT_PRESETS["compat"] = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "full_attention_interval": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "linear_num_key_heads": 1,
    "linear_num_value_heads": 1,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
    "mlp_only_layers": [0],
}

# Qwen3-Next's structure (3 linear-attention layers per full-attention layer, gated attention with
# head dim 256 and partial rope, 2 KV heads, sparse MoE with a shared expert) at about Qwen3-0.6B's
# size: about 0.7B parameters, 155M of them the 151,936-row embedding.
QWEN3_NEXT_PRESETS["0.6b"] = {
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 24,
    "full_attention_interval": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "linear_num_key_heads": 8,
    "linear_num_value_heads": 16,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "num_experts": 16,
    "num_experts_per_tok": 4,
    "moe_intermediate_size": 256,
    "shared_expert_intermediate_size": 512,
    "mlp_only_layers": [],
    "max_position_embeddings": 40960,
}

GRANITE_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {
        "hidden_size": 64,
        "shared_intermediate_size": 128,
        "num_hidden_layers": 4,
        "layer_types": ["mamba", "attention", "mamba", "mamba"],
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "mamba_n_heads": 8,
        "mamba_d_state": 16,
        "mamba_n_groups": 2,
        "position_embedding_type": "nope",
    },
    "small": {
        "hidden_size": 256,
        "shared_intermediate_size": 512,
        "num_hidden_layers": 8,
        "layer_types": ["mamba", "mamba", "mamba", "attention"] * 2,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "mamba_n_heads": 16,
        "mamba_d_state": 32,
        "mamba_n_groups": 2,
        "position_embedding_type": "rope",
    },
}


# Granite-4.0-H-Tiny's hybrid layers (hidden 1536; Mamba2 with 48 heads of 64, state 128, one group; attention
# 12 / 4 heads of 128 without rotary; its first 24 layer types, two of them attention) with a dense shared MLP
# instead of its 64 routed experts: about 0.6B parameters (154M of them its 100,352-row tied embedding), so the
# GPU rows of a Mamba2 hybrid stand beside the Qwen3-0.6B shape. 22 Mamba2 layers hold 34.6 MB of float32 state
# per request.
GRANITE_PRESETS["0.6b"] = {
    "hidden_size": 1536,
    "shared_intermediate_size": 1024,
    "num_hidden_layers": 24,
    "layer_types": ["mamba"] * 5 + ["attention"] + ["mamba"] * 9 + ["attention"] + ["mamba"] * 8,
    "num_attention_heads": 12,
    "num_key_value_heads": 4,
    "mamba_n_heads": 48,
    "mamba_d_head": 64,
    "mamba_d_state": 128,
    "mamba_n_groups": 1,
    "position_embedding_type": "nope",
    "vocab_size": 100352,
    "max_position_embeddings": 131072,
    "mamba_chunk_size": 256,
    # the tied 1536-wide embedding (std 0.5) at scaling 2 puts the top token ~90 nats above the next (the
    # residual still carries the input row, which the tied head scores against itself); 10 brings it to ~18
    "logits_scaling": 10.0,
}


def qwen3_next_config(preset: str, vocab: int, eos: int, bos: int) -> dict[str, Any]:
    p = dict(QWEN3_NEXT_PRESETS[preset])
    n, interval = p["num_hidden_layers"], p.pop("full_attention_interval")
    max_positions = p.pop("max_position_embeddings", 4096)
    return {
        "architectures": ["Qwen3NextForCausalLM"],
        "model_type": "qwen3_next",
        "vocab_size": vocab,
        **p,
        "layer_types": ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n)],
        "linear_conv_kernel_dim": 4,
        "decoder_sparse_step": 1,
        "norm_topk_prob": True,
        "hidden_act": "silu",
        "max_position_embeddings": max_positions,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        "partial_rotary_factor": 0.25,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "dtype": "float32",
        "num_nextn_predict_layers": 1,
    }


def granite_config(preset: str, vocab: int, eos: int, bos: int) -> dict[str, Any]:
    preset = "small" if preset == "compat" else preset
    if preset not in GRANITE_PRESETS:
        raise ValueError(f"--preset: granite_hybrid has no {preset!r} preset (it has {sorted(GRANITE_PRESETS)})")
    cfg = {
        "architectures": ["GraniteMoeHybridForCausalLM"],
        "model_type": "granitemoehybrid",
        "vocab_size": vocab,
        "num_local_experts": 0,
        "num_experts_per_tok": 0,
        "mamba_d_conv": 4,
        "mamba_expand": 2,
        "mamba_chunk_size": 64,
        "mamba_conv_bias": True,
        "mamba_proj_bias": False,
        "embedding_multiplier": 2.0,
        "residual_multiplier": 0.5,
        "attention_multiplier": 0.25,
        "logits_scaling": 2.0,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "tie_word_embeddings": True,
        "attention_bias": False,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "dtype": "float32",
    }
    return cfg | GRANITE_PRESETS[preset]  # the preset's own sizes (vocabulary, context, scan chunk) win


def _attention(w: dict[str, torch.Tensor], p: str, cfg: dict[str, Any], init: Init, gated: bool) -> None:
    hidden, heads, kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or hidden // heads
    w[f"{p}.q_proj.weight"] = init.normal(heads * d * (2 if gated else 1), hidden, std=hidden**-0.5)
    w[f"{p}.k_proj.weight"] = init.normal(kv * d, hidden, std=hidden**-0.5)
    w[f"{p}.v_proj.weight"] = init.normal(kv * d, hidden, std=hidden**-0.5)
    w[f"{p}.o_proj.weight"] = init.normal(hidden, heads * d, std=(heads * d) ** -0.5)


def _swiglu(w: dict[str, torch.Tensor], p: str, hidden: int, inter: int, init: Init) -> None:
    w[f"{p}.gate_proj.weight"] = init.normal(inter, hidden, std=hidden**-0.5)
    w[f"{p}.up_proj.weight"] = init.normal(inter, hidden, std=hidden**-0.5)
    w[f"{p}.down_proj.weight"] = init.normal(hidden, inter, std=inter**-0.5)


def _qwen3_next_layer(
    w: dict[str, torch.Tensor], p: str, cfg: dict[str, Any], kind: str, sparse: bool, init: Init
) -> None:
    hidden = cfg["hidden_size"]
    w[f"{p}.input_layernorm.weight"] = init.normal(hidden, std=0.1)  # applied as 1 + w
    w[f"{p}.post_attention_layernorm.weight"] = init.normal(hidden, std=0.1)
    if kind == "full_attention":
        _attention(w, f"{p}.self_attn", cfg, init, gated=True)
        w[f"{p}.self_attn.q_norm.weight"] = init.normal(cfg["head_dim"], std=0.1)
        w[f"{p}.self_attn.k_norm.weight"] = init.normal(cfg["head_dim"], std=0.1)
    else:
        hk, hv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
        dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
        conv_dim = 2 * hk * dk + hv * dv
        la = f"{p}.linear_attn"
        w[f"{la}.in_proj_qkvz.weight"] = init.normal(2 * hk * dk + 2 * hv * dv, hidden, std=hidden**-0.5)
        w[f"{la}.in_proj_ba.weight"] = init.normal(2 * hv, hidden, std=hidden**-0.5)
        w[f"{la}.conv1d.weight"] = init.normal(conv_dim, 1, cfg["linear_conv_kernel_dim"], std=0.5)
        w[f"{la}.dt_bias"] = init.normal(hv, std=0.5)
        w[f"{la}.A_log"] = torch.log(init.uniform(hv, low=1.0, high=5.0))
        w[f"{la}.norm.weight"] = 1.0 + init.normal(dv, std=0.1)
        w[f"{la}.out_proj.weight"] = init.normal(hidden, hv * dv, std=(hv * dv) ** -0.5)
    if sparse:
        mp = f"{p}.mlp"
        w[f"{mp}.gate.weight"] = init.normal(cfg["num_experts"], hidden, std=hidden**-0.5)
        for e in range(cfg["num_experts"]):
            _swiglu(w, f"{mp}.experts.{e}", hidden, cfg["moe_intermediate_size"], init)
        _swiglu(w, f"{mp}.shared_expert", hidden, cfg["shared_expert_intermediate_size"], init)
        w[f"{mp}.shared_expert_gate.weight"] = init.normal(1, hidden, std=hidden**-0.5)
    else:
        _swiglu(w, f"{p}.mlp", hidden, cfg["intermediate_size"], init)


def qwen3_next_weights(cfg: dict[str, Any], init: Init) -> dict[str, torch.Tensor]:
    hidden = cfg["hidden_size"]
    w: dict[str, torch.Tensor] = {"model.embed_tokens.weight": init.normal(cfg["vocab_size"], hidden, std=1.0)}
    for i, kind in enumerate(cfg["layer_types"]):
        sparse = cfg["num_experts"] > 0 and i not in cfg["mlp_only_layers"]
        _qwen3_next_layer(w, f"model.layers.{i}", cfg, kind, sparse, init)
    w["model.norm.weight"] = init.normal(hidden, std=0.1)
    w["lm_head.weight"] = init.normal(cfg["vocab_size"], hidden, std=2.0 * hidden**-0.5)
    # Multi-token-prediction head, as real Qwen3-Next checkpoints carry it.
    w["mtp.fc.weight"] = init.normal(hidden, 2 * hidden, std=(2 * hidden) ** -0.5)
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        w[f"mtp.{name}.weight"] = init.normal(hidden, std=0.1)
    _qwen3_next_layer(w, "mtp.layers.0", cfg, "full_attention", cfg["num_experts"] > 0, init)
    return w


def granite_weights(cfg: dict[str, Any], init: Init) -> dict[str, torch.Tensor]:
    hidden, heads = cfg["hidden_size"], cfg["mamba_n_heads"]
    inner = 2 * hidden
    groups, state = cfg["mamba_n_groups"], cfg["mamba_d_state"]
    conv_dim = inner + 2 * groups * state
    w: dict[str, torch.Tensor] = {"model.embed_tokens.weight": init.normal(cfg["vocab_size"], hidden, std=0.5)}
    for i, kind in enumerate(cfg["layer_types"]):
        p = f"model.layers.{i}"
        w[f"{p}.input_layernorm.weight"] = 1.0 + init.normal(hidden, std=0.1)
        w[f"{p}.post_attention_layernorm.weight"] = 1.0 + init.normal(hidden, std=0.1)
        if kind == "attention":
            _attention(w, f"{p}.self_attn", cfg, init, gated=False)
        else:
            m = f"{p}.mamba"
            w[f"{m}.in_proj.weight"] = init.normal(inner + conv_dim + heads, hidden, std=hidden**-0.5)
            w[f"{m}.conv1d.weight"] = init.normal(conv_dim, 1, cfg["mamba_d_conv"], std=0.5)
            w[f"{m}.conv1d.bias"] = init.normal(conv_dim, std=0.1)
            w[f"{m}.dt_bias"] = init.normal(heads, std=0.5)
            w[f"{m}.A_log"] = torch.log(init.uniform(heads, low=1.0, high=5.0))
            w[f"{m}.D"] = 1.0 + init.normal(heads, std=0.1)
            w[f"{m}.norm.weight"] = 1.0 + init.normal(inner, std=0.1)
            w[f"{m}.out_proj.weight"] = init.normal(hidden, inner, std=inner**-0.5)
        inter = cfg["shared_intermediate_size"]
        w[f"{p}.shared_mlp.input_linear.weight"] = init.normal(2 * inter, hidden, std=hidden**-0.5)
        w[f"{p}.shared_mlp.output_linear.weight"] = init.normal(hidden, inter, std=inter**-0.5)
    w["model.norm.weight"] = 1.0 + init.normal(hidden, std=0.1)
    return w
