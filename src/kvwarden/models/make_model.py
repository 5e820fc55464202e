"""``kvwarden make-model``: seeded random checkpoints in Hugging Face format.

The same (arch, preset, seed) always gives byte-identical files: weights come
from one seeded ``torch.Generator``, the tokenizer from a deterministic BPE
training run on text shipped in the package, JSON is written with sorted keys.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers, trainers

from kvwarden.models.bundled import corpus_text
from kvwarden.models.config import ModelConfig
from kvwarden.models.family_presets import FAMILIES, family_config
from kvwarden.models.make_hybrid import Init, granite_config, granite_weights, qwen3_next_config, qwen3_next_weights
from kvwarden.models.presets import ARCHS, PRESETS
from kvwarden.models.quant import SCALE_SUFFIX, quantize, stored_fp8
from kvwarden.models.random_weights import cut_layers, random_checkpoint

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# ChatML; with ``tools``, Hermes-style tool calling as Qwen2.5 / Qwen3 templates render it (the tools listed in
# a system turn, an assistant's calls as <tool_call> blocks, tool results as <tool_response> in a user turn).
# Without tools it renders exactly the plain ChatML it always did.
CHAT_TEMPLATE = (
    "{% if tools %}"
    "{{ '<|im_start|>system\\n' }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\\n\\n' }}{% endif %}"
    "{{ '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n'"
    " + 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}"
    "{{ '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments '"
    " + 'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n'"
    ' + \'{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n\' }}'
    "{% endif %}"
    "{% for message in messages %}"
    "{% if tools and loop.first and message['role'] == 'system' %}"
    "{% elif message['role'] == 'assistant' and message.get('tool_calls') %}"
    "{{ '<|im_start|>assistant\\n' + (message['content'] or '') }}"
    "{% for call in message['tool_calls'] %}"
    "{{ '\\n<tool_call>\\n{\\\"name\\\": ' }}{{ call['function']['name'] | tojson }}"
    "{{ ', \\\"arguments\\\": ' }}{{ call['function']['arguments'] | tojson }}{{ '}\\n</tool_call>' }}"
    "{% endfor %}"
    "{{ '<|im_end|>\\n' }}"
    "{% elif message['role'] == 'tool' %}"
    "{{ '<|im_start|>user\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>\\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@dataclass(frozen=True)
class Preset:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    tie_word_embeddings: bool


# Tiny presets run a whole test in milliseconds; small ones are the benchmark size.
# Qwen3 presets use a head_dim different from hidden/heads and tied embeddings,
# Llama presets untied embeddings, so the presets between them cover both cases.
VOCAB_SIZES = {"tiny": 1024, "small": 2048, "compat": 2048, "0.6b": 8192}  # the trained tokenizer
# The embedding of the 0.6b presets has Qwen3's 151,936 rows (the LM head's real cost on a GPU);
# ids past the tokenizer's vocabulary decode to nothing, as a real model's padding rows do.
EMBEDDING_ROWS = {"0.6b": 151936}
WEIGHT_DTYPES = {"0.6b": torch.bfloat16}  # as published checkpoints of that size ship

PRESET_TABLE: dict[tuple[str, str], Preset] = {
    ("llama", "tiny"): Preset(1024, 64, 128, 2, 4, 2, 16, 4096, False),
    ("llama", "small"): Preset(2048, 256, 768, 4, 8, 4, 32, 4096, False),
    ("qwen3", "tiny"): Preset(1024, 64, 128, 2, 4, 1, 32, 4096, True),
    ("qwen3", "small"): Preset(2048, 256, 768, 4, 8, 2, 64, 4096, True),
    ("qwen3", "0.6b"): Preset(151936, 1024, 3072, 28, 16, 8, 128, 40960, True),
    ("llama", "0.6b"): Preset(151936, 1024, 3072, 28, 16, 8, 128, 40960, False),
}


def train_tokenizer(vocab_size: int) -> Backend:
    """Byte-level BPE trained on the bundled corpus (deterministic)."""
    tok = Backend(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = corpus_text().splitlines(keepends=True)
    tok.train_from_iterator(lines, trainer=trainer, length=len(lines))
    return tok


def hf_config(arch: str, p: Preset, vocab_size: int, eos_id: int, bos_id: int) -> dict[str, Any]:
    """A ``config.json`` that both kvwarden and transformers load."""
    cfg: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM" if arch == "llama" else "Qwen3ForCausalLM"],
        "model_type": arch,
        "vocab_size": vocab_size,
        "hidden_size": p.hidden_size,
        "intermediate_size": p.intermediate_size,
        "num_hidden_layers": p.num_hidden_layers,
        "num_attention_heads": p.num_attention_heads,
        "num_key_value_heads": p.num_key_value_heads,
        "head_dim": p.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": p.max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "tie_word_embeddings": p.tie_word_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "initializer_range": 0.02,
        "dtype": "float32",
        "use_cache": True,
    }
    if arch == "llama":
        cfg["mlp_bias"] = False
        cfg["pretraining_tp"] = 1
    else:
        cfg["use_sliding_window"] = False
        cfg["sliding_window"] = None
        cfg["max_window_layers"] = p.num_hidden_layers
        cfg["layer_types"] = ["full_attention"] * p.num_hidden_layers
    return cfg


def random_weights(cfg: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """Seeded weights, scaled so activations stay O(1) and logits are peaked enough to read."""
    init = Init(seed)
    if cfg["model_type"] == "qwen3_next":
        return qwen3_next_weights(cfg, init)
    if cfg["model_type"] == "granitemoehybrid":
        return granite_weights(cfg, init)
    normal = init.normal
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads, kv_heads, head_dim = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]

    def norm_weight(n: int) -> torch.Tensor:
        return 1.0 + normal(n, std=0.1)

    w: dict[str, torch.Tensor] = {"model.embed_tokens.weight": normal(cfg["vocab_size"], hidden, std=1.0)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        w[f"{p}.input_layernorm.weight"] = norm_weight(hidden)
        w[f"{p}.post_attention_layernorm.weight"] = norm_weight(hidden)
        w[f"{p}.self_attn.q_proj.weight"] = normal(heads * head_dim, hidden, std=hidden**-0.5)
        w[f"{p}.self_attn.k_proj.weight"] = normal(kv_heads * head_dim, hidden, std=hidden**-0.5)
        w[f"{p}.self_attn.v_proj.weight"] = normal(kv_heads * head_dim, hidden, std=hidden**-0.5)
        w[f"{p}.self_attn.o_proj.weight"] = normal(hidden, heads * head_dim, std=(heads * head_dim) ** -0.5)
        if cfg["model_type"] == "qwen3":
            w[f"{p}.self_attn.q_norm.weight"] = norm_weight(head_dim)
            w[f"{p}.self_attn.k_norm.weight"] = norm_weight(head_dim)
        w[f"{p}.mlp.gate_proj.weight"] = normal(inter, hidden, std=hidden**-0.5)
        w[f"{p}.mlp.up_proj.weight"] = normal(inter, hidden, std=hidden**-0.5)
        w[f"{p}.mlp.down_proj.weight"] = normal(hidden, inter, std=inter**-0.5)
    w["model.norm.weight"] = norm_weight(hidden)
    if not cfg["tie_word_embeddings"]:
        w["lm_head.weight"] = normal(cfg["vocab_size"], hidden, std=2.0 * hidden**-0.5)
    return w


# What ``--fp8`` keeps in the checkpoint's dtype, as published FP8 checkpoints do: the LM head, routers and
# gates, and the small recurrent projections (their rows are not block-sized).
FP8_NOT_CONVERTED = ["lm_head", "mlp.gate", "shared_expert_gate", "in_proj_ba", "in_proj_b", "in_proj_a"]


def fp8_config(block: tuple[int, int] = (128, 128)) -> dict[str, Any]:
    """The ``quantization_config`` that ``--fp8`` writes (block-wise FP8, dynamic activations)."""
    return {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "weight_block_size": list(block),
        "modules_to_not_convert": FP8_NOT_CONVERTED,
    }


def quantize_weights(cfg: dict[str, Any], weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors an FP8 checkpoint of ``cfg`` stores in FP8 (its ``quantization_config`` converts their
    module) as ``float8_e4m3fn`` with a ``weight_scale_inv`` beside each; the rest unchanged."""
    quant = ModelConfig.from_dict(cfg).quantization
    if quant is None:
        return weights
    out: dict[str, torch.Tensor] = {}
    for name, w in weights.items():
        if stored_fp8(name, tuple(w.shape), quant):
            out[name], out[name.removesuffix("weight") + SCALE_SUFFIX] = quantize(w, quant.block)
        else:
            out[name] = w
    return out


