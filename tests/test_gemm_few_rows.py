"""Few-rows tiles of the row-invariant GEMM: a launch of at most one tile of rows may own fewer columns per
program and pipeline deeper (``gemm_config.launch_config``), with the weight's own bits.

On the CPU the kernel runs under Triton's interpreter (the structure: masks of a partial last column tile,
the weight's split of K passed with narrower tiles, both forms, the fused SwiGLU epilogue); on a GPU
(``scripts/gpu_check.sh``) compiled, where the matrix instruction's bits are what is checked, including
every few-rows entry recorded for that GPU.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from kvwarden.layers.kernels import gemm, gemm_config

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16] if DEVICE == "cuda" else [torch.float32]
TABLE = gemm_config.table_path()  # the one the engine reads: KVWARDEN_GEMM_TABLE or the packaged one


def rand(g: torch.Generator, *shape: int, dtype: torch.dtype) -> torch.Tensor:
    return (torch.randn(*shape, generator=g) * 0.5).to(dtype).to(DEVICE)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.contiguous().view(torch.uint8).equal(b.contiguous().view(torch.uint8))


@pytest.fixture
def table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A table for a made-up GPU name, read through ``KVWARDEN_GEMM_TABLE`` (the cache cleared around it)."""

    def write(entry: dict) -> str:
        path = tmp_path / "gemm_tuned.json"
        path.write_text(json.dumps({"test-gpu": entry}))
        monkeypatch.setenv("KVWARDEN_GEMM_TABLE", str(path))
        gemm_config.reload_tables()
        return "test-gpu"

    yield write
    gemm_config.reload_tables()


def test_launch_config_narrows_only_launches_of_one_tile_of_rows(table) -> None:
    n, k, dtype = 96, 12288, torch.float32  # K long enough that narrower tiles would split it otherwise
    weight = {"block_m": 16, "block_n": 64, "block_k": 32, "num_warps": 4, "num_stages": 2}
    key = "96x12288:float32"
    name = table({"shapes": {key: weight}, "few_rows": {key: {"block_n": 16, "num_stages": 3}}})
    own = gemm.GemmConfig(**weight)
    assert gemm.gemm_config(n, k, dtype, name) == own
    blocks = gemm.split_blocks(n, k, own)
    assert blocks != gemm.split_blocks(n, k, dataclasses.replace(own, block_n=16))  # would change with the tiles
    for m in (1, 7, 16):
        cfg, got_blocks = gemm.launch_config(m, n, k, dtype, name)
        assert cfg == dataclasses.replace(own, block_n=16, num_stages=3) and got_blocks == blocks
    assert gemm.launch_config(17, n, k, dtype, name) == (own, blocks)  # two tiles of rows: the weight's tiles
    assert gemm.launch_config(1, n, 1024, dtype, name)[0] == gemm.gemm_config(n, 1024, dtype, name)  # no entry
    assert gemm.launch_config(1, n, k, dtype, "")[0] == gemm.gemm_config(n, k, dtype)  # the CPU: no table
    # another table for the same GPU name: read again on reload (launch_config caches per weight shape)
    name = table({"shapes": {key: weight}, "few_rows": {key: {"block_n": 32, "num_stages": 4}}})
    assert gemm.launch_config(1, n, k, dtype, name) == (dataclasses.replace(own, block_n=32, num_stages=4), blocks)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("glu", [False, True])
def test_few_rows_tiles_give_the_weights_bits(dtype: torch.dtype, glu: bool) -> None:
    """Narrower tiles with the weight's split of K: every row the bits of a launch of the weight's tiles,
    walked or in parallel, with a partial last tile of columns (N = 70: tiles of 16 leave 6; fused, 35)."""
    g = torch.Generator().manual_seed(5)
    n, k = 70, 2600
    x, w, b = rand(g, 40, k, dtype=dtype), rand(g, n, k, dtype=dtype), rand(g, n, dtype=dtype)
    own = gemm.gemm_config(n, k, dtype)
    blocks = gemm.split_blocks(n, k, own)
    assert -(-k // own.block_k) > blocks  # K really is split
    want = gemm.launch(x, w, b, own, glu=glu)
    counters = gemm.new_counters(DEVICE)
    for block_n in (32, 64) if glu else (16, 32):
        for stages in (2, 4) if DEVICE == "cuda" else (own.num_stages,):  # the interpreter does not pipeline
            cfg = dataclasses.replace(own, block_n=block_n, num_stages=stages)
            for m in (1, 3, own.block_m):
                for parallel in (False, True):
                    got = gemm.launch(x[:m], w, b, cfg, parallel, counters, blocks, glu)
                    assert same(got, want[:m]), (block_n, stages, m, parallel)
            assert int(counters.abs().sum()) == 0


def recorded() -> list[tuple[str, str]]:
    table = json.loads(TABLE.read_text())
    return [(device, key) for device, entry in table.items() for key in entry.get("few_rows", {})]


@pytest.mark.parametrize(("device", "key"), recorded())
def test_recorded_few_rows_entries_keep_the_bits(device: str, key: str) -> None:
    """Every few-rows entry only narrows its weight's tiles; on its own GPU, compiled, it keeps the bits
    of the weight's tiles at 1 row and at a whole tile of rows."""
    entry = json.loads(TABLE.read_text())[device]
    few = entry["few_rows"][key]
    n, k, dtype = gemm_config.parse_tuned_key(key)
    own = gemm.GemmConfig(**entry["shapes"][key]) if key in entry["shapes"] else gemm.gemm_config(n, k, dtype)
    assert set(few) >= {"block_n", "num_stages"} and 16 <= few["block_n"] <= own.block_n
    assert few["block_n"] & (few["block_n"] - 1) == 0 and 1 <= few["num_stages"] <= 6
    if DEVICE != "cuda" or torch.cuda.get_device_name() != device:
        return  # the bits are the matrix instruction's: only that GPU, compiled, can show them
    g = torch.Generator().manual_seed(6)
    x, w = rand(g, 2 * own.block_m, k, dtype=dtype), rand(g, n, k, dtype=dtype) * 0.05
    want = gemm.launch(x, w, None, own)
    counters = gemm.new_counters(DEVICE)
    for m in (1, own.block_m):
        assert same(gemm.linear(x[:m], w, counters=counters), want[:m]), m
        assert same(gemm.linear(x[:m], w, parallel=False), want[:m]), m
