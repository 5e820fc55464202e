"""Causal depthwise conv1d (the short conv of gated-DeltaNet and Mamba2 layers).

NOTE(invariance): ``out[t] = silu(b + w[0] x[t-K+1] + ... + w[K-1] x[t])`` is
written as an explicit left fold of element-wise products in tap order, so a
position's output is the same IEEE arithmetic whether it is computed in a
4000-token prefill or a 1-token decode. The fold runs in float32 and rounds
once to the model's dtype before the activation, as a library convolution
accumulates. The conv state is the last K-1 raw inputs, zeros before position 0.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def causal_conv1d(
    x: torch.Tensor,
    state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    silu: Callable[[torch.Tensor], torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Convolve new rows ``x`` ``[n, channels]`` after ``state`` ``[K-1, channels]``.

    Args:
        weight: ``[channels, K]`` (the Hugging Face ``conv1d.weight`` squeezed).
        silu: the activation (the numerics' pointwise silu).

    Returns:
        ``(silu(conv(x)) [n, channels], new state [K-1, channels])``.
    """
    k = weight.shape[1]
    n = x.shape[0]
    window = torch.cat([state.float(), x.float()], dim=0)  # [K-1+n, C]; model-dtype values are exact in float32
    w = weight.float()
    acc = window[0:n] * w[:, 0]
    for tap in range(1, k):
        acc = acc + window[tap : tap + n] * w[:, tap]
    if bias is not None:
        acc = acc + bias.float()
    return silu(acc.to(x.dtype)), window[n:].clone()


def shape_dependent_conv1d(
    x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same convolution through ``F.conv1d`` (library reduction order)."""
    k = weight.shape[1]
    n = x.shape[0]
    window = torch.cat([state.to(x.dtype), x], dim=0)
    out = torch.nn.functional.conv1d(window.t().unsqueeze(0), weight.unsqueeze(1), bias, groups=weight.shape[0])
    return torch.nn.functional.silu(out[0].t()[-n:]), window[n:].clone() if k > 1 else window[:0]
