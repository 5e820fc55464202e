"""Rotary position embeddings with a precomputed cos/sin table.

NOTE(invariance): the table is computed once for every position up to the
model's maximum length and looked up by absolute position, so the rotation of a
token never depends on which chunk or batch it arrived in. Applying it is IEEE
basic arithmetic (mul, add), exact per element.
"""

from __future__ import annotations

import math
from typing import Any

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def inverse_frequencies(rotary_dim: int, params: dict[str, Any], max_positions: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the cos/sin scale for a Hugging Face rope config.

    Args:
        rotary_dim: number of rotated dimensions (``head_dim * partial_rotary_factor``).
        params: the config's ``rope_parameters`` (``rope_type``, ``rope_theta``, ...).
        max_positions: the model's ``max_position_embeddings``.

    Raises:
        ValueError: for a rope type whose frequencies depend on the sequence length
            (``dynamic``, ``longrope``): logits would then depend on how long the
            request happened to be when a KV entry was written.
    """
    rope_type = params.get("rope_type", params.get("type", "default"))
    base = float(params.get("rope_theta", 10000.0))
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    inv_freq = 1.0 / (base**exponents)
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / float(params["factor"]), 1.0
    if rope_type == "llama3":
        return _llama3(inv_freq, params), 1.0
    if rope_type == "yarn":
        return _yarn(rotary_dim, base, params, max_positions)
    raise ValueError(
        f"rope_scaling: rope_type {rope_type!r} is not supported (supported: {SUPPORTED_ROPE_TYPES}); "
        "length-dependent rope types would make logits depend on the request length at cache-write time"
    )


def _llama3(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    factor = params["factor"]
    low, high = params["low_freq_factor"], params["high_freq_factor"]
    old_len = params["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(dim: int, base: float, params: dict[str, Any], max_positions: int) -> tuple[torch.Tensor, float]:
    orig = params["original_max_position_embeddings"]
    factor = params.get("factor") or max_positions / orig

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        ms, ms_all = params.get("mscale"), params.get("mscale_all_dim")
        attention_factor = mscale(factor, ms) / mscale(factor, ms_all) if ms and ms_all else mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_factor = 1 - ramp
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_factor) + (1.0 / pos_freqs) * extrapolation_factor
    return inv_freq, float(attention_factor)


class RotaryEmbedding:
    """cos/sin table for positions ``[0, max_positions)``; applies rope to q and k."""

    def __init__(
        self,
        head_dim: int,
        rotary_dim: int,
        params: dict[str, Any],
        max_positions: int,
        device: torch.device | str = "cpu",
    ) -> None:
        self.head_dim = head_dim
        if rotary_dim % 2 and params.get("rope_type", params.get("type", "default")) == "yarn":
            raise ValueError(f"partial_rotary_factor: an odd rotary dimension ({rotary_dim}) cannot use yarn scaling")
        inv_freq, scale = inverse_frequencies(rotary_dim, params, max_positions)
        # As transformers: the table has 2 * ceil(rotary_dim / 2) columns and that many leading dimensions
        # rotate (an odd rotary dimension rounds up: head_dim 20 x 0.25 rotates 6, not 5).
        self.rotary_dim = 2 * inv_freq.numel()
        if self.rotary_dim > head_dim:
            raise ValueError(
                f"partial_rotary_factor: {rotary_dim} rotary dimensions round up to {self.rotary_dim}, "
                f"more than head_dim ({head_dim})"
            )
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        # computed on the CPU (one table for every device), then moved
        self.cos = (emb.cos() * scale).to(device)
        self.sin = (emb.sin() * scale).to(device)

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` of shape ``[tokens, heads, head_dim]`` at ``positions``."""
        cos = self.cos[positions].unsqueeze(1).to(x.dtype)
        sin = self.sin[positions].unsqueeze(1).to(x.dtype)
        if self.rotary_dim == self.head_dim:
            return x * cos + rotate_half(x) * sin
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        return torch.cat([rot * cos + rotate_half(rot) * sin, rest], dim=-1)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)
