"""``make-model`` presets for the families beyond Llama, Qwen3 and the two hybrids' originals.

Each preset is a ``config.json`` in the family's own form (the fields its
published checkpoints carry), small enough for a test, and chosen so that
together they cover the head geometries users bring: GQA ratios of 3, 5, 6
and 7, head sizes of 80 and 96, partial rotary, tied and untied embeddings,
and embedding tables whose row count is not a multiple of 64. Weights come
from :func:`kvwarden.models.random_weights.random_checkpoint`.
"""

from __future__ import annotations

from typing import Any

# arch -> (HF architecture, model_type); the preset tables below give the rest
FAMILIES = {
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "mistral": ("MistralForCausalLM", "mistral"),
    "llama3": ("LlamaForCausalLM", "llama"),
    "qwen3_moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
    "qwen3_5": ("Qwen3_5ForCausalLM", "qwen3_5_text"),
    "granite_hybrid_moe": ("GraniteMoeHybridForCausalLM", "granitemoehybrid"),
    "glm_moe_dsa": ("GlmMoeDsaForCausalLM", "glm_moe_dsa"),
    "deepseek_v32": ("DeepseekV32ForCausalLM", "deepseek_v32"),
}

_DENSE = {  # hidden, intermediate, layers, heads, kv heads, head dim, tied
    ("qwen2", "tiny"): (96, 192, 2, 6, 2, 16, True),  # GQA 3 (SmolLM2's 9/3, Llama-3.2-3B's 24/8)
    ("qwen2", "small"): (384, 1024, 4, 12, 2, 32, False),  # GQA 6 (Qwen2.5-1.5B's 12/2)
    ("mistral", "tiny"): (80, 160, 2, 5, 1, 16, False),  # GQA 5
    ("mistral", "small"): (224, 512, 4, 7, 1, 32, False),  # GQA 7 (Qwen2.5-0.5B's 14/2)
    ("llama3", "tiny"): (160, 256, 2, 2, 1, 80, True),  # head size 80
    ("llama3", "small"): (384, 768, 4, 4, 2, 96, False),  # head size 96
    ("qwen3_moe", "tiny"): (64, 128, 2, 4, 1, 32, True),
    ("qwen3_moe", "small"): (256, 512, 4, 8, 2, 64, True),
}


def family_config(arch: str, preset: str, vocab: int, eos: int, bos: int) -> dict[str, Any]:
    """The preset's ``config.json`` (raises ``ValueError`` naming ``--preset`` when the family lacks it)."""
    presets = ("tiny", "small", "0.6b") if arch in ("glm_moe_dsa", "deepseek_v32") else ("tiny", "small")
    if preset not in presets:
        raise ValueError(f"--preset: {arch} has the presets {', '.join(presets)}, not {preset!r}")
    architecture, model_type = FAMILIES[arch]
    if preset != "0.6b":  # 0.6b keeps Qwen3's 151,936 embedding rows
        vocab += 7  # an embedding whose row count is not a multiple of 64 (ids past the tokenizer decode to nothing)
    common: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": vocab,
        "hidden_act": "silu",
        "max_position_embeddings": 40960 if preset == "0.6b" else 4096,
        "rms_norm_eps": 1e-6,
        "attention_dropout": 0.0,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "initializer_range": 0.02,
        "dtype": "float32",
        "use_cache": True,
    }
    if arch == "glm_moe_dsa":
        return common | _glm_moe_dsa(preset)
    if arch == "deepseek_v32":  # the same attention, every layer its own indexer, DeepSeek's yarn rope
        cfg = common | _glm_moe_dsa(preset)
        del cfg["indexer_types"]
        factor = 4.0
        cfg["rope_parameters"] = {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": factor,
            "original_max_position_embeddings": 1024,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        }
        return cfg
    if arch in ("qwen3_5", "granite_hybrid_moe"):
        return common | (_qwen3_5(preset) if arch == "qwen3_5" else _granite_moe(preset))
    hidden, inter, layers, heads, kv, head_dim, tied = _DENSE[(arch, preset)]
    cfg = common | {
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": head_dim,
        "tie_word_embeddings": tied,
        "rope_theta": 10000.0,
    }
    if arch == "qwen2":
        cfg |= {"use_sliding_window": False, "sliding_window": 4096, "max_window_layers": layers}
        if preset == "small":  # Qwen2.5's long-context recipe: YaRN over a 1K original window
            cfg["rope_scaling"] = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}
    elif arch == "mistral":
        cfg["sliding_window"] = 4096  # the whole context: full attention is exact
    elif arch == "llama3":  # Llama 3.x's frequency-dependent rope scaling
        cfg |= {"attention_bias": False, "mlp_bias": False, "rope_theta": 500000.0}
        cfg["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 1024,
        }
    elif arch == "qwen3_moe":
        experts, topk = (8, 2) if preset == "tiny" else (16, 4)
        cfg |= {
            "num_experts": experts,
            "num_experts_per_tok": topk,
            "moe_intermediate_size": inter // 2,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [0],
            "norm_topk_prob": True,
            "attention_bias": False,
        }
    return cfg


