"""Seeded random weights for any ``config.json`` kvwarden supports, under the family's own tensor names.

The built-in presets of ``make-model`` keep their own writers
(:mod:`kvwarden.models.make_model`, :mod:`kvwarden.models.make_hybrid`); this
one serves every family from its parsed config, so a published model's
``config.json`` (cut to a few layers with :func:`cut_layers`) becomes a
checkpoint of that model's exact shapes that kvwarden and transformers both
load: ``kvwarden make-model --config FILE --num-layers N``.

Tensors are drawn one at a time and cast at once to the target dtype, so a
large shape (a 152K x 5,120 embedding) never needs a float32 copy of the whole
model. The same walk over the config also yields every tensor's :class:`WeightSpec`
alone (:func:`weight_specs`): ``load_format="dummy"`` draws each one on the
device when the model asks for it (``models/weight_source.py``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvwarden.models.config import ATTENTION, GATED_DELTANET, ModelConfig
from kvwarden.models.make_hybrid import Init

Draw = Callable[..., Any]


@dataclass(frozen=True)
class WeightSpec:
    """How one tensor is drawn: ``normal`` (``std`` times a standard normal, plus ``offset``),
    ``log_uniform`` (``log`` of a uniform draw in ``[low, high)``: a decay's ``A_log``), or ``copy`` of
    the tensor named ``source`` (the MTP layer's embedding and head)."""

    shape: tuple[int, ...]
    kind: str = "normal"
    std: float = 1.0
    offset: float = 0.0
    low: float = 0.0
    high: float = 1.0
    source: str = ""


class _Drawer:
    """Draws tensors in the walk's order from one seeded generator (the checkpoint writer)."""

    def __init__(self, seed: int, dtype: torch.dtype) -> None:
        self.init, self.dtype = Init(seed), dtype

    def normal(self, *shape: int, std: float, offset: float = 0.0) -> torch.Tensor:
        return self.init.normal(*shape, std=std).add_(offset).to(self.dtype)  # in place: the sums of `+ offset`

    def log_uniform(self, *shape: int, low: float, high: float) -> torch.Tensor:
        return torch.log(self.init.uniform(*shape, low=low, high=high)).to(self.dtype)

    def copy(self, w: dict[str, Any], name: str) -> torch.Tensor:
        return w[name].clone()


class _Recorder:
    """Records each tensor's :class:`WeightSpec` instead of drawing it."""

    def normal(self, *shape: int, std: float, offset: float = 0.0) -> WeightSpec:
        return WeightSpec(tuple(shape), std=std, offset=offset)

    def log_uniform(self, *shape: int, low: float, high: float) -> WeightSpec:
        return WeightSpec(tuple(shape), kind="log_uniform", low=low, high=high)

    def copy(self, w: dict[str, Any], name: str) -> WeightSpec:
        return WeightSpec(w[name].shape, kind="copy", source=name)


def cut_layers(cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """``cfg`` with its first ``num_layers`` layers, every other field kept. A hybrid keeps at least one
    layer of each kind (the last layer becomes attention, or the first recurrent, when the cut lost it)."""
    cfg = copy.deepcopy(cfg)
    n = int(cfg["num_hidden_layers"])
    if "full_attention_interval" in cfg and not cfg.get("layer_types"):  # Qwen3-Next: the pattern, spelt out
        interval = int(cfg["full_attention_interval"])
        cfg["layer_types"] = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n)]
    out = copy.deepcopy(cfg)
    if num_layers >= n:
        return out
    out["num_hidden_layers"] = num_layers
    for key in ("layer_types", "layers_block_type"):
        types = cfg.get(key)
        if not types:
            continue
        types = list(types[:num_layers])
        attention = {"full_attention", "attention"}
        if not attention & set(types):
            types[-1] = "full_attention" if "full_attention" in cfg[key] else "attention"
        if not set(types) - attention:
            types[0] = next(t for t in cfg[key] if t not in attention)
        out[key] = types
    out.pop("num_nextn_predict_layers", None)  # the MTP layer is the one after the full stack: not in a cut
    if isinstance(cfg.get("mlp_only_layers"), list):
        out["mlp_only_layers"] = [i for i in cfg["mlp_only_layers"] if i < num_layers]
    if "max_window_layers" in cfg:
        out["max_window_layers"] = min(int(cfg["max_window_layers"]), num_layers)
    return out


def random_checkpoint(cfg: dict[str, Any], seed: int, dtype: torch.dtype) -> dict[str, Any]:
    """Seeded weights for ``cfg`` (scaled so activations stay O(1)), in ``dtype``."""
    return _walk(ModelConfig.from_dict(cfg), _Drawer(seed, dtype))


def weight_specs(mc: ModelConfig) -> dict[str, WeightSpec]:
    """Every tensor of a checkpoint of ``mc`` (MTP layer included) with how :func:`random_checkpoint` draws it."""
    return _walk(mc, _Recorder())


def _walk(mc: ModelConfig, drawer: Any) -> dict[str, Any]:
    draw = drawer.normal
    h, vocab = mc.hidden_size, mc.vocab_size
    offset = 0.0 if mc.norm_offset else 1.0  # Qwen3-Next and Qwen3.5 norms are applied as 1 + w
    # A tied embedding is also the LM head: drawn at the head's scale so that logits are O(1) and the
    # distributions not one-hot (the first RMSNorm makes the input side scale-free either way).
    w: dict[str, Any] = {
        "model.embed_tokens.weight": draw(vocab, h, std=2.0 * h**-0.5 if mc.tie_word_embeddings else 1.0)
    }
    for i, kind in enumerate(mc.layer_types):
        p = f"model.layers.{i}"
        w[f"{p}.input_layernorm.weight"] = draw(h, std=0.1, offset=offset)
        w[f"{p}.post_attention_layernorm.weight"] = draw(h, std=0.1, offset=offset)
        if kind == ATTENTION and mc.mla is not None:
            _mla(w, f"{p}.self_attn", mc, i, draw)
        elif kind == ATTENTION:
            _attention(w, f"{p}.self_attn", mc, draw, offset)
        elif kind == GATED_DELTANET:
            _gated_deltanet(w, f"{p}.linear_attn", mc, drawer, split=mc.architecture == "Qwen3_5ForCausalLM")
        else:
            _mamba2(w, f"{p}.mamba", mc, drawer)
        _ffn(w, p, mc, i, draw)
    w["model.norm.weight"] = draw(h, std=0.1, offset=offset)
    if not mc.tie_word_embeddings:
        w["lm_head.weight"] = draw(vocab, h, std=2.0 * h**-0.5)
    if mc.mtp_layers and mc.mla is not None:
        _deepseek_mtp(w, mc, drawer)
    return w


def _deepseek_mtp(w: dict[str, Any], mc: ModelConfig, drawer: Any) -> None:
    """DeepSeek's MTP layer (GLM-5, DeepSeek-V3.2) as layer ``num_hidden_layers``: its own copies of the
    embedding and LM head (equal to the model's, as in published checkpoints), the two input norms and
    ``eh_proj``, and a decoder layer of the model's kind."""
    h, n, draw = mc.hidden_size, mc.num_hidden_layers, drawer.normal
    p, layer = f"model.layers.{n}", mc.with_mtp_layer()
    w[f"{p}.embed_tokens.weight"] = drawer.copy(w, "model.embed_tokens.weight")
    w[f"{p}.enorm.weight"] = draw(h, std=0.1, offset=1.0)
    w[f"{p}.hnorm.weight"] = draw(h, std=0.1, offset=1.0)
    w[f"{p}.eh_proj.weight"] = draw(h, 2 * h, std=(2 * h) ** -0.5)
    w[f"{p}.input_layernorm.weight"] = draw(h, std=0.1, offset=1.0)
    w[f"{p}.post_attention_layernorm.weight"] = draw(h, std=0.1, offset=1.0)
    _mla(w, f"{p}.self_attn", layer, n, draw)
    _ffn(w, p, layer, n, draw)
    w[f"{p}.shared_head.norm.weight"] = draw(h, std=0.1, offset=1.0)
    w[f"{p}.shared_head.head.weight"] = drawer.copy(
        w, "lm_head.weight" if "lm_head.weight" in w else "model.embed_tokens.weight"
    )


def _attention(w: dict[str, Any], p: str, mc: ModelConfig, draw: Draw, offset: float) -> None:
    h, d = mc.hidden_size, mc.head_dim
    q_rows = mc.num_attention_heads * d * (2 if mc.attn_output_gate else 1)
    kv_rows = mc.num_key_value_heads * d
    for name, rows in (("q_proj", q_rows), ("k_proj", kv_rows), ("v_proj", kv_rows)):
        w[f"{p}.{name}.weight"] = draw(rows, h, std=h**-0.5)
        if mc.attention_bias:
            w[f"{p}.{name}.bias"] = draw(rows, std=0.1)
    w[f"{p}.o_proj.weight"] = draw(h, mc.num_attention_heads * d, std=(mc.num_attention_heads * d) ** -0.5)
    if mc.attention_bias and mc.architecture != "Qwen2ForCausalLM":  # Qwen2: biases on q, k, v only
        w[f"{p}.o_proj.bias"] = draw(h, std=0.1)
    if mc.qk_norm:
        w[f"{p}.q_norm.weight"] = draw(d, std=0.1, offset=offset)
        w[f"{p}.k_norm.weight"] = draw(d, std=0.1, offset=offset)


def _mla(w: dict[str, Any], p: str, mc: ModelConfig, i: int, draw: Draw) -> None:
    """GLM-5's latent attention and, on a full layer, its lightning indexer (transformers' names)."""
    m, h, heads = mc.mla, mc.hidden_size, mc.num_attention_heads
    assert m is not None
    qk = m.qk_nope_head_dim + m.qk_rope_head_dim
    w[f"{p}.q_a_proj.weight"] = draw(m.q_lora_rank, h, std=h**-0.5)
    w[f"{p}.q_a_layernorm.weight"] = draw(m.q_lora_rank, std=0.1, offset=1.0)
    w[f"{p}.q_b_proj.weight"] = draw(heads * qk, m.q_lora_rank, std=m.q_lora_rank**-0.5)
    w[f"{p}.kv_a_proj_with_mqa.weight"] = draw(m.latent_dim, h, std=h**-0.5)
    w[f"{p}.kv_a_layernorm.weight"] = draw(m.kv_lora_rank, std=0.1, offset=1.0)
    kv_b_rows = heads * (m.qk_nope_head_dim + m.v_head_dim)
    w[f"{p}.kv_b_proj.weight"] = draw(kv_b_rows, m.kv_lora_rank, std=m.kv_lora_rank**-0.5)
    w[f"{p}.o_proj.weight"] = draw(h, heads * m.v_head_dim, std=(heads * m.v_head_dim) ** -0.5)
    if m.indexer_full[i]:
        d = m.index_head_dim
        w[f"{p}.indexer.wq_b.weight"] = draw(m.index_n_heads * d, m.q_lora_rank, std=m.q_lora_rank**-0.5)
        w[f"{p}.indexer.wk.weight"] = draw(d, h, std=h**-0.5)
        w[f"{p}.indexer.k_norm.weight"] = draw(d, std=0.1, offset=1.0)
        w[f"{p}.indexer.k_norm.bias"] = draw(d, std=0.1)
        w[f"{p}.indexer.weights_proj.weight"] = draw(m.index_n_heads, h, std=h**-0.5)


def _gated_deltanet(w: dict[str, Any], p: str, mc: ModelConfig, drawer: Any, split: bool) -> None:
    g, h, draw = mc.gated_deltanet, mc.hidden_size, drawer.normal
    assert g is not None
    hv, dv = g.num_value_heads, g.value_head_dim
    if split:  # Qwen3.5: q | k | v, then z, b and a each on its own
        w[f"{p}.in_proj_qkv.weight"] = draw(g.conv_dim, h, std=h**-0.5)
        w[f"{p}.in_proj_z.weight"] = draw(hv * dv, h, std=h**-0.5)
        w[f"{p}.in_proj_b.weight"] = draw(hv, h, std=h**-0.5)
        w[f"{p}.in_proj_a.weight"] = draw(hv, h, std=h**-0.5)
    else:
        w[f"{p}.in_proj_qkvz.weight"] = draw(g.conv_dim + hv * dv, h, std=h**-0.5)
        w[f"{p}.in_proj_ba.weight"] = draw(2 * hv, h, std=h**-0.5)
    w[f"{p}.conv1d.weight"] = draw(g.conv_dim, 1, g.conv_kernel, std=0.5)
    w[f"{p}.dt_bias"] = draw(hv, std=0.5)
    w[f"{p}.A_log"] = drawer.log_uniform(hv, low=1.0, high=5.0)
    w[f"{p}.norm.weight"] = draw(dv, std=0.1, offset=1.0)
    w[f"{p}.out_proj.weight"] = draw(h, hv * dv, std=(hv * dv) ** -0.5)


def _mamba2(w: dict[str, Any], p: str, mc: ModelConfig, drawer: Any) -> None:
    m, h, draw = mc.mamba2, mc.hidden_size, drawer.normal
    assert m is not None
    w[f"{p}.in_proj.weight"] = draw(m.inner + m.conv_dim + m.num_heads, h, std=h**-0.5)
    if m.proj_bias:
        w[f"{p}.in_proj.bias"] = draw(m.inner + m.conv_dim + m.num_heads, std=0.1)
    w[f"{p}.conv1d.weight"] = draw(m.conv_dim, 1, m.conv_kernel, std=0.5)
    if m.conv_bias:
        w[f"{p}.conv1d.bias"] = draw(m.conv_dim, std=0.1)
    w[f"{p}.dt_bias"] = draw(m.num_heads, std=0.5)
    w[f"{p}.A_log"] = drawer.log_uniform(m.num_heads, low=1.0, high=5.0)
    w[f"{p}.D"] = draw(m.num_heads, std=0.1, offset=1.0)
    w[f"{p}.norm.weight"] = draw(m.inner, std=0.1, offset=1.0)
    w[f"{p}.out_proj.weight"] = draw(h, m.inner, std=m.inner**-0.5)
    if m.proj_bias:
        w[f"{p}.out_proj.bias"] = draw(h, std=0.1)


def _swiglu(w: dict[str, Any], p: str, h: int, inter: int, draw: Draw, bias: bool = False) -> None:
    for name, rows, cols in (("gate_proj", inter, h), ("up_proj", inter, h), ("down_proj", h, inter)):
        w[f"{p}.{name}.weight"] = draw(rows, cols, std=cols**-0.5)
        if bias:
            w[f"{p}.{name}.bias"] = draw(rows, std=0.1)


def _ffn(w: dict[str, Any], p: str, mc: ModelConfig, i: int, draw: Draw) -> None:
    h, moe = mc.hidden_size, mc.moe
    if mc.architecture == "GraniteMoeHybridForCausalLM":
        inter = mc.intermediate_size  # the shared MLP's
        w[f"{p}.shared_mlp.input_linear.weight"] = draw(2 * inter, h, std=h**-0.5)
        w[f"{p}.shared_mlp.output_linear.weight"] = draw(h, inter, std=inter**-0.5)
        if moe is not None:
            e, mi = moe.num_experts, moe.intermediate_size
            w[f"{p}.block_sparse_moe.router.layer.weight"] = draw(e, h, std=h**-0.5)
            w[f"{p}.block_sparse_moe.input_linear.weight"] = draw(e, 2 * mi, h, std=h**-0.5)
            w[f"{p}.block_sparse_moe.output_linear.weight"] = draw(e, h, mi, std=mi**-0.5)
        return
    if moe is not None and moe.sparse_layers[i]:
        w[f"{p}.mlp.gate.weight"] = draw(moe.num_experts, h, std=h**-0.5)
        for e in range(moe.num_experts):
            _swiglu(w, f"{p}.mlp.experts.{e}", h, moe.intermediate_size, draw)
        if moe.routing == "sigmoid_group":  # GLM-5: a score-correction bias, ungated shared experts
            w[f"{p}.mlp.gate.e_score_correction_bias"] = draw(moe.num_experts, std=0.05)
            if moe.shared_intermediate_size:
                _swiglu(w, f"{p}.mlp.shared_experts", h, moe.shared_intermediate_size, draw)
            return
        if moe.shared_intermediate_size:
            _swiglu(w, f"{p}.mlp.shared_expert", h, moe.shared_intermediate_size, draw)
            w[f"{p}.mlp.shared_expert_gate.weight"] = draw(1, h, std=h**-0.5)
        return
    _swiglu(w, f"{p}.mlp", h, mc.intermediate_size, draw, bias=mc.mlp_bias)
