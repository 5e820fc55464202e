"""The families users bring: Qwen2 (QKV bias), Mistral, Llama 3.x rope scaling and YaRN, Qwen3-MoE, Qwen3.5's
text model, GraniteMoeHybrid with routed experts - each agreeing with transformers and keeping the invariance
properties; and what kvwarden refuses at load, naming the field.

The ``make-model`` presets of these families between them hold the head geometries of real checkpoints:
GQA ratios 3, 5, 6 and 7, head sizes 80 and 96, partial rotary, tied and untied embeddings, and embedding
tables whose row count is not a multiple of 64.
"""

from __future__ import annotations

import hashlib
import json
import random
from functools import partial
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import _made
from kvwarden import LLM, SamplingParams
from kvwarden.bench.properties import PROPERTIES, check_properties
from reference import assert_agrees, model_tol
from tolerance import assert_within

FAMILIES = ["qwen2", "mistral", "llama3", "qwen3_moe", "qwen3_5", "granite_hybrid_moe", "glm_moe_dsa", "deepseek_v32"]
LIKELY = -5.0


@pytest.fixture(scope="module", params=FAMILIES)
def family_tiny(request: pytest.FixtureRequest, models_root: Path) -> Path:
    return _made(models_root, request.param, "tiny")


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 1000) for _ in range(rng.randint(8, 40))] for _ in range(n)]


def test_family_agrees_with_transformers(family_tiny: Path) -> None:
    """float32: 8 prompts, 32 greedy tokens equal, top-20 logprobs on likely tokens within float32's rounding
    bound for the model's shape (``tests/tolerance.py``); every prompt position under two chunk budgets."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(family_tiny, dtype=torch.float32).eval()
    prompts = _prompts(8, 1)
    llm = LLM(str(family_tiny), block_size=16)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=32, logprobs=20, ignore_eos=True))
    for prompt, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([prompt]), max_new_tokens=32, do_sample=False, eos_token_id=None, output_logits=True,
                return_dict_in_generate=True,
            )  # fmt: skip
        assert out.token_ids == ref.sequences[0, len(prompt) :].tolist()
        for step, tops in zip(ref.logits, out.logprobs or [], strict=True):
            lp = torch.log_softmax(step[0].float(), -1)
            worst = max(abs(v - float(lp[t])) for t, v in tops if v >= LIKELY)
            assert worst <= model_tol(family_tiny, step[0], len(prompt) + 32), worst
    assert_agrees(family_tiny, prompts[0] + prompts[1], budgets=(512, 7), logprobs=True, max_new=4)


def test_family_keeps_every_invariance_property(family_tiny: Path) -> None:
    """(a)-(i) bitwise on the CPU's canonical numerics, seeded sampling."""
    rng = random.Random(2)
    prompt = [rng.randrange(3, 1000) for _ in range(37)]
    partners = _prompts(3, 3)
    make = partial(LLM, str(family_tiny), block_size=16, max_num_batched_tokens=64, num_blocks=64)
    params = SamplingParams(temperature=0.8, seed=5, max_tokens=4, logprobs=5, ignore_eos=True)
    report = check_properties(make, prompt, params, 16, partners)
    assert set(report.outcomes) == set(PROPERTIES)
    assert report.all_identical, report.failures()


@pytest.mark.parametrize("family", ["qwen2", "mistral", "llama3", "qwen3_moe", "glm_moe_dsa"])
def test_family_on_the_triton_kernels(family: str, models_root: Path) -> None:
    """The GPU kernels (under the interpreter) on GQA ratios 3 and 5, a head size of 80, routed experts and
    sparse attention (the indexer's scores, the rank-counting top-k, latent attention over the selection):
    agreement with transformers at every prompt position, and the cache properties bitwise."""
    model = _made(models_root, family, "tiny")
    prompt = _prompts(1, 4)[0]
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0].float()
    ref = torch.log_softmax(logits, -1)
    make = partial(LLM, str(model), device="cpu", kernels="triton", block_size=8, max_num_batched_tokens=64)
    ours = torch.log_softmax(make(num_blocks=64).score(prompt).float(), -1)
    assert_within(ours, ref, model_tol(model, logits, len(prompt)), f"{family} on the Triton kernels")
    rng = random.Random(5)
    long = [rng.randrange(3, 1000) for _ in range(21)]
    params = SamplingParams(temperature=0.0, max_tokens=3, logprobs=5, ignore_eos=True)
    report = check_properties(partial(make, num_blocks=64), long, params, 8, _prompts(3, 6), ("b", "e"))
    assert report.all_identical, report.failures()