def make_model(arch: str, preset: str, seed: int, out: str | Path, fp8_block: tuple[int, int] | None = None) -> Path:
    """Write a seeded random checkpoint to ``out`` and return the directory; ``fp8_block``: as an FP8
    block-quantized checkpoint with blocks of that shape.

    Raises:
        ValueError: unknown ``arch`` or ``preset``.
    """
    if arch not in ARCHS:
        raise ValueError(f"--arch: unknown architecture {arch!r}; expected one of {ARCHS}")
    if preset not in PRESETS:
        raise ValueError(f"--preset: unknown preset {preset!r}; expected one of {PRESETS}")
    tok = train_tokenizer(VOCAB_SIZES[preset])
    vocab = EMBEDDING_ROWS.get(preset, tok.get_vocab_size(with_added_tokens=True))
    eos = tok.token_to_id("<|im_end|>")
    bos = tok.token_to_id("<|endoftext|>")
    if arch == "qwen3_next":
        cfg = qwen3_next_config(preset, vocab, eos, bos)
    elif arch == "granite_hybrid":
        cfg = granite_config(preset, vocab, eos, bos)
    elif arch in FAMILIES:
        cfg = family_config(arch, preset, vocab, eos, bos)
    else:
        cfg = hf_config(arch, PRESET_TABLE[(arch, "small" if preset == "compat" else preset)], vocab, eos, bos)
    weights = random_checkpoint(cfg, seed, torch.float32) if arch in FAMILIES else random_weights(cfg, seed)
    if preset in WEIGHT_DTYPES:
        dtype = WEIGHT_DTYPES[preset]
        weights = {k: v.to(dtype) for k, v in weights.items()}
        cfg["dtype"] = str(dtype).removeprefix("torch.")
    if fp8_block is not None:
        cfg["quantization_config"] = fp8_config(fp8_block)
    return write_checkpoint(Path(out), cfg, quantize_weights(cfg, weights), tok)


