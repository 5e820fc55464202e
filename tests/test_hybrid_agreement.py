"""Hybrid families agree with transformers in float32: every prompt position, greedy continuations.

Checkpoints come from transformers (``save_pretrained`` of random configs) and
from our ``make-model``; kvwarden loads both with its real loader.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvwarden import LLM
from kvwarden.models.make_model import make_model
from reference import assert_agrees, hybrid_init, save_random_checkpoint

QWEN3_NEXT_BASE: dict[str, Any] = {
    "vocab_size": 1024,
    "hidden_size": 48,
    "intermediate_size": 96,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 8,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 24,
    "shared_expert_intermediate_size": 32,
    "full_attention_interval": 2,
    "max_position_embeddings": 1024,
}
GRANITE_BASE: dict[str, Any] = {
    "vocab_size": 1024,
    "hidden_size": 48,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "shared_intermediate_size": 64,
    "num_local_experts": 0,
    "layer_types": ["mamba", "attention", "mamba", "attention"],
    "mamba_n_heads": 8,
    "mamba_d_state": 16,
    "mamba_n_groups": 1,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "mamba_chunk_size": 16,
    "max_position_embeddings": 1024,
}

CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3next-moe-interval2": ("qwen3_next", {}),
    "qwen3next-dense-interval4": (
        "qwen3_next",
        {"num_experts": 0, "full_attention_interval": 4, "num_hidden_layers": 4, "linear_num_value_heads": 2},
    ),
    "qwen3next-mlp-only-layer-and-norm-topk-off": ("qwen3_next", {"mlp_only_layers": [1], "norm_topk_prob": False}),
    "qwen3next-conv3-mqa": ("qwen3_next", {"linear_conv_kernel_dim": 3, "num_key_value_heads": 1}),
    "granite-rope-1group": ("granite", {"position_embedding_type": "rope"}),
    "granite-nope-2groups-multipliers": (
        "granite",
        {
            "mamba_n_groups": 2,
            "embedding_multiplier": 3.0,
            "residual_multiplier": 0.4,
            "attention_multiplier": 0.2,
            "logits_scaling": 2.5,
        },
    ),
    "granite-tied-bias": ("granite", {"tie_word_embeddings": True, "mamba_proj_bias": True, "mamba_conv_bias": False}),
}


def _checkpoint(tmp_path: Path, tokenizer_dir: Path, family: str, overrides: dict[str, Any]) -> Path:
    from transformers import GraniteMoeHybridConfig, Qwen3NextConfig

    if family == "qwen3_next":
        cfg = Qwen3NextConfig(**{**QWEN3_NEXT_BASE, **overrides})
    else:
        cfg = GraniteMoeHybridConfig(**{**GRANITE_BASE, **overrides})
    return save_random_checkpoint(cfg, tmp_path / "ckpt", tokenizer_dir, hybrid_init)


def _compare(model_dir: Path, prompt: list[int]) -> None:
    # 512: one chunk; 23: chunks that cut the scan grid mid-chunk
    assert_agrees(model_dir, prompt, budgets=(512, 23), logprobs=True)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_transformers_hybrid_checkpoint_agrees(tmp_path: Path, llama_tiny: Path, name: str) -> None:
    family, overrides = CONFIGS[name]
    model_dir = _checkpoint(tmp_path, llama_tiny, family, overrides)
    gen = torch.Generator().manual_seed(2)
    _compare(model_dir, torch.randint(3, 1000, (75,), generator=gen).tolist())


@pytest.mark.parametrize("arch", ["qwen3_next", "granite_hybrid"])
def test_make_model_hybrid_checkpoints_agree_and_are_reproducible(tmp_path: Path, arch: str) -> None:
    a = make_model(arch, "tiny", 3, tmp_path / "a")
    b = make_model(arch, "tiny", 3, tmp_path / "b")
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    gen = torch.Generator().manual_seed(4)
    _compare(a, torch.randint(3, 1000, (60,), generator=gen).tolist())


def test_qwen3_next_mtp_weights_are_loaded(tmp_path: Path) -> None:
    model_dir = make_model("qwen3_next", "tiny", 0, tmp_path / "q")
    llm = LLM(str(model_dir))
    mtp = llm.engine.loaded.mtp_weights
    assert "mtp.fc.weight" in mtp and any(k.startswith("mtp.layers.0.self_attn") for k in mtp)
    assert mtp["mtp.fc.weight"].shape == (64, 128)
