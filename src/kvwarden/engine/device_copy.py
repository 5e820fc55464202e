"""Small host lists sent to the device without waiting for it.

NOTE: ``torch.tensor(values, device="cuda")`` (and indexing a CUDA tensor with a Python list) copies from
pageable memory and then synchronises the stream: the host waits for every kernel queued before it. Inside
a step that is harmless, but between a step's sampling and the launch of the step after it
(``engine/overlap.py``) it leaves the GPU idle while the host catches up. A pinned copy queued without
blocking keeps the host ahead.
"""

from __future__ import annotations

import torch


def upload(values: list[int] | list[float], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype, device=device)``, queued without blocking the host."""
    host = pinned(torch.tensor(values, dtype=dtype), device)
    return host if torch.device(device).type != "cuda" else host.to(device, non_blocking=True)


def pinned(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``host`` where a copy to ``device`` reads it without blocking: pinned for a GPU, as is for the CPU.

    Pinned blocks come from PyTorch's caching host allocator, which keeps each until the copy reading it is
    done, so the caller may drop it at once.
    """
    return host.pin_memory() if torch.device(device).type == "cuda" else host