def make_model_from_config(
    config: dict[str, Any], out: str | Path, seed: int = 0, num_layers: int | None = None, dtype: str = "float32"
) -> Path:
    """A seeded random checkpoint of a published ``config.json``'s shapes (its first ``num_layers`` layers);
    FP8 block-quantized where the config has an fp8 ``quantization_config``, as the published files are.

    The tokenizer is kvwarden's small trained one (its ids fit any real vocabulary); the config keeps the
    model's own vocabulary size and special-token ids, so the embedding and LM head have the real shapes.

    Raises:
        ValueError: the config names an architecture or feature kvwarden does not support.
    """
    cfg = cut_layers(config, num_layers) if num_layers else dict(config)
    cfg["dtype"] = dtype
    tok = train_tokenizer(VOCAB_SIZES["tiny"])
    weights = random_checkpoint(cfg, seed, getattr(torch, dtype))
    return write_checkpoint(Path(out), cfg, quantize_weights(cfg, weights), tok)


def write_checkpoint(out: Path, cfg: dict[str, Any], weights: dict[str, torch.Tensor], tok: Backend) -> Path:
    """config.json, model.safetensors, the tokenizer files and generation_config.json under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return write_config(out, cfg, tok)


def write_config(out: Path, cfg: dict[str, Any], tok: Backend) -> Path:
    """Everything but the weights: config.json, the tokenizer files and generation_config.json (all that
    ``load_format="dummy"`` needs)."""
    out.mkdir(parents=True, exist_ok=True)
    eos, bos = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")
    _write_json(out / "config.json", cfg)
    _write_json(out / "generation_config.json", {"bos_token_id": bos, "eos_token_id": [eos, bos]})
    (out / "tokenizer.json").write_text(tok.to_str(pretty=True), encoding="utf-8")
    _write_json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": "<|endoftext|>",
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "unk_token": None,
            "add_bos_token": False,
            "model_max_length": cfg["max_position_embeddings"],
            "chat_template": CHAT_TEMPLATE,
        },
    )
    return out


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")
