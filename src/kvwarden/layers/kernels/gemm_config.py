"""Which tiles and which split of K a row-invariant GEMM launch runs (``kernels/gemm.py`` runs them).

Everything that fixes an output element's arithmetic is a function of the weight's shape ``(N, K)``, the
dtype and the GPU model (:func:`gemm_config`, :func:`split_blocks`); a launch's row count chooses only
what leaves the arithmetic alone (:func:`launch_config`: how many columns a program owns and how deep
its loads are pipelined, for launches of a few rows; :func:`splits_in_parallel`: walked or parallel).
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import triton

from kvwarden.intmath import cdiv

# The split of K (numerics: a function of the weight's shape and tile configuration only). A weight whose
# K is at least SPLIT_FROM_K gets up to TARGET_PROGRAMS / (its output tiles) splits, each at least
# MIN_SPLIT_K long (H100, kvwarden bench gemm_split --sweep: one program per tile walking 2,048-12,288 of K
# left the GEMV-shaped launch latency-bound; splits of ~512 halved it; shorter ones, or splitting a
# K of 1,024, gained nothing at one row and cost up to 1.5x at 2,048 rows).
TARGET_PROGRAMS = 128  # about one wave of an H100's or H200's 132 SMs
SPLIT_FROM_K = 2048
MIN_SPLIT_K = 512
# When the splits run in parallel (speed only): launches of fewer output tiles than this, whose float32
# partials (written once, read once) cost at most PARTIAL_BYTES_PER_WEIGHT_BYTE of the weight's bytes.
PARALLEL_MAX_TILES = 64
PARTIAL_BYTES_PER_WEIGHT_BYTE = 1.0


@dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def tuned_key(n: int, k: int, dtype: torch.dtype) -> str:
    return f"{n}x{k}:{str(dtype).removeprefix('torch.')}"


def parse_tuned_key(key: str) -> tuple[int, int, torch.dtype]:
    """``(n, k, dtype)`` of a table key (the inverse of :func:`tuned_key`)."""
    shape, dtype = key.split(":")
    n, k = map(int, shape.split("x"))
    return n, k, getattr(torch, dtype)


def table_path() -> Path:
    """The table the engine reads: ``KVWARDEN_GEMM_TABLE`` (a freshly measured one) or the packaged one."""
    return Path(os.environ.get("KVWARDEN_GEMM_TABLE") or Path(__file__).with_name("gemm_tuned.json"))


@functools.cache
def _device_tables(device_name: str) -> tuple[dict[str, GemmConfig], dict[str, tuple[int, int]]]:
    """This GPU model's two tables, read once per process from ``KVWARDEN_GEMM_TABLE`` or the packaged
    ``gemm_tuned.json`` (a table fixed for the life of the engine keeps every configuration fixed; and
    every GEMM launch looks its tiles up here, so the lookup is a cached dict, not a file read)."""
    path = table_path()
    entry = json.loads(path.read_text()).get(device_name, {}) if path.is_file() else {}
    shapes = {key: GemmConfig(**cfg) for key, cfg in entry.get("shapes", {}).items()}
    few = {key: (e["block_n"], e["num_stages"]) for key, e in entry.get("few_rows", {}).items()}
    return shapes, few


def tuned_table(device_name: str) -> dict[str, GemmConfig]:
    """Tile configurations measured for one GPU model (``kvwarden bench tune_gemm`` writes them)."""
    return _device_tables(device_name)[0]


def few_rows_table(device_name: str) -> dict[str, tuple[int, int]]:
    """``(BLOCK_N, stages)`` measured for launches of at most one tile of rows (``kvwarden bench gemv --write``)."""
    return _device_tables(device_name)[1]


def gemm_config(n: int, k: int, dtype: torch.dtype, device_name: str = "") -> GemmConfig:
    """The one tile configuration for a weight of shape ``[n, k]`` (never depends on the row count):
    the tuned one for this GPU model when ``gemm_tuned.json`` has it, else a fixed rule."""
    tuned = tuned_table(device_name).get(tuned_key(n, k, dtype)) if device_name else None
    if tuned is not None:
        return tuned
    block_k = 64 if k >= 64 else max(16, triton.next_power_of_2(k))
    block_n = 128 if n >= 4096 else 64 if n >= 64 else max(16, triton.next_power_of_2(n))
    if dtype == torch.float32:  # ieee fp32 dots need more registers per element
        return GemmConfig(32, min(block_n, 64), min(block_k, 32), 4, 2)
    return GemmConfig(64, block_n, block_k, 4, 3)


def split_blocks(n: int, k: int, cfg: GemmConfig) -> int:
    """Blocks of ``BLOCK_K`` per split of K: every split but the last has exactly this many.

    A function of the weight's shape and configuration only (never of ``M``): it fixes the order of
    the float32 adds. All of K (one split) when the weight has output tiles enough to fill the GPU.
    """
    k_blocks = cdiv(k, cfg.block_k)
    splits = min(cdiv(TARGET_PROGRAMS, cdiv(n, cfg.block_n)), k // MIN_SPLIT_K) if k >= SPLIT_FROM_K else 1
    return k_blocks if splits <= 1 else cdiv(k_blocks, splits)


def splits_in_parallel(m: int, n: int, k: int, cfg: GemmConfig, elem_bytes: int, blocks: int | None = None) -> bool:
    """Whether a launch runs its splits in parallel: several splits, few output tiles, and partials
    cheap beside the weight's bytes. A speed choice only (module docstring). ``blocks``: the split's
    length when ``cfg`` is a launch's few-rows tiles (:func:`launch_config`), else ``cfg``'s own."""
    nsplit = cdiv(cdiv(k, cfg.block_k), split_blocks(n, k, cfg) if blocks is None else blocks)
    tiles = cdiv(m, cfg.block_m) * cdiv(n, cfg.block_n)
    partial_bytes = 8 * nsplit * m * n  # float32, written and read back
    return (
        nsplit > 1
        and tiles < PARALLEL_MAX_TILES
        and partial_bytes <= PARTIAL_BYTES_PER_WEIGHT_BYTE * n * k * elem_bytes
    )


def launch_config(m: int, n: int, k: int, dtype: torch.dtype, device_name: str = "") -> tuple[GemmConfig, int]:
    """The tiles of one launch of ``m`` rows through a weight ``[n, k]``, and its split of K (blocks of
    ``BLOCK_K`` per split): the weight's configuration, except that a launch of at most one tile of
    rows (a decode step's GEMV shape) takes the few-rows ``BLOCK_N`` and stages measured for this GPU.

    NOTE(invariance): the few-rows tiles keep everything an output element's arithmetic is made of:
    ``BLOCK_M`` and warps (the matrix instruction and how the tile is spread over warps), ``BLOCK_K``
    (the chain of ``tl.dot`` steps) and the split of K (returned from the weight's configuration, not
    recomputed from the narrower tiles). ``BLOCK_N`` only says how many output columns one program
    owns, columns never interact, and stages only how far ahead loads are issued. ``kvwarden bench gemv``
    checks every candidate bitwise against the weight's tiles before it is recorded, and the GPU
    tests check every recorded entry again (``tests/test_gemm_few_rows.py``).
    """
    cfg, few, blocks = _weight_launches(n, k, dtype, device_name)
    return (few if m <= cfg.block_m else cfg), blocks


@functools.cache
def _weight_launches(n: int, k: int, dtype: torch.dtype, device_name: str) -> tuple[GemmConfig, GemmConfig, int]:
    """A weight's tiles, its few-rows tiles (its own where the table has none) and its split of K, worked
    out once per weight shape: ``launch_config`` runs on every GEMM launch, and eager prefill steps make
    hundreds of them (3.1 us a call uncached against 0.7 for the lookup before few-rows tiles, on CI's CPU)."""
    cfg = gemm_config(n, k, dtype, device_name)
    entry = few_rows_table(device_name).get(tuned_key(n, k, dtype)) if device_name else None
    few = replace(cfg, block_n=entry[0], num_stages=entry[1]) if entry is not None else cfg
    return cfg, few, split_blocks(n, k, cfg)


def reload_tables() -> None:
    """Read the tables again on next use (after pointing ``KVWARDEN_GEMM_TABLE`` at another file)."""
    _device_tables.cache_clear()
    _weight_launches.cache_clear()
