"""Float32 logits agree with transformers' own implementation at every prompt position.

Checkpoints are written by transformers (``save_pretrained``) and by our
``make-model``; both are loaded by kvwarden's real loader.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from kvwarden import LLM
from reference import assert_agrees, save_random_checkpoint
from tolerance import assert_within, model_tolerance

BASE: dict[str, Any] = {
    "vocab_size": 1024,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
}

CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-gqa2-untied": ("llama", {}),
    "llama-mqa-tied": ("llama", {"num_key_value_heads": 1, "tie_word_embeddings": True}),
    "llama-headdim32": ("llama", {"head_dim": 32}),
    "llama-bias": ("llama", {"attention_bias": True, "mlp_bias": True}),
    "llama-rope-linear": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    "llama-rope-llama3": (
        "llama",
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
    ),
    "llama-rope-yarn": (
        "llama",
        {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}},
    ),
    "qwen3-gqa2-headdim32": ("qwen3", {"head_dim": 32}),
    "qwen3-mha-tied": ("qwen3", {"num_key_value_heads": 4, "head_dim": 16, "tie_word_embeddings": True}),
    "qwen3-gqa4-3layers": (
        "qwen3",
        {"num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 3},
    ),
}


def _init(name: str, p: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    # Larger than HF's default init so logits are far from uniform and the comparison is meaningful.
    if p.dim() > 1:
        return torch.randn(p.shape, generator=gen) * 0.2
    return 1.0 + torch.randn(p.shape, generator=gen) * 0.1


def _hf_checkpoint(tmp_path: Path, tokenizer_dir: Path, arch: str, overrides: dict[str, Any]) -> Path:
    from transformers import LlamaConfig, Qwen3Config

    cfg = (LlamaConfig if arch == "llama" else Qwen3Config)(**{**BASE, **overrides})
    return save_random_checkpoint(cfg, tmp_path / "ckpt", tokenizer_dir, _init)


def _compare(model_dir: Path, prompt: list[int]) -> None:
    assert_agrees(model_dir, prompt, budgets=(48,), logprobs=False, max_new=12)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_transformers_checkpoint_agrees(tmp_path: Path, llama_tiny: Path, name: str) -> None:
    arch, overrides = CONFIGS[name]
    model_dir = _hf_checkpoint(tmp_path, llama_tiny, arch, overrides)
    gen = torch.Generator().manual_seed(2)
    prompt = torch.randint(3, BASE["vocab_size"], (83,), generator=gen).tolist()
    _compare(model_dir, prompt)


def test_make_model_checkpoints_agree(dense_tiny: Path) -> None:
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, 1000, (70,), generator=gen).tolist()
    _compare(dense_tiny, prompt)


def test_bfloat16_loads_and_stays_close(llama_tiny: Path) -> None:
    gen = torch.Generator().manual_seed(4)
    prompt = torch.randint(3, 1000, (40,), generator=gen).tolist()
    f32 = LLM(str(llama_tiny)).score(prompt)
    llm = LLM(str(llama_tiny), dtype="bfloat16")
    assert llm.engine.loaded.model.dtype == torch.bfloat16
    bf16 = llm.score(prompt)
    # bfloat16 keeps 8 bits of mantissa: within the bound of its storage roundings (tests/tolerance.py). A
    # bfloat16 path that drops a scale or reads a wrong layout moves log-probabilities by several nats.
    lp32, lp16 = torch.log_softmax(f32, -1), torch.log_softmax(bf16.float(), -1)
    config = json.loads((llama_tiny / "config.json").read_text())
    tol = model_tolerance(config, f32.abs().max().item(), context=len(prompt), dtype=torch.bfloat16, log_softmax=True)
    assert_within(lp16, lp32, tol, "bfloat16 against float32")
