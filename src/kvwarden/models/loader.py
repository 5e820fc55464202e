"""Load a model and its tokenizer from a Hugging Face directory or a GGUF file."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from kvwarden.layers.numerics import Ops
from kvwarden.models.config import ModelConfig
from kvwarden.models.decoder import DecoderModel
from kvwarden.models.tokenizer import Tokenizer

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class LoadedModel:
    config: ModelConfig
    model: DecoderModel
    tokenizer: Tokenizer
    source: str
    mtp_weights: dict[str, torch.Tensor]
    num_parameters: int = 0  # every tensor of the checkpoint, MTP head included


def load(path: str | Path, dtype: str, ops: Ops, max_model_len: int | None = None) -> LoadedModel:
    """Load weights, config and tokenizer.

    Args:
        path: a Hugging Face model directory or a ``.gguf`` file.
        dtype: ``"float32"`` or ``"bfloat16"`` (weights are converted on load).
        ops: the numerics every layer computes with.
        max_model_len: cap on positions (defaults to ``max_position_embeddings``).
    """
    path = Path(path)
    if path.suffix == ".gguf":
        cfg, tensors, tokenizer = _read_gguf(path)
    else:
        cfg = ModelConfig.from_dir(path)
        tensors = _read_safetensors(path)
        _check_shapes(cfg, tensors)
        tokenizer = Tokenizer.from_dir(path, _generation_eos(path) or cfg.eos_token_ids)
    if tokenizer.vocab_size > cfg.vocab_size:
        raise ValueError(
            f"tokenizer: {tokenizer.vocab_size} tokens, but the model's embedding has {cfg.vocab_size} rows "
            "(vocab_size): ids past the embedding would crash a request; the tokenizer does not belong to this model"
        )
    torch_dtype = TORCH_DTYPES[dtype]

    asked: set[str] = set()

    fp32 = cfg.fp32_weights

    def get(name: str) -> torch.Tensor | None:
        asked.add(name)
        t = tensors.get(name)
        if t is None:
            return None
        # as transformers keeps them: a float32 tensor of these stays float32 in a bfloat16 model
        want = torch.float32 if name.endswith(fp32) and t.dtype == torch.float32 else torch_dtype
        return t.to(want).contiguous().to(ops.device)

    max_positions = min(max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
    model = DecoderModel(cfg, get, ops, max_positions)
    _refuse_unused(cfg, tensors, asked)
    mtp = {k: tensors[k] for k in sorted(tensors) if is_mtp_tensor(cfg, k)}  # kept for speculative decoding
    return LoadedModel(
        config=cfg,
        model=model,
        tokenizer=tokenizer,
        source=str(path),
        mtp_weights=mtp,
        num_parameters=sum(t.numel() for t in tensors.values()),
    )


PICKLE_CHECKPOINTS = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt", "consolidated.00.pth")


def _read_safetensors(model_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a (possibly sharded) safetensors checkpoint.

    Raises:
        ValueError: a pickle checkpoint only (refused: unpickling runs arbitrary code), or a
            safetensors file that cannot be read, naming the file and, where known, the tensor.
    """
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    if not (model_dir / files[0]).is_file():
        pickled = [p for p in PICKLE_CHECKPOINTS if (model_dir / p).is_file()]
        if pickled:
            raise ValueError(
                f"{model_dir / pickled[0]}: pickle checkpoints are refused (loading one runs arbitrary code); "
                "convert it to safetensors first (transformers: model.save_pretrained(dir, safe_serialization=True))"
            )
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        file = model_dir / name
        if not file.is_file():
            raise FileNotFoundError(f"{file}: missing weights file")
        try:
            handle = safe_open(str(file), framework="pt")
        except Exception as exc:  # safetensors raises its own error type for a bad header
            raise ValueError(f"{file}: not a readable safetensors file ({exc})") from exc
        with handle as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                try:
                    tensors[key] = f.get_tensor(key)
                except Exception as exc:  # a truncated file fails on the tensors past its end
                    raise ValueError(f"{file}: tensor {key!r} cannot be read ({exc}); is the file truncated?") from exc
    return tensors


