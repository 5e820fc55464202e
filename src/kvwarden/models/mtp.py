"""The multi-token-prediction (MTP) head, as checkpoints store it.

At position ``p`` the head reads the target's final hidden state ``h_p`` and
the embedding of the token at ``p + 1`` and predicts the token at ``p + 2``:
``fc([norm_e(embed(t_{p+1})), norm_h(h_p)])`` -> one full-attention decoder
layer (its own KV cache) -> ``norm`` -> the LM head. Drafting ``k`` tokens
feeds its own output back ``k - 1`` times (vLLM does the same).

Two layouts of the same head (:class:`MtpNames`): Qwen3-Next's ``mtp.*``
(sharing the target's embedding and LM head), and DeepSeek's, used by GLM-5
and DeepSeek-V3.2: layer ``num_hidden_layers`` of ``model.layers`` with
``enorm``, ``hnorm``, ``eh_proj``, its own ``embed_tokens`` and
``shared_head.{norm,head}`` around a decoder layer of the model's own kind
(latent attention with its own indexer, routed experts).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from kvwarden.models.common import ForwardBatch, WeightGetter, norm_weight, require
from kvwarden.models.config import ATTENTION, ModelConfig
from kvwarden.models.decoder import DecoderLayer, DecoderModel


@dataclass(frozen=True)
class MtpNames:
    """Where a checkpoint keeps the head's tensors; ``embed`` and ``head`` None: the target's are shared."""

    fc: str
    norm_embed: str
    norm_hidden: str
    norm: str
    layer: str  # the decoder layer's prefix
    embed: str | None = None
    head: str | None = None


QWEN3_NEXT = MtpNames(
    "mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight",
    "mtp.layers.0",
)  # fmt: skip


def deepseek_names(num_hidden_layers: int) -> MtpNames:
    """DeepSeek's layout (GLM-5, DeepSeek-V3.2): the layer after the stack."""
    p = f"model.layers.{num_hidden_layers}"
    return MtpNames(
        f"{p}.eh_proj.weight", f"{p}.enorm.weight", f"{p}.hnorm.weight", f"{p}.shared_head.norm.weight", p,
        f"{p}.embed_tokens.weight", f"{p}.shared_head.head.weight",
    )  # fmt: skip


def mtp_names(cfg: ModelConfig) -> MtpNames:
    """Where ``cfg``'s family keeps its MTP head: DeepSeek's layout for sparse-attention models."""
    return deepseek_names(cfg.num_hidden_layers) if cfg.mla is not None else QWEN3_NEXT


class MtpHead:
    """The MTP module over a target model (whose embedding and LM head Qwen3-Next's head shares)."""

    def __init__(self, cfg: ModelConfig, weights: WeightGetter, target: DecoderModel) -> None:
        names = mtp_names(cfg)
        self.cfg, self.ops, self.target = cfg, target.ops, target
        self.asked: set[str] = set()  # every tensor name the head read (a checkpoint's others are refused)

        def get(name: str) -> torch.Tensor | None:
            self.asked.add(name)
            return weights(name)

        self.fc = require(get, names.fc)
        self.norm_embed = norm_weight(cfg, get, names.norm_embed)
        self.norm_hidden = norm_weight(cfg, get, names.norm_hidden)
        self.norm = norm_weight(cfg, get, names.norm)
        # DeepSeek's layout may store its own copies of the embedding and LM head (equal to the model's in
        # published checkpoints), or leave them out: then the model's are shared, as Qwen3-Next's head does
        own_embed = get(names.embed) if names.embed else None
        self.embed = own_embed if own_embed is not None else target.embed
        self.head = get(names.head) if names.head else None
        deepseek = names.embed is not None
        index = cfg.num_hidden_layers if deepseek else 0
        layer_cfg = cfg.with_mtp_layer() if deepseek else cfg
        self.layer = DecoderLayer(layer_cfg, get, index, target.ops, target.rope, prefix=names.layer, kind=ATTENTION)
        self.layer.kv_index = 0

    def forward(
        self,
        batch: ForwardBatch,
        hidden: torch.Tensor,
        kv: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """Normalised output hidden states ``[rows, hidden]``; ``batch.input_ids`` are the tokens at ``p + 1``."""
        ops, eps = self.ops, self.cfg.rms_norm_eps
        batch.dsa_selection = batch.dsa_keys = batch.dsa_rope = None  # sparse attention: the head selects its own keys
        embedded = ops.rms_norm(self.embed[batch.input_ids], self.norm_embed, eps)
        h = ops.rms_norm(hidden.to(embedded.dtype), self.norm_hidden, eps)
        x = ops.linear(torch.cat([embedded, h], dim=-1), self.fc)
        h, out = self.layer(x, batch, kv)
        return ops.add_rms_norm(out, h, self.norm, eps)[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.target.logits(hidden, self.head)


def has_mtp(cfg: ModelConfig, weights: dict[str, torch.Tensor]) -> bool:
    """Whether the checkpoint's MTP tensors (the loader's ``mtp_weights``) hold a head."""
    return mtp_names(cfg).fc in weights


def checkpoint_has_mtp(model_dir: str | Path) -> bool:
    """Whether a safetensors checkpoint directory carries an MTP head (without loading it)."""
    from safetensors import safe_open

    try:
        fc = mtp_names(ModelConfig.from_dir(model_dir)).fc
    except (OSError, ValueError):  # not a model directory kvwarden serves (a GGUF file, another family)
        return False
    index = Path(model_dir) / "model.safetensors.index.json"
    if index.is_file():
        return fc in json.loads(index.read_text())["weight_map"]
    path = Path(model_dir) / "model.safetensors"
    if not path.is_file():
        return False
    with safe_open(str(path), "pt") as f:
        return fc in f.keys()  # noqa: SIM118 - safe_open is not a mapping
