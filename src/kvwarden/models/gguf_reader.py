"""GGUF files (llama architecture): the tokenizer, and the tensors dequantized to float32 under Hugging Face
names (llama.cpp's interleaved rotary rows undone)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from kvwarden.models.config import ModelConfig
from kvwarden.models.tokenizer import Tokenizer

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


def read_gguf(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer]:
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
