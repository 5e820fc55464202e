"""Every Triton kernel launched by real CPU runs also passes the GPU compiler's front end (sm_90, no GPU).

The interpreter (how CI runs the kernels) skips Triton's front end: on 2026-12-07 a top-k change passed
every interpreter test and then failed to compile on the H100 (a constant 0 passed as a loop-carried
count). Here the launches of real runs are recorded under the interpreter (``gpu_lowering.Launches``) and a
child process without it lowers each specialization to Triton IR for Hopper.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import _made
from kvwarden import LLM, SamplingParams
from kvwarden.layers.kernels.topk import topk_triton
from kvwarden.models.make_model import make_model

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU compiles its kernels itself")

HERE = Path(__file__).resolve().parent


def _top_k_forms() -> None:
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(3, 3000, generator=g)
    rows[1] = torch.randint(0, 5, (3000,), generator=g).float()  # heavy ties: the passes over the row
    rows[2, :2900] = float("-inf")  # fewer finite scores than k: the -inf fill
    for kw in (
        {"split": 0},
        {"split": 0, "buckets": False, "masked": True},
        {"split": 0, "radix": 11, "block": 1024},
        {"split": 1024, "block": 512},
        {"split": 1024, "block": 512, "buckets": True},
    ):
        topk_triton(rows, 200, **kw)
    long = torch.randn(2, 65536, generator=g)
    topk_triton(long[:1], 2048)  # the engine's default shapes: the radix split in chunks of 4,096 on 8 warps
    topk_triton(long, 2048, split=16384, block=4096, num_warps=8, buckets=True)  # the bucket split


def _family_runs(models_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    prompts = [[(7 * i + 3) % 200 + 3 for i in range(70)], [(5 * i + 1) % 200 + 3 for i in range(23)]]
    params = SamplingParams(temperature=0.0, max_tokens=3, logprobs=2)
    for arch in ("llama", "qwen3_next", "granite_hybrid", "glm_moe_dsa"):
        model = _made(models_root, arch, "tiny")
        llm = LLM(str(model), device="cpu", kernels="triton", max_num_batched_tokens=32, num_blocks=64)
        llm.generate(prompts, params)
        llm.generate([prompts[0] + [9, 10, 11]], params)  # a prefix hit: the cached-prefix paths
    # bfloat16 (the tensor-core products) in the split query tiles a Hopper GPU runs (one position on one
    # warp for decode steps, 128 rows on eight for the others, 32 keys); the interpreter's bits differ from
    # a GPU's here, so only the launches matter
    from kvwarden.engine import model_runner
    from kvwarden.layers.kernels.attention_meta import QueryTiles

    split = QueryTiles(decode=1, prefill=64, decode_warps=1, prefill_warps=8, block_n=32)
    monkeypatch.setattr(model_runner, "query_tiles", lambda *_: split)
    llm = LLM(str(_made(models_root, "llama", "tiny")), device="cpu", kernels="triton", dtype="bfloat16")
    assert llm.engine.runner.query_tiles == split
    llm.generate(prompts, params)
    # FP8 weights dequantized per tile (the GEMM's plain and SwiGLU forms, the MoE experts), in bfloat16
    fp8 = models_root / "qwen3_moe-tiny-fp8"
    if not (fp8 / "model.safetensors").is_file():
        make_model("qwen3_moe", "tiny", 0, fp8, fp8_block=(16, 32))
    LLM(str(fp8), device="cpu", kernels="triton", dtype="bfloat16", num_blocks=64).generate(prompts, params)


def test_every_launched_kernel_lowers_for_hopper(
    models_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gpu_lowering import Launches

    with Launches() as launches:
        _top_k_forms()
        _family_runs(models_root, monkeypatch)
    names = {spec["name"] for spec in launches.specs.values()}
    # the recording is not empty: the top-k's three forms and each family's own kernels were launched
    for kernel in ("_radix_select_kernel", "_bucket_list_kernel", "_split_compact_kernel"):
        assert kernel in names, sorted(names)
    assert len(names) >= 20, sorted(names)
    recorded = tmp_path / "launches.json"
    launches.write(recorded)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")])
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # the GPU's default; silences Triton 3.9's notice
    done = subprocess.run(
        [sys.executable, "-m", "gpu_lowering", str(recorded)], capture_output=True, text=True, env=env, timeout=900
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert not result["failed"], json.dumps(result["failed"], indent=1)[:6000]
    assert result["lowered"] >= len(launches.specs)  # and each interpreter-only constant's GPU value
