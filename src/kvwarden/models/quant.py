"""FP8 block-quantized checkpoints (Qwen3-*-FP8, DeepSeek-V3 / V3.2, GLM-5-FP8): the format, its one
dequantization rule, and the weight that carries it to the GPU's kernels.

The format: a linear layer's ``weight`` is ``float8_e4m3fn`` ``[N, K]`` (or ``[E, N, K]`` for stacked
experts) beside a float32 ``weight_scale_inv`` of one value per ``bn x bk`` block (``weight_block_size``,
128 x 128 in every published checkpoint): ``w[i, j] = q[i, j] * s[i // bn, j // bk]``. ``config.json`` says
so in ``quantization_config: {quant_method: fp8, activation_scheme: dynamic, weight_block_size: [bn, bk]}``
and lists the modules kept in their original dtype in ``modules_to_not_convert``.

NOTE(invariance): there is exactly one dequantization, ``layers/fp8.py``'s ``dequantize``: the FP8 value
widened to float32 (exact), times its block's float32 scale (one IEEE multiply, rounded to nearest), rounded once to the
compute dtype. The CPU applies it at load; the GPU's kernels apply the very same elementwise formula to
each weight tile inside the GEMM (``layers/kernels/gemm.py``, ``kernels/moe.py``), so an FP8 checkpoint
computes bit for bit what its dequantized twin does on each backend, and every invariance argument of the
dense path carries over unchanged (the tiles and the split of K are still the weight's shape's). What
would break it - activation scales computed per batch - is not used: activations are never quantized here
(W8A16); ``activation_scheme`` other than ``dynamic`` is refused.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from kvwarden.layers.fp8 import FP8, BlockFp8, as_tensor, cat_rows, dequantize, quantize, scale_shape, stack

__all__ = [
    "FP8", "SCALE_SUFFIX", "BlockFp8", "Fp8Config", "as_tensor", "cat_rows", "dequantize", "keeps_fp8",
    "parse_quantization", "quantize", "scale_shape", "stack", "stored_fp8",
]  # fmt: skip
SCALE_SUFFIX = "weight_scale_inv"


@dataclass(frozen=True)
class Fp8Config:
    """A checkpoint's ``quantization_config`` (fp8, block-wise, dynamic activations)."""

    block: tuple[int, int] = (128, 128)
    modules_to_not_convert: tuple[str, ...] = ()

    def converts(self, tensor_name: str) -> bool:
        """Whether the module owning ``tensor_name`` is stored in FP8 by this config (what dummy weights and
        ``make-model --fp8`` write). transformers matches an entry against a module's dotted name; here an
        entry matches whole dotted components (``mlp.gate`` names the router, never ``mlp.gate_proj``)."""
        module = tensor_name.rsplit(".", 1)[0]
        return not any(re.search(rf"(^|\.){re.escape(e)}(\.|$)", module) for e in self.modules_to_not_convert)


def parse_quantization(cfg: dict[str, Any]) -> Fp8Config | None:
    """The FP8 config of a ``config.json``, ``None`` without ``quantization_config``; anything else refused,
    naming the field and the value."""
    quant = cfg.get("quantization_config")
    if not quant:
        return None
    if not isinstance(quant, dict):
        raise ValueError(f"config.json: quantization_config must be an object, got {quant!r}")
    method = quant.get("quant_method")
    if method != "fp8":
        raise ValueError(
            f"config.json: quantization_config.quant_method {method!r} is not supported; kvwarden loads fp8 "
            "block-quantized checkpoints (weight_block_size, weight_scale_inv) and dense ones"
        )
    scheme = quant.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ValueError(
            f"config.json: quantization_config.activation_scheme {scheme!r} is not supported (dynamic): static "
            "activation scales would be applied to every batch alike, which kvwarden does not implement"
        )
    fmt = quant.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"config.json: quantization_config.fmt {fmt!r} is not supported (e4m3)")
    block = quant.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ValueError(
            f"config.json: quantization_config.weight_block_size {block!r} is not supported: kvwarden reads "
            "block-wise scales (two positive ints, e.g. [128, 128]); per-tensor FP8 is not supported"
        )
    known = {"quant_method", "activation_scheme", "fmt", "weight_block_size", "modules_to_not_convert"}
    unknown = sorted(set(quant) - known)
    if unknown:
        raise ValueError(
            f"config.json: quantization_config.{unknown[0]} is not supported (kvwarden reads {sorted(known)})"
        )
    skip = quant.get("modules_to_not_convert") or []
    return Fp8Config(block=(block[0], block[1]), modules_to_not_convert=tuple(str(m) for m in skip))


# The FP8 weights a block_fp8 backend keeps FP8 on the device: those the model passes to ``Ops.linear`` /
# ``linear_swiglu`` or stacks into experts for ``moe_experts`` as they are (fused by whole rows at most:
# :func:`cat_rows`, :func:`stack`). A weight the model reshapes or widens first (GLM-5's ``kv_b_proj`` split
# per head, Qwen3.5's split input projections re-interleaved, routers, the indexer's head weights) is
# dequantized at load instead.
_KERNEL_FP8 = (
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "in_proj_qkvz", "in_proj",
    "out_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "wq_b", "wk", "input_linear", "output_linear",
)  # fmt: skip


def keeps_fp8(name: str) -> bool:
    """Whether a block_fp8 backend keeps this FP8 tensor FP8 (``_KERNEL_FP8``)."""
    return name.endswith(".weight") and name.removesuffix(".weight").rsplit(".", 1)[-1] in _KERNEL_FP8


# Tensors an FP8 checkpoint stores as FP8 when its config converts their module: the linear layers' weights
# (transformers converts every nn.Linear outside modules_to_not_convert). Norms, embeddings, convolutions,
# biases and the recurrent layers' parameters never are.
_LINEAR = (
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "in_proj_qkvz", "in_proj_ba",
    "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "in_proj", "out_proj", "q_a_proj", "q_b_proj",
    "kv_a_proj_with_mqa", "kv_b_proj", "wq_b", "wk", "weights_proj", "gate", "shared_expert_gate", "eh_proj",
    "input_linear", "output_linear", "layer",
)  # fmt: skip


def stored_fp8(name: str, shape: tuple[int, ...], quant: Fp8Config | None) -> bool:
    """Whether a checkpoint with ``quant`` stores this tensor in FP8 (what dummy weights draw)."""
    if quant is None or not name.endswith(".weight") or len(shape) < 2:
        return False
    module = name.removesuffix(".weight").rsplit(".", 1)[-1]
    return module in _LINEAR and "lm_head" not in name and quant.converts(name)
