"""What loading a model will take and how it is going: the weights' size on the device checked against
what the device has (before the first byte is read), and a progress bar with GB/s."""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

import torch

from kvwarden.models.quant import FP8, SCALE_SUFFIX, keeps_fp8

log = logging.getLogger(__name__)
GIB = 1024**3


def planned_bytes(source: Any, names: list[str], dtype: torch.dtype, block_fp8: bool) -> int:
    """The weights' bytes once on the device: FP8 tensors one byte each where the backend keeps them FP8,
    else dequantized into ``dtype``; scales float32; everything else in ``dtype`` (float32 kept for the
    few tensors that stay float32 is within the rounding of this plan)."""
    size = torch.empty((), dtype=dtype).element_size()
    total = 0
    for name in names:
        count = 1
        for d in source.shape(name):
            count *= d
        if name.endswith(SCALE_SUFFIX):
            total += 4 * count
        elif source.dtype(name) == FP8 and block_fp8 and keeps_fp8(name):
            total += count
        else:
            total += size * count
    return total


def available_bytes(device: torch.device, utilization: float) -> tuple[int, str]:
    """``(bytes the weights may take, what they are measured against)``: on a GPU the share
    ``utilization`` of its memory less what is already in use; on the CPU the memory the OS reports
    available (``MemAvailable``)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        name = torch.cuda.get_device_name(device)
        used = total - free
        return int(total * utilization) - used, (
            f"gpu_memory_utilization {utilization} of the {name}'s {total / GIB:.1f} GiB, "
            f"{used / GIB:.1f} GiB of it already in use"
        )
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        avail = int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return sys.maxsize, "host memory (unknown)"
    return avail, f"the host's available memory ({avail / GIB:.1f} GiB)"


def check_fits(weight_bytes: int, device: torch.device, utilization: float) -> None:
    """Refuse, naming the shortfall, a model whose weights cannot fit before anything is loaded."""
    room, against = available_bytes(device, utilization)
    if weight_bytes > room:
        raise ValueError(
            f"the model's weights need {weight_bytes / GIB:.1f} GiB on {device.type}, but {against} leaves "
            f"{max(room, 0) / GIB:.1f} GiB: short by {(weight_bytes - max(room, 0)) / GIB:.1f} GiB (an FP8 "
            "checkpoint, a larger device, or a higher gpu_memory_utilization would fit it)"
        )


class LoadProgress:
    """Bytes read so far against the total, as a bar with GB/s (rich, on stderr) when ``show`` (``None``:
    when stderr is a terminal); a log line with the rate at the end either way."""

    def __init__(self, total: int, what: str, show: bool | None) -> None:
        self.total, self.what, self.done = total, what, 0
        self.start = time.perf_counter()
        self.seconds = 0.0
        self._bar: Any = None
        if show if show is not None else sys.stderr.isatty():
            from rich.progress import (
                BarColumn,
                DownloadColumn,
                Progress,
                TextColumn,
                TimeRemainingColumn,
                TransferSpeedColumn,
            )

            self._bar = Progress(
                TextColumn("loading weights"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                TimeRemainingColumn(), transient=True,
            )  # fmt: skip
            self._bar.start()
            self._task = self._bar.add_task("load", total=total)

    def advance(self, nbytes: int) -> None:
        self.done += nbytes
        if self._bar is not None:
            self._bar.update(self._task, completed=self.done)

    def close(self) -> None:
        self.seconds = time.perf_counter() - self.start
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
        rate = self.done / self.seconds / 1e9 if self.seconds > 0 else 0.0
        log.info(
            "loaded %.2f GB of weights from %s in %.1f s (%.2f GB/s)", self.done / 1e9, self.what, self.seconds, rate
        )