def _check_shapes(cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> None:
    """Refuse a checkpoint whose tensors do not have the shapes ``config.json`` implies, naming the tensor."""
    h, d = cfg.hidden_size, cfg.head_dim
    q_rows = cfg.num_attention_heads * d * (2 if cfg.attn_output_gate else 1)
    expected = {
        "model.embed_tokens.weight": (cfg.vocab_size, h),
        "lm_head.weight": (cfg.vocab_size, h),
        "model.norm.weight": (h,),
    }
    for i in cfg.attention_layers:
        p = f"model.layers.{i}.self_attn"
        expected |= {
            f"{p}.q_proj.weight": (q_rows, h),
            f"{p}.k_proj.weight": (cfg.num_key_value_heads * d, h),
            f"{p}.v_proj.weight": (cfg.num_key_value_heads * d, h),
            f"{p}.o_proj.weight": (h, cfg.num_attention_heads * d),
        }
    if cfg.mla is not None:
        expected |= _mla_shapes(cfg)
    for i in range(cfg.num_hidden_layers):
        for norm in ("input_layernorm", "post_attention_layernorm"):
            expected[f"model.layers.{i}.{norm}.weight"] = (h,)
    for name, shape in expected.items():
        tensor = tensors.get(name)
        if tensor is not None and tuple(tensor.shape) != shape:
            raise ValueError(
                f"checkpoint: tensor {name!r} has shape {tuple(tensor.shape)}, but config.json implies {shape}"
            )


def _mla_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """GLM-5's attention and indexer tensors as ``config.json`` sizes them."""
    m, h, heads = cfg.mla, cfg.hidden_size, cfg.num_attention_heads
    assert m is not None
    out: dict[str, tuple[int, ...]] = {}
    for i in cfg.attention_layers:
        p = f"model.layers.{i}.self_attn"
        out |= {
            f"{p}.q_a_proj.weight": (m.q_lora_rank, h),
            f"{p}.q_b_proj.weight": (heads * (m.qk_nope_head_dim + m.qk_rope_head_dim), m.q_lora_rank),
            f"{p}.kv_a_proj_with_mqa.weight": (m.latent_dim, h),
            f"{p}.kv_b_proj.weight": (heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank),
            f"{p}.o_proj.weight": (h, heads * m.v_head_dim),
            f"{p}.indexer.wq_b.weight": (m.index_n_heads * m.index_head_dim, m.q_lora_rank),
            f"{p}.indexer.wk.weight": (m.index_head_dim, h),
            f"{p}.indexer.weights_proj.weight": (m.index_n_heads, h),
        }
    return out


def is_mtp_tensor(cfg: ModelConfig, name: str) -> bool:
    """A tensor of the multi-token-prediction head: Qwen3-Next's ``mtp.*``, or the layer DeepSeek-style
    checkpoints (GLM-5, DeepSeek-V3.2) store after the stack (``model.layers.<num_hidden_layers>.*``, when
    ``num_nextn_predict_layers`` announces it)."""
    return name.startswith("mtp.") or (cfg.mtp_layers > 0 and name.startswith(f"model.layers.{cfg.num_hidden_layers}."))


def unread(names: Iterable[str], asked: set[str]) -> list[str]:
    """The checkpoint tensors (sorted) that a model's construction never asked for, rotary tables aside
    (recomputed from the config, never read)."""
    return sorted(k for k in names if k not in asked and "rotary_emb" not in k)


def _refuse_unused(cfg: ModelConfig, tensors: dict[str, torch.Tensor], asked: set[str]) -> None:
    """A checkpoint tensor the model never asked for would be ignored (a vision tower, a bias the family does
    not have, a layer past ``num_hidden_layers``): refuse it, naming it, rather than serve without it."""
    # the MTP head: loaded when speculation asks for it
    unused = [k for k in unread(tensors, asked) if not is_mtp_tensor(cfg, k)]
    if unused:
        more = f" and {len(unused) - 1} more" if len(unused) > 1 else ""
        raise ValueError(
            f"checkpoint: tensor {unused[0]!r}{more} is not used by {cfg.architecture} as config.json describes it; "
            "kvwarden refuses to serve a checkpoint it would partly ignore"
        )


def _generation_eos(model_dir: Path) -> tuple[int, ...]:
    file = model_dir / "generation_config.json"
    if not file.is_file():
        return ()
    eos = json.loads(file.read_text()).get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


_GGUF_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def gguf_tokenizer(path: Path) -> Tokenizer:
    """Only the tokenizer of a GGUF file (no tensors are read)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    return Tokenizer.from_gguf_fields({name: field.contents() for name, field in reader.fields.items()})


def _read_gguf(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer]:
    """Dequantize a llama-architecture GGUF into Hugging Face-named float32 tensors."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(path))
    fields = {name: field.contents() for name, field in reader.fields.items()}
    arch = fields.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"{path}: gguf architecture {arch!r} is not supported (llama only)")
    heads = int(fields["llama.attention.head_count"])
    kv_heads = int(fields.get("llama.attention.head_count_kv", heads))
    tokenizer = Tokenizer.from_gguf_fields(fields)
    tensors: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        data = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32))
        name = t.name.removesuffix(".weight")
        if name == "token_embd":
            tensors["model.embed_tokens.weight"] = data
        elif name == "output_norm":
            tensors["model.norm.weight"] = data
        elif name == "output":
            tensors["lm_head.weight"] = data
        else:
            _, layer, kind = name.split(".", 2)
            if kind == "attn_q":
                data = _unpermute_rope(data, heads)
            elif kind == "attn_k":
                data = _unpermute_rope(data, kv_heads)
            tensors[f"model.layers.{layer}.{_GGUF_NAMES[kind]}.weight"] = data
    hidden = int(fields["llama.embedding_length"])
    cfg = ModelConfig.from_dict(
        {
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": int(tensors["model.embed_tokens.weight"].shape[0]),
            "hidden_size": hidden,
            "intermediate_size": int(fields["llama.feed_forward_length"]),
            "num_hidden_layers": int(fields["llama.block_count"]),
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "head_dim": int(fields.get("llama.rope.dimension_count", hidden // heads)),
            "rms_norm_eps": float(fields["llama.attention.layer_norm_rms_epsilon"]),
            "max_position_embeddings": int(fields["llama.context_length"]),
            "rope_theta": float(fields.get("llama.rope.freq_base", 10000.0)),
            "tie_word_embeddings": "lm_head.weight" not in tensors,
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": list(tokenizer.eos_token_ids),
        }
    )
    return cfg, tensors, tokenizer


def _unpermute_rope(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's interleaved-rope row permutation of q/k projections."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
