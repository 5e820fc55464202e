"""Which numerics backend serves a device: the one place that knows them all.

* CPU, ``canonical``: :class:`~kvwarden.layers.numerics.CanonicalOps` (PyTorch, fixed tiles).
* CPU, ``shape-dependent``: :class:`~kvwarden.layers.numerics.Ops` (library calls, vendor emulation).
* CUDA, ``canonical``: :class:`~kvwarden.layers.gpu_ops.TritonOps` (the Triton kernels).
* CUDA, ``shape-dependent``: :class:`~kvwarden.layers.gpu_ops.CudaOps` (cuBLAS, PyTorch attention).

``numerics.kernels="triton"`` puts the Triton kernels on the CPU under Triton's
interpreter (tests).
"""

from __future__ import annotations

import os

import torch

from kvwarden.config import NumericsConfig
from kvwarden.layers.numerics import CanonicalOps, Ops


def make_ops(config: NumericsConfig, device: str = "cpu") -> Ops:
    """The ops object for a numerics mode on a device (``"cpu"`` or ``"cuda"``)."""
    if device == "cuda" or config.kernels == "triton":
        if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("numerics.kernels='triton' on the CPU needs Triton's interpreter (TRITON_INTERPRET=1)")
        from kvwarden.layers.gpu_ops import CudaOps, TritonOps  # Triton only where it is used

        cls = TritonOps if config.mode == "canonical" else CudaOps
        return cls(config, torch.device(device))
    return CanonicalOps(config) if config.mode == "canonical" else Ops(config)
