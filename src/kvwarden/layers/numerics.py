"""Row-wise kernels in two flavours: canonical (shape-invariant) and shape-dependent.

Every model layer calls its GEMMs, norms and activations through an :class:`Ops`
object, so the whole model switches numerics by switching one object.

Why canonical mode is needed (measured on this machine's torch 2.13 + MKL):

* ``X @ W.T`` returns different bits for the same row of ``X`` depending on how
  many rows ``X`` has (e.g. K=1536, N=576: rows differ for M < 16 and for some
  M up to 192), because MKL picks kernels and thread splits by shape.
* torch's element-wise transcendental kernels (silu) take a SIMD path for the
  bulk of a tensor and a scalar path for its tail, and the two differ in the
  last bit, so an element's result depends on where it sits in the tensor.
* A row reduction of a single row is split across threads once the row is
  long enough (49152 floats), but not when there are several rows.

Canonical mode answers each of these by construction:

* GEMMs and row reductions run on tiles of exactly ``row_tile`` rows (padded),
  one library call per tile. Same shape in, same kernel out, and a GEMM never
  mixes rows, so a row's bits do not depend on its batch partners.
* Transcendental element-wise kernels run on flat pieces of exactly
  ``pointwise_chunk`` elements: below torch's parallel grain and a multiple of
  every SIMD width, so every element takes the vectorised path.
* Everything else is IEEE basic arithmetic (+, -, *, /, sqrt, max), whose
  result does not depend on position or vector width. We write ``1/sqrt(x)``
  rather than ``rsqrt`` and ``x*x`` rather than ``pow`` to stay inside it.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import pairwise

import torch

from kvwarden.config import NumericsConfig

RowFn = Callable[[torch.Tensor], torch.Tensor]


class Ops:
    """Shape-dependent ops: library kernels called on whatever shape arrives.

    This is what vendor engines do. It is the fast path of
    ``numerics="shape-dependent"`` and the baseline the canonical path is
    measured against.
    """

    name = "shape-dependent"

    def __init__(self, config: NumericsConfig) -> None:
        self.config = config

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ weight.T (+ bias)`` for ``x`` of shape ``[rows, in]``.

        Emulates GPU GEMM heuristics (split-K chosen by problem shape): the
        reduction is split into ``1 + rows % 5`` parts summed in order, so the
        bits of a row depend on how many rows came with it, as they do on
        vendor kernels (on top of what MKL itself does on this CPU).
        """
        splits = 1 + x.shape[0] % 5
        k = x.shape[1]
        if splits == 1 or k < 2 * splits:
            return torch.nn.functional.linear(x, weight, bias)
        bounds = [k * i // splits for i in range(splits + 1)]
        parts = [torch.nn.functional.linear(x[:, lo:hi], weight[:, lo:hi]) for lo, hi in pairwise(bounds)]
        out = parts[0]
        for part in parts[1:]:
            out = out + part
        return out if bias is None else out + bias

    def rows(self, fn: RowFn, x: torch.Tensor) -> torch.Tensor:
        """Apply a row-wise function (each output row depends on its input row only)."""
        return fn(x)

    def pointwise(self, fn: RowFn, x: torch.Tensor) -> torch.Tensor:
        """Apply an element-wise function (exp, silu, ...)."""
        return fn(x)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm over the last dimension, computed in float32."""
        return self.rows(lambda t: _rms_norm(t, weight, eps), x)

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` (SwiGLU)."""
        return self.pointwise(torch.nn.functional.silu, gate) * up

    def exp(self, x: torch.Tensor) -> torch.Tensor:
        return self.pointwise(torch.exp, x)

    def log_softmax(self, x: torch.Tensor) -> torch.Tensor:
        """Float32 log-softmax over the last dimension of ``[rows, vocab]``."""
        return self.rows(lambda t: torch.log_softmax(t.float(), dim=-1), x)


class CanonicalOps(Ops):
    """Ops whose per-row results are independent of batch and chunk shape."""

    name = "canonical"

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        # NOTE(invariance): one torch.mm per tile of exactly row_tile rows; the
        # padded rows are zeros and are dropped. Same call shape every time.
        wt = weight.t()
        out = _tiled_rows(lambda t: torch.mm(t, wt), x, self.config.row_tile)
        return out if bias is None else out + bias

    def rows(self, fn: RowFn, x: torch.Tensor) -> torch.Tensor:
        # NOTE(invariance): row reductions of one fixed [row_tile, H] shape are
        # parallelised over rows, never within a row.
        return _tiled_rows(fn, x, self.config.row_tile)

    def pointwise(self, fn: RowFn, x: torch.Tensor) -> torch.Tensor:
        # NOTE(invariance): fixed-size flat pieces keep every element on the SIMD
        # path (no scalar tail, no thread split inside a piece).
        chunk = self.config.pointwise_chunk
        flat = x.reshape(-1)
        n = flat.numel()
        padded_n = -(-n // chunk) * chunk
        if padded_n != n:
            flat = torch.cat([flat, flat.new_zeros(padded_n - n)])
        else:
            flat = flat.contiguous()
        out = torch.empty_like(flat)
        for start in range(0, padded_n, chunk):
            out[start : start + chunk] = fn(flat[start : start + chunk])
        return out[:n].view(x.shape)


def _tiled_rows(fn: RowFn, x: torch.Tensor, tile: int) -> torch.Tensor:
    """Run ``fn`` on consecutive ``[tile, ...]`` slices of ``x``; the last one zero padded."""
    x = x.contiguous()
    rows = x.shape[0]
    full = rows - rows % tile
    out: torch.Tensor | None = None
    for start in range(0, full, tile):
        part = fn(x[start : start + tile])
        if out is None:
            out = part.new_empty((rows, *part.shape[1:]))
        out[start : start + tile] = part
    if full < rows:
        last = x.new_zeros((tile, *x.shape[1:]))
        last[: rows - full] = x[full:]
        part = fn(last)
        if out is None:
            out = part.new_empty((rows, *part.shape[1:]))
        out[full:] = part[: rows - full]
    assert out is not None, "no rows"
    return out


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # As transformers: normalise in float32, cast back, then scale by the weight.
    xf = x.float()
    variance = (xf * xf).mean(dim=-1, keepdim=True)
    normed = xf * (1.0 / torch.sqrt(variance + eps))
    return weight * normed.to(x.dtype)


def make_ops(config: NumericsConfig) -> Ops:
    """The ops object for a numerics mode."""
    return CanonicalOps(config) if config.mode == "canonical" else Ops(config)
