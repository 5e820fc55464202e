"""FP8 block-quantized weights as numbers: the one dequantization rule, the quantizer that makes such
weights, and the weight object that carries FP8 blocks to the GPU's kernels (``models/quant.py`` reads the
checkpoint format).

NOTE(invariance): :func:`dequantize` is the only dequantization: the FP8 value widened to float32 (exact),
times its block's float32 scale (one IEEE multiply, rounded to nearest), rounded once to the compute dtype.
The GPU kernels (``kernels/gemm.py``'s ``dequant_tile``, ``kernels/moe.py``) apply the same elementwise
formula to each weight tile, so an FP8 weight computes the bits of its dequantized twin.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite float8_e4m3fn


def scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """The ``weight_scale_inv`` shape of a weight of ``shape`` (leading dims kept, the last two in blocks)."""
    *lead, n, k = shape
    return (*lead, -(-n // block[0]), -(-k // block[1]))


def expand_scale(scale: torch.Tensor, shape: tuple[int, ...], block: tuple[int, int]) -> torch.Tensor:
    """Each weight element's scale: ``scale`` repeated over its blocks, cut to ``shape``."""
    n, k = shape[-2:]
    return scale.repeat_interleave(block[0], dim=-2).repeat_interleave(block[1], dim=-1)[..., :n, :k]


def dequantize(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """``(float32(q) * scale).to(dtype)``: the only dequantization (module note)."""
    return (q.to(torch.float32) * expand_scale(scale.to(torch.float32), tuple(q.shape), block)).to(dtype)


def quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)`` as FP8 checkpoints are made: each block's scale its largest magnitude over 448, the
    block divided by it and rounded to ``float8_e4m3fn`` (an all-zero block gets scale 1)."""
    *lead, n, k = w.shape
    bn, bk = block
    pn, pk = -(-n // bn) * bn, -(-k // bk) * bk
    padded = torch.nn.functional.pad(w.float(), (0, pk - k, 0, pn - n))
    blocks = padded.reshape(*lead, pn // bn, bn, pk // bk, bk)
    amax = blocks.abs().amax(dim=(-3, -1))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (padded / expand_scale(scale, (*lead, pn, pk), block)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q[..., :n, :k].contiguous(), scale.contiguous()


@dataclass(frozen=True)
class BlockFp8:
    """A linear weight kept in FP8 on the device, dequantized tile by tile inside the GEMM
    (``Ops.block_fp8`` backends only; everything else gets the dequantized tensor at load)."""

    q: torch.Tensor  # float8_e4m3fn [..., N, K]
    scale: torch.Tensor  # float32 [..., ceil(N / bn), ceil(K / bk)]
    block: tuple[int, int]
    dtype: torch.dtype  # the compute dtype the kernels dequantize into

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def dim(self) -> int:
        return self.q.dim()

    @property
    def device(self) -> torch.device:
        return self.q.device

    def numel(self) -> int:
        return self.q.numel()

    def element_size(self) -> int:
        return 1

    def dequantize(self) -> torch.Tensor:
        return dequantize(self.q, self.scale, self.block, self.dtype)

    def rows_aligned(self) -> bool:
        return self.q.shape[-2] % self.block[0] == 0


def cat_rows(parts: list[BlockFp8]) -> BlockFp8 | None:
    """FP8 weights stacked along their rows (a fused projection), or ``None`` when a part's rows end inside
    a block (its scales would then belong to two parts): the caller dequantizes instead."""
    if not all(p.rows_aligned() for p in parts[:-1]) or len({(p.block, p.dtype) for p in parts}) != 1:
        return None
    q = torch.cat([p.q for p in parts], dim=-2)
    scale = torch.cat([p.scale for p in parts], dim=-2)
    return BlockFp8(q, scale, parts[0].block, parts[0].dtype)


def stack(parts: list[BlockFp8]) -> BlockFp8:
    """Experts' FP8 weights stacked on a new leading dimension (``[E, N, K]`` and ``[E, N/bn, K/bk]``)."""
    return BlockFp8(
        torch.stack([p.q for p in parts]), torch.stack([p.scale for p in parts]), parts[0].block, parts[0].dtype
    )


def as_tensor(w: torch.Tensor | BlockFp8) -> torch.Tensor:
    """A dense tensor whatever the weight's storage (for the few places that reshape a weight)."""
    return w.dequantize() if isinstance(w, BlockFp8) else w
