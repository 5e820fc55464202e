"""Float32 logits agree with transformers' own implementation at every prompt position.

Checkpoints are written by transformers (``save_pretrained``) and by our
``make-model``; both are loaded by kvwarden's real loader.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from kvwarden import LLM, SamplingParams

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


def _hf_checkpoint(tmp_path: Path, tokenizer_dir: Path, arch: str, overrides: dict[str, Any]) -> Path:
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    cfg = (LlamaConfig if arch == "llama" else Qwen3Config)(**{**BASE, **overrides})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        # Larger than HF's default init so logits are far from uniform and the
        # comparison is meaningful.
        for p in model.parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
            else:
                p.copy_(1.0 + torch.randn(p.shape, generator=gen) * 0.1)
    out = tmp_path / "ckpt"
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, out / name)
    return out


def _compare(model_dir: Path, prompt: list[int], max_new: int = 12) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        ref = hf(ids).logits[0].float()
    llm = LLM(str(model_dir), block_size=16, max_num_batched_tokens=48)
    ours = llm.score(prompt)
    assert ours.shape == ref.shape
    delta = (ours - ref).abs().max().item()
    assert delta <= 1e-4, f"max |logit delta| {delta}"
    with torch.no_grad():
        hf_greedy = hf.generate(ids, max_new_tokens=max_new, do_sample=False, eos_token_id=None)[0, len(prompt) :]
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True))[0]
    assert out.token_ids == hf_greedy.tolist()


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
    # bfloat16 keeps 8 bits of mantissa: agreement is loose but the distributions match.
    lp32, lp16 = torch.log_softmax(f32, -1), torch.log_softmax(bf16, -1)
    assert (lp32 - lp16).abs().max().item() < 0.5
    assert (lp32.argmax(-1) == lp16.argmax(-1)).float().mean().item() > 0.8