@pytest.mark.parametrize("family", ["qwen2", "mistral", "llama3"])
def test_small_presets_agree(family: str, models_root: Path) -> None:
    """GQA 6 (Qwen2.5-1.5B's 12/2) with YaRN, GQA 7 (Qwen2.5-0.5B's 14/2), head size 96 with llama3 scaling."""
    model = _made(models_root, family, "small")
    cfg = json.loads((model / "config.json").read_text())
    assert cfg["num_attention_heads"] // cfg["num_key_value_heads"] in (6, 7, 2)
    assert_agrees(model, _prompts(1, 7)[0] * 3, budgets=(512, 9), logprobs=True, max_new=8)


def test_family_presets_are_reproducible(tmp_path: Path) -> None:
    from kvwarden.models.make_model import make_model

    digests = [
        hashlib.sha256((make_model("qwen3_moe", "tiny", 3, tmp_path / str(i)) / "model.safetensors").read_bytes())
        for i in range(2)
    ]
    assert digests[0].hexdigest() == digests[1].hexdigest()


# ------------------------------------------------------------------------------------- refused at load
def _copy(src: Path, dst: Path, edit: dict | None = None) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    if edit is not None:
        cfg = json.loads((dst / "config.json").read_text())
        cfg.update(edit)
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_an_unknown_architecture_is_refused_listing_the_supported_ones(tmp_path: Path, llama_tiny: Path) -> None:
    model = _copy(llama_tiny, tmp_path / "m", {"architectures": ["PhiForCausalLM"], "model_type": "phi"})
    with pytest.raises(ValueError, match=r"architectures \['PhiForCausalLM'\].*Qwen2ForCausalLM.*Qwen3_5ForCausalLM"):
        LLM(str(model))


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_parameters": {"rope_type": "longrope", "factor": 2.0, "rope_theta": 1e4}}, "rope_type"),
    ],
)
def test_unsupported_features_are_refused_naming_the_field(
    tmp_path: Path, llama_tiny: Path, edit: dict, field: str
) -> None:
    with pytest.raises(ValueError, match=field):
        LLM(str(_copy(llama_tiny, tmp_path / "m", edit)))


def test_a_sliding_window_model_is_served_up_to_its_window(tmp_path: Path, models_root: Path) -> None:
    """Within the window full causal attention is the sliding one; past it kvwarden refuses, naming both."""
    model = _copy(_made(models_root, "mistral", "tiny"), tmp_path / "m", {"sliding_window": 48})
    llm = LLM(str(model), block_size=16)
    assert llm.engine.max_model_len == 48
    with pytest.raises(ValueError, match=r"max_model_len: 64 exceeds the model's sliding_window \(48\)"):
        LLM(str(model), max_model_len=64)
    prompt = _prompts(1, 8)[0][:30]
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0].float()
    ours = torch.log_softmax(llm.score(prompt).float(), -1)
    assert_within(ours, torch.log_softmax(logits, -1), model_tol(model, logits, len(prompt)), "sliding window")


@pytest.mark.parametrize(
    "extra", ["model.visual.patch_embed.weight", "model.layers.0.self_attn.o_proj.bias", "model.layers.9.mlp.x"]
)
def test_a_tensor_the_model_would_ignore_is_refused(tmp_path: Path, llama_tiny: Path, extra: str) -> None:
    """A vision tower, a bias the config does not announce (attention_bias false), a layer past
    num_hidden_layers: refused at load, naming the tensor, rather than served partly ignored."""
    model = _copy(llama_tiny, tmp_path / "m")
    weights = load_file(model / "model.safetensors")
    weights[extra] = torch.zeros(weights["model.norm.weight"].shape[0])
    save_file(weights, str(model / "model.safetensors"))
    with pytest.raises(ValueError, match=f"tensor '{extra}'"):
        LLM(str(model))