def _qwen3_5(preset: str) -> dict[str, Any]:
    hidden, heads, kv, head_dim, hk, hv, dk, layers = (
        (64, 4, 2, 16, 2, 4, 16, 4) if preset == "tiny" else (256, 8, 2, 64, 4, 8, 32, 8)
    )
    return {
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": head_dim,
        "linear_num_key_heads": hk,
        "linear_num_value_heads": hv,
        "linear_key_head_dim": dk,
        "linear_value_head_dim": dk,
        "linear_conv_kernel_dim": 4,
        "layer_types": ["linear_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)],
        "tie_word_embeddings": False,
        "attention_bias": False,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [2, 1, 1] if preset == "tiny" else [4, 2, 2],
            "mrope_interleaved": True,
        },
    }


def _granite_moe(preset: str) -> dict[str, Any]:
    hidden, layers, heads, kv, mheads, state, experts, topk = (
        (64, 4, 4, 2, 8, 16, 4, 2) if preset == "tiny" else (256, 8, 8, 4, 16, 32, 8, 2)
    )
    kinds = ["mamba", "attention", "mamba", "mamba"] * (layers // 4)
    return {
        "hidden_size": hidden,
        "intermediate_size": hidden // 2,  # each expert's
        "shared_intermediate_size": 2 * hidden,
        "num_hidden_layers": layers,
        "layer_types": kinds,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "num_local_experts": experts,
        "num_experts_per_tok": topk,
        "mamba_n_heads": mheads,
        "mamba_d_state": state,
        "mamba_n_groups": 2,
        "mamba_d_head": 2 * hidden // mheads,
        "mamba_d_conv": 4,
        "mamba_expand": 2,
        "mamba_chunk_size": 64,
        "mamba_conv_bias": True,
        "mamba_proj_bias": False,
        "position_embedding_type": "rope",
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "embedding_multiplier": 2.0,
        "residual_multiplier": 0.5,
        "attention_multiplier": 0.25,
        "logits_scaling": 2.0,
        "tie_word_embeddings": True,
        "attention_bias": False,
    }


def _glm_moe_dsa(preset: str) -> dict[str, Any]:
    """GLM-5's shape in miniature: latent attention, an indexer whose ``index_topk`` prunes at the lengths
    tests use (8 of a few dozen keys; 32 in small), a shared-selection layer, a dense first MLP, then
    group-limited routed experts beside a shared one, and an MTP layer after the stack. ``0.6b``: GLM-5's
    attention dimensions (latent 512, rotary 64, nope 192, values 256, an indexer of 32 heads of 128
    choosing 2,048 keys) over 12 layers of a 1,024-wide model with 16 experts (4 per token), about 0.7B
    parameters (311M of them the 151,936-row embedding and head) plus the MTP layer (with its own copies of
    both, as GLM-5's: read only by MTP speculation), for GPU figures beside the dense 0.6B models."""
    shapes = {  # hidden, layers, heads, lora, nope, rope, v, index heads, index dim, topk, experts, groups
        "tiny": (64, 3, 4, 32, 16, 16, 16, 8, 32, 8, 8, 2),
        "small": (256, 4, 8, 128, 32, 32, 32, 8, 64, 32, 16, 4),
        "0.6b": (1024, 12, 16, 512, 192, 64, 256, 32, 128, 2048, 16, 4),
    }
    hidden, layers, heads, lora, nope, rope, v, ih, idim, topk, experts, groups = shapes[preset]
    return {
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "moe_intermediate_size": hidden // 2,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "q_lora_rank": lora,
        "kv_lora_rank": lora,
        "qk_nope_head_dim": nope,
        "qk_rope_head_dim": rope,
        "v_head_dim": v,
        "head_dim": rope,
        "index_n_heads": ih,
        "index_head_dim": idim,
        "index_topk": topk,
        "indexer_types": ["shared" if i % 2 else "full" for i in range(layers)],
        "first_k_dense_replace": 1,
        "n_routed_experts": experts,
        "num_experts_per_tok": 4 if preset == "0.6b" else 2,
        "n_group": groups,
        "topk_group": groups // 2,
        "n_shared_experts": 1,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "num_nextn_predict_layers": 1,  # an MTP layer after the stack, as GLM-5's checkpoints carry
    }
