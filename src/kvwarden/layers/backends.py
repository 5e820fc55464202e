"""Which numerics backend serves a device: the one place that knows them all.

* CPU, ``canonical``: :class:`~kvwarden.layers.cpu_ops.CompiledCpuOps` (the compiled kernels), or
  :class:`~kvwarden.layers.numerics.CanonicalOps` (PyTorch, fixed tiles) with ``kernels="torch"`` or,
  logged, when the compiled kernels cannot be built here.
* CPU, ``shape-dependent``: :class:`~kvwarden.layers.numerics.Ops` (library calls, vendor emulation).
* CUDA, ``canonical``: :class:`~kvwarden.layers.gpu_ops.TritonOps` (the Triton kernels).
* CUDA, ``shape-dependent``: :class:`~kvwarden.layers.gpu_ops.CudaOps` (cuBLAS, PyTorch attention).

``numerics.kernels="triton"`` puts the Triton kernels on the CPU under Triton's
interpreter (tests).
"""

from __future__ import annotations

import logging
import os

import torch

from kvwarden.config import NumericsConfig
from kvwarden.layers.numerics import CanonicalOps, Ops

log = logging.getLogger(__name__)


def make_ops(config: NumericsConfig, device: str = "cpu") -> Ops:
    """The ops object for a numerics mode on a device (``"cpu"`` or ``"cuda"``).

    Raises:
        ValueError: a kernel source the device does not have, or ``kernels="compiled"`` where the
            compiled CPU kernels cannot be built (the message says why).
    """
    if device == "cuda" and config.kernels in ("compiled", "torch"):
        raise ValueError(f"numerics.kernels: {config.kernels!r} names CPU kernels; a GPU runs 'auto' (Triton)")
    if device == "cuda" or config.kernels == "triton":
        if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("numerics.kernels='triton' on the CPU needs Triton's interpreter (TRITON_INTERPRET=1)")
        from kvwarden.layers.gpu_ops import CudaOps, TritonOps  # Triton only where it is used

        cls = TritonOps if config.mode == "canonical" else CudaOps
        return cls(config, torch.device(device))
    if config.mode != "canonical":
        return Ops(config)
    if config.kernels == "torch":
        return CanonicalOps(config)
    from kvwarden.layers.cpu_kernels.build import BuildError
    from kvwarden.layers.cpu_kernels.library import load
    from kvwarden.layers.cpu_ops import CompiledCpuOps

    try:
        return CompiledCpuOps(config, load())
    except BuildError as exc:
        if config.kernels == "compiled":
            raise ValueError(f"numerics.kernels='compiled': {exc}") from exc
        log.warning("CPU kernels: the compiled kernels are unavailable here, using PyTorch's (%s)", exc)
        return CanonicalOps(config)
