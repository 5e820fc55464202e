"""Qwen3-Next's multi-token-prediction (MTP) head, as its checkpoints store it (``mtp.*``).

At position ``p`` the head reads the target's final hidden state ``h_p`` and
the embedding of the token at ``p + 1`` and predicts the token at ``p + 2``:
``fc([norm_e(embed(t_{p+1})), norm_h(h_p)])`` -> one full-attention decoder
layer (its own KV cache) -> ``norm`` -> the target's LM head. Drafting ``k``
tokens feeds its own output back ``k - 1`` times (vLLM does the same).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from kvwarden.models.common import ForwardBatch, WeightGetter, norm_weight, require
from kvwarden.models.config import ATTENTION, ModelConfig
from kvwarden.models.decoder import DecoderLayer, DecoderModel

MTP_PREFIX = "mtp."


class MtpHead:
    """The MTP module over a target model whose embedding and LM head it shares."""

    def __init__(self, cfg: ModelConfig, get: WeightGetter, target: DecoderModel) -> None:
        self.cfg, self.ops, self.target = cfg, target.ops, target
        self.fc = require(get, "mtp.fc.weight")
        self.norm_embed = norm_weight(cfg, get, "mtp.pre_fc_norm_embedding.weight")
        self.norm_hidden = norm_weight(cfg, get, "mtp.pre_fc_norm_hidden.weight")
        self.norm = norm_weight(cfg, get, "mtp.norm.weight")
        self.layer = DecoderLayer(cfg, get, 0, target.ops, target.rope, prefix="mtp.layers.0", kind=ATTENTION)
        self.layer.kv_index = 0

    def forward(
        self,
        batch: ForwardBatch,
        hidden: torch.Tensor,
        kv: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """Normalised output hidden states ``[rows, hidden]``; ``batch.input_ids`` are the tokens at ``p + 1``."""
        ops, eps = self.ops, self.cfg.rms_norm_eps
        embedded = ops.rms_norm(self.target.embed[batch.input_ids], self.norm_embed, eps)
        h = ops.rms_norm(hidden.to(embedded.dtype), self.norm_hidden, eps)
        x = ops.linear(torch.cat([embedded, h], dim=-1), self.fc)
        h, out = self.layer(x, batch, kv)
        return ops.add_rms_norm(out, h, self.norm, eps)[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.target.logits(hidden)


def has_mtp(weights: dict[str, torch.Tensor]) -> bool:
    return "mtp.fc.weight" in weights


def checkpoint_has_mtp(model_dir: str | Path) -> bool:
    """Whether a safetensors checkpoint directory carries an MTP head (without loading it)."""
    from safetensors import safe_open

    index = Path(model_dir) / "model.safetensors.index.json"
    if index.is_file():
        return "mtp.fc.weight" in json.loads(index.read_text())["weight_map"]
    path = Path(model_dir) / "model.safetensors"
    if not path.is_file():
        return False
    with safe_open(str(path), "pt") as f:
        return "mtp.fc.weight" in f.keys()  # noqa: SIM118 - safe_open is not a mapping
