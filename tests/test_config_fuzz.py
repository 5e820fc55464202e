"""Config fuzzing: any valid transformers config either loads and agrees, or is refused at load by name.

For each supported architecture, hypothesis draws transformers configs across
the dimensions real checkpoints vary (head dims including odd and partial
rotary, GQA ratios, tied and untied embeddings, rope scaling types, linear
attention heads and dims, MoE on and off, layer type patterns, bias flags).
transformers writes a random checkpoint; kvwarden's real loader reads it. The
outcome must be one of two:

* it loads, and float32 logprobs agree with transformers at every prompt
  position under two chunk budgets (the bound of the agreement tests), greedy
  tokens included;
* ``LLM(...)`` raises ``ValueError`` naming a config field and its value.

Never a crash inside a request. Configs transformers itself cannot build or run
are not valid draws (rejected, not counted).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, reject, settings
from hypothesis import strategies as st

from kvwarden import LLM
from reference import assert_agrees, hybrid_init, save_random_checkpoint

# derandomize: the same draws on every run (CI must not depend on the day's luck; a new draw is a new test)
FUZZ = settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
ROPE = [
    None,
    {"rope_type": "linear", "factor": 2.0},
    {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 256},
    {"rope_type": "dynamic", "factor": 2.0},  # length-dependent: must be refused at load
]  # fmt: skip


@st.composite
def attention_fields(draw: st.DrawFn) -> dict[str, Any]:
    heads = draw(st.sampled_from([1, 2, 3, 4, 6]))  # GQA ratios 1 to 6, 3 and 6 included
    return {
        "vocab_size": draw(st.sampled_from([1024, 1031])),  # 1031: not a multiple of 64
        "hidden_size": draw(st.sampled_from([16, 24, 32, 48])),
        "num_attention_heads": heads,
        "num_key_value_heads": draw(st.sampled_from([k for k in (1, 2, 3) if heads % k == 0])),
        "max_position_embeddings": 1024,
        "tie_word_embeddings": draw(st.booleans()),
        "rope_theta": draw(st.sampled_from([10000.0, 1e6])),
        "rope_scaling": draw(st.sampled_from(ROPE)),
    }


@st.composite
def dense_configs(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    arch = draw(st.sampled_from(["llama", "qwen3", "qwen2", "mistral", "qwen3_moe"]))
    fields = draw(attention_fields())
    fields |= {
        "intermediate_size": draw(st.sampled_from([16, 40, 64])),
        "num_hidden_layers": draw(st.integers(1, 3)),
        "head_dim": draw(st.sampled_from([None, 6, 8, 9, 12, 16])),  # 9: odd, must be refused
        "attention_bias": draw(st.booleans()),
    }
    if fields["head_dim"] is None:
        fields.pop("head_dim")
    if arch == "llama":
        fields["mlp_bias"] = draw(st.booleans())
    elif arch == "mistral":  # a window below max_model_len: served up to the window (exact), never past it
        fields["sliding_window"] = draw(st.sampled_from([None, 4096, 64]))
    elif arch == "qwen2":
        fields |= {"use_sliding_window": draw(st.booleans()), "sliding_window": 64}
        fields["max_window_layers"] = draw(st.integers(0, fields["num_hidden_layers"]))
    elif arch == "qwen3_moe":
        experts = draw(st.sampled_from([2, 4]))
        fields |= {
            "num_experts": experts,
            "num_experts_per_tok": draw(st.integers(1, experts)),
            "moe_intermediate_size": 24,
            "decoder_sparse_step": draw(st.sampled_from([1, 2])),
            "norm_topk_prob": draw(st.booleans()),
            "mlp_only_layers": sorted(draw(st.sets(st.integers(0, fields["num_hidden_layers"] - 1), max_size=1))),
        }
    return arch, fields


@st.composite
def qwen3_next_configs(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    fields = draw(attention_fields())
    layers = draw(st.integers(2, 4))
    experts = draw(st.sampled_from([0, 2, 4]))
    key_heads = draw(st.sampled_from([1, 2]))
    fields |= {
        "intermediate_size": 48,
        "num_hidden_layers": layers,
        "head_dim": draw(st.sampled_from([8, 12, 16, 20])),
        "partial_rotary_factor": draw(st.sampled_from([0.25, 0.5, 1.0])),  # head 20 x 0.25: 5 rotary dims
        "linear_num_key_heads": key_heads,
        "linear_num_value_heads": key_heads * draw(st.sampled_from([1, 2])),
        "linear_key_head_dim": draw(st.sampled_from([8, 16])),
        "linear_value_head_dim": draw(st.sampled_from([8, 12, 16])),
        "linear_conv_kernel_dim": draw(st.sampled_from([2, 3, 4])),
        "num_experts": experts,
        "num_experts_per_tok": draw(st.integers(1, max(1, experts))),
        "moe_intermediate_size": 24,
        "shared_expert_intermediate_size": draw(st.sampled_from([16, 32])),
        "norm_topk_prob": draw(st.booleans()),
        "full_attention_interval": draw(st.integers(1, 3)),
        "mlp_only_layers": sorted(draw(st.sets(st.integers(0, layers - 1), max_size=1))),
    }
    if fields["rope_scaling"] is not None:
        fields["rope_scaling"] = {**fields["rope_scaling"], "partial_rotary_factor": fields["partial_rotary_factor"]}
    if draw(st.booleans()):  # Qwen3.5's text model: separate projections, dense MLP
        for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
                    "norm_topk_prob", "mlp_only_layers", "decoder_sparse_step"):  # fmt: skip
            fields.pop(key, None)
        return "qwen3_5", fields
    return "qwen3_next", fields


@st.composite
def granite_configs(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    fields = draw(attention_fields())
    layers = draw(st.integers(2, 4))
    mamba_heads = draw(st.sampled_from([4, 8]))
    fields |= {
        "num_hidden_layers": layers,
        "shared_intermediate_size": 48,
        "num_local_experts": draw(st.sampled_from([0, 2, 4])),
        "num_experts_per_tok": draw(st.sampled_from([1, 2])),
        "intermediate_size": 24,
        "layer_types": draw(st.lists(st.sampled_from(["mamba", "attention"]), min_size=layers, max_size=layers)),
        "mamba_n_heads": mamba_heads,
        "mamba_d_state": draw(st.sampled_from([8, 16])),
        "mamba_n_groups": draw(st.sampled_from([g for g in (1, 2) if mamba_heads % g == 0])),
        "mamba_d_conv": draw(st.sampled_from([2, 4])),
        "mamba_expand": 2,
        "mamba_chunk_size": 16,
        "mamba_proj_bias": draw(st.booleans()),
        "mamba_conv_bias": draw(st.booleans()),
        "position_embedding_type": draw(st.sampled_from(["rope", "nope"])),
        "embedding_multiplier": draw(st.sampled_from([1.0, 3.0])),
        "residual_multiplier": draw(st.sampled_from([1.0, 0.4])),
        "logits_scaling": draw(st.sampled_from([1.0, 2.5])),
    }
    return "granite", fields


def _build(family: str, fields: dict[str, Any]) -> Any:
    import transformers

    cls = {
        "llama": "LlamaConfig",
        "qwen3": "Qwen3Config",
        "qwen2": "Qwen2Config",
        "mistral": "MistralConfig",
        "qwen3_moe": "Qwen3MoeConfig",
        "qwen3_next": "Qwen3NextConfig",
        "qwen3_5": "Qwen3_5TextConfig",
        "granite": "GraniteMoeHybridConfig",
    }
    return getattr(transformers, cls[family])(**fields)


def _check(tmp_path: Path, tokenizer_dir: Path, family: str, fields: dict[str, Any], tag: str) -> None:
    out = tmp_path / tag
    try:
        config = _build(family, fields)
        save_random_checkpoint(config, out, tokenizer_dir, hybrid_init)
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        with torch.no_grad():
            hf(torch.tensor([[5, 6, 7]]))
    except Exception:
        reject()
    names = set(json.loads((out / "config.json").read_text())) | set(fields)
    try:
        LLM(str(out), max_num_batched_tokens=512)
    except ValueError as exc:  # refused at load: the message must name the field
        assert any(name in str(exc) for name in names), f"refused without naming a config field: {exc}"
        return
    prompt = torch.randint(3, 1000, (37,), generator=torch.Generator().manual_seed(len(tag))).tolist()
    assert_agrees(out, prompt, budgets=(512, 7), logprobs=True, max_new=4)


@pytest.mark.parametrize("kind", ["dense", "qwen3_next", "granite"])
def test_random_configs_load_and_agree_or_are_refused_by_name(tmp_path: Path, llama_tiny: Path, kind: str) -> None:
    strategy = {"dense": dense_configs(), "qwen3_next": qwen3_next_configs(), "granite": granite_configs()}[kind]
    count = iter(range(10**6))

    @given(drawn=strategy)
    @FUZZ
    def run(drawn: tuple[str, dict[str, Any]]) -> None:
        family, fields = drawn
        _check(tmp_path, llama_tiny, family, fields, f"{kind}-{next(count)}")

    run()


def test_odd_partial_rotary_matches_transformers(tmp_path: Path, llama_tiny: Path) -> None:
    """head_dim 20 with partial_rotary_factor 0.25 (5 rotary dims) crashed the first request; transformers
    rotates 6 dimensions (its table has 2 * ceil(5 / 2) columns). Now it loads and agrees."""
    fields = {
        "vocab_size": 1024, "hidden_size": 48, "intermediate_size": 48, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 20, "partial_rotary_factor": 0.25,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
        "linear_value_head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 24,
        "shared_expert_intermediate_size": 32, "full_attention_interval": 2, "max_position_embeddings": 1024,
    }  # fmt: skip
    out = save_random_checkpoint(_build("qwen3_next", fields), tmp_path / "odd", llama_tiny, hybrid_init)
    llm = LLM(str(out))
    assert llm.engine.loaded.model.layers[1].mixer.rope.rotary_dim == 6
    prompt = torch.randint(3, 1000, (41,), generator=torch.Generator().manual_seed(9)).tolist()
    assert_agrees(out, prompt, budgets=(512, 7), logprobs=True, max_new=4)
