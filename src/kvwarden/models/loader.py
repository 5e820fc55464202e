"""Load a model and its tokenizer from a Hugging Face directory or a GGUF file.

Tensors are read one at a time as the model's construction asks for them (``models/weight_source.py``),
moved to the device, and the host copy dropped; an FP8 block-quantized tensor is dequantized on the device
(``models/quant.py``), or kept FP8 where the backend's GEMMs dequantize it per tile (``Ops.block_fp8``).
Before the first byte is read, the weights' size on the device is checked against what the device has.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvwarden.config import EngineConfig
from kvwarden.layers.numerics import Ops
from kvwarden.models.config import ModelConfig
from kvwarden.models.decoder import DecoderModel
from kvwarden.models.gguf_reader import gguf_tokenizer, read_gguf
from kvwarden.models.load_plan import LoadProgress, check_fits, planned_bytes
from kvwarden.models.quant import FP8, SCALE_SUFFIX, BlockFp8, dequantize, keeps_fp8, scale_shape
from kvwarden.models.tensor_shard import TensorShard, local_config, shard_getter
from kvwarden.models.tensor_shard import unsupported as unsupported_shard
from kvwarden.models.tokenizer import Tokenizer
from kvwarden.models.weight_source import TensorDict, WeightSource, open_source

__all__ = ["TORCH_DTYPES", "LoadedModel", "gguf_tokenizer", "is_mtp_tensor", "load", "load_for", "unread"]

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    config: ModelConfig
    model: DecoderModel
    tokenizer: Tokenizer
    source: str
    mtp_weights: dict[str, torch.Tensor]
    num_parameters: int = 0  # every tensor of the checkpoint, MTP head included
    load_seconds: float = 0.0
    load_bytes: int = 0  # bytes read from the source (as stored: FP8 weights one byte each)


def load(
    path: str | Path,
    dtype: str,
    ops: Ops,
    max_model_len: int | None = None,
    load_format: str = "auto",
    seed: int = 0,
    gpu_memory_utilization: float = 0.9,
    progress: bool | None = None,
    shard: TensorShard | None = None,
) -> LoadedModel:
    """Load weights, config and tokenizer.

    Args:
        path: a Hugging Face model directory or a ``.gguf`` file.
        dtype: ``"float32"`` or ``"bfloat16"`` (weights are converted on load).
        ops: the numerics every layer computes with.
        max_model_len: cap on positions (defaults to ``max_position_embeddings``).
        load_format: ``auto`` (the folder's safetensors) or ``dummy`` (seeded random weights of the config's
            shapes, drawn on the device: ``config.json`` and a tokenizer are all the folder needs).
        seed: the dummy weights' seed.
        gpu_memory_utilization: the share of a GPU's memory the weights may take (checked before loading).
        progress: a progress bar with GB/s on stderr (``None``: when stderr is a terminal).
        shard: a tensor-parallel rank's place: its slices of the weights, its share of the heads.

    Raises:
        ValueError: naming the tensor, the field or the shortfall, for a checkpoint kvwarden would misread
            or a model that does not fit the device.
    """
    path = Path(path)
    torch_dtype = TORCH_DTYPES[dtype]
    if path.suffix == ".gguf":
        if load_format == "dummy":
            raise ValueError("load_format: 'dummy' needs a Hugging Face folder (config.json), not a .gguf file")
        cfg, tensors, tokenizer = read_gguf(path)
        source: WeightSource = TensorDict(tensors)
    else:
        cfg = ModelConfig.from_dir(path)
        source = open_source(path, cfg, load_format, seed, torch_dtype)
        _check_shapes(cfg, source)
        tokenizer = Tokenizer.from_dir(path, _generation_eos(path) or cfg.eos_token_ids)
    if tokenizer.vocab_size > cfg.vocab_size:
        raise ValueError(
            f"tokenizer: {tokenizer.vocab_size} tokens, but the model's embedding has {cfg.vocab_size} rows "
            "(vocab_size): ids past the embedding would crash a request; the tokenizer does not belong to this model"
        )
    shard = shard or TensorShard()
    why = unsupported_shard(cfg, shard.world, shard.expert_parallel)
    if why is not None:
        raise ValueError(why)
    names = source.names()
    _check_fp8(cfg, source)
    device_names = [n for n in names if not is_mtp_tensor(cfg, n)]
    check_fits(planned_bytes(source, device_names, torch_dtype, ops.block_fp8), ops.device, gpu_memory_utilization)
    meter = LoadProgress(sum(_stored_bytes(source, n) for n in names), str(path), progress)
    get = _getter(cfg, source, ops, torch_dtype, meter)
    max_positions = min(max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
    model = DecoderModel(local_config(cfg, shard), shard_getter(get, cfg, shard), ops, max_positions, shard)
    others = _other_ranks_experts(cfg, shard)
    _refuse_unused(cfg, [n for n in names if not others(n)], get.asked)  # type: ignore[attr-defined]
    mtp = _mtp_weights(cfg, source, torch_dtype, meter)  # kept on the host for speculative decoding
    meter.close()
    return LoadedModel(
        config=cfg,
        model=model,
        tokenizer=tokenizer,
        source=str(path),
        mtp_weights=mtp,
        num_parameters=sum(_count(source.shape(n)) for n in names if not n.endswith(SCALE_SUFFIX)),
        load_seconds=meter.seconds,
        load_bytes=meter.done,
    )


def load_for(config: EngineConfig, ops: Ops, shard: TensorShard | None = None) -> LoadedModel:
    """:func:`load` as an engine's configuration asks for it (``shard``: a tensor-parallel rank's; rank 0's
    by default)."""
    from kvwarden.models.sources import resolve_model

    par = config.parallel
    shard = shard or TensorShard(0, par.tensor_parallel_size, par.enable_expert_parallel)
    return load(
        resolve_model(config.model), config.dtype, ops, config.max_model_len, load_format=config.load_format,
        seed=config.seed, gpu_memory_utilization=config.cache.gpu_memory_utilization, shard=shard,
    )  # fmt: skip


def _other_ranks_experts(cfg: ModelConfig, shard: TensorShard) -> Any:
    """Whether a tensor belongs to an expert another rank holds (expert parallelism: never read here)."""
    if not shard.active or cfg.moe is None:
        return lambda name: False
    mine = shard.owned_experts(cfg.moe.num_experts)

    def other(name: str) -> bool:
        if ".experts." not in name:
            return False
        expert = name.split(".experts.", 1)[1].split(".", 1)[0]
        return expert.isdigit() and int(expert) not in mine

    return other


def _count(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _stored_bytes(source: WeightSource, name: str) -> int:
    return _count(source.shape(name)) * torch.empty((), dtype=source.dtype(name)).element_size()


def _scale_name(name: str) -> str | None:
    return name.removesuffix("weight") + SCALE_SUFFIX if name.endswith(".weight") else None


def _check_fp8(cfg: ModelConfig, source: WeightSource) -> None:
    """FP8 tensors only with a quantization_config, each with its block scales of the right shape."""
    present = set(source.names())
    for name in source.names():
        if source.dtype(name) not in (FP8, torch.float8_e5m2):
            continue
        if source.dtype(name) != FP8:
            raise ValueError(f"checkpoint: tensor {name!r} is {source.dtype(name)}; kvwarden reads float8_e4m3fn")
        quant = cfg.quantization
        if quant is None:
            raise ValueError(f"checkpoint: tensor {name!r} is FP8 but config.json has no quantization_config")
        scale = _scale_name(name)
        if scale is None or scale not in present:
            raise ValueError(f"checkpoint: FP8 tensor {name!r} has no {scale or SCALE_SUFFIX!r} beside it")
        if not quant.converts(name):
            raise ValueError(
                f"checkpoint: tensor {name!r} is FP8, but quantization_config.modules_to_not_convert names its module"
            )
        want = scale_shape(source.shape(name), quant.block)
        if source.shape(scale) != want:
            raise ValueError(
                f"checkpoint: {scale!r} has shape {source.shape(scale)}, but weight_block_size "
                f"{list(quant.block)} over {source.shape(name)} needs {want}"
            )


def _getter(cfg: ModelConfig, source: WeightSource, ops: Ops, torch_dtype: torch.dtype, meter: LoadProgress):
    """``get(name)``: the tensor on the device in the model's dtype, ``None`` when absent; remembers what
    was asked (the rest is refused) and counts what it read."""
    present = set(source.names())
    asked: set[str] = set()
    fp32 = cfg.fp32_weights

    def read(name: str) -> torch.Tensor:
        t = source.read(name, ops.device)
        meter.advance(t.numel() * t.element_size())
        return t

    def get(name: str) -> torch.Tensor | BlockFp8 | None:
        asked.add(name)
        if name not in present:
            return None
        scale_name = _scale_name(name)
        if source.dtype(name) == FP8 and scale_name is not None and cfg.quantization is not None:
            asked.add(scale_name)
            q, scale = read(name).to(ops.device), read(scale_name).to(ops.device, torch.float32)
            block = cfg.quantization.block
            if ops.block_fp8 and keeps_fp8(name):  # the GEMMs dequantize per tile (models/quant.py)
                return BlockFp8(q, scale, block, torch_dtype)
            want = torch.float32 if name.endswith(fp32) else torch_dtype
            return dequantize(q, scale, block, want).contiguous()
        t = read(name)
        # as transformers keeps them: a float32 tensor of these stays float32 in a bfloat16 model
        want = torch.float32 if name.endswith(fp32) and t.dtype == torch.float32 else torch_dtype
        return t.to(ops.device).to(want).contiguous()

    get.asked = asked  # type: ignore[attr-defined]
    return get


def _mtp_weights(
    cfg: ModelConfig, source: WeightSource, torch_dtype: torch.dtype, meter: LoadProgress
) -> dict[str, torch.Tensor]:
    """The MTP head's tensors on the host (dequantized when FP8), for speculative decoding to load."""
    out: dict[str, torch.Tensor] = {}
    cpu = torch.device("cpu")
    for name in sorted(n for n in source.names() if is_mtp_tensor(cfg, n) and not n.endswith(SCALE_SUFFIX)):
        t = source.read(name, cpu).to(cpu)
        meter.advance(t.numel() * t.element_size())
        scale = _scale_name(name)
        if t.dtype == FP8 and scale is not None and cfg.quantization is not None:
            s = source.read(scale, cpu).to(cpu)
            t = dequantize(t, s, cfg.quantization.block, torch_dtype)
        out[name] = t
    return out


def _check_shapes(cfg: ModelConfig, source: WeightSource) -> None:
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
    present = set(source.names())
    for name, shape in expected.items():
        if name in present and source.shape(name) != shape:
            raise ValueError(
                f"checkpoint: tensor {name!r} has shape {source.shape(name)}, but config.json implies {shape}"
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


def _refuse_unused(cfg: ModelConfig, names: list[str], asked: set[str]) -> None:
    """A checkpoint tensor the model never asked for would be ignored (a vision tower, a bias the family does
    not have, a layer past ``num_hidden_layers``): refuse it, naming it, rather than serve without it."""
    # the MTP head: loaded when speculation asks for it
    unused = [k for k in unread(names, asked) if not is_mtp_tensor(cfg, k)]
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
