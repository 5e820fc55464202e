"""Tensor and expert parallelism on CPU ranks (gloo on loopback): the answer does not depend on the number of
ranks. Every comparison is bitwise - tokens, top-20 logprobs, prompt logits - against the same engine on one
rank (``tensor_parallel_size=1``, the default engine)."""

from __future__ import annotations

import os
import random
import signal
from functools import partial
from pathlib import Path

import pytest
import torch

from conftest import _made
from kvwarden import LLM, SamplingParams
from kvwarden.bench.properties import PROPERTIES, check_properties
from kvwarden.config import NumericsConfig
from kvwarden.layers.backends import make_ops
from util import assert_same

PROMPT = [(7 * i) % 900 + 5 for i in range(45)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, logprobs=20, ignore_eos=True)
DENSE = ("llama", "qwen3", "qwen3_5", "granite_hybrid")  # no experts: no expert parallelism
SEEDED = SamplingParams(temperature=0.9, seed=11, max_tokens=6, logprobs=20, ignore_eos=True)


def _run(model: Path, world: int, **kw: object) -> tuple[list, torch.Tensor]:
    with LLM(str(model), tensor_parallel_size=world, **kw) as llm:
        outs = llm.generate([PROMPT, PROMPT[:17], PROMPT[5:30]], [GREEDY, SEEDED, SEEDED])
        return outs, llm.score(PROMPT)


def test_a_columns_bits_do_not_depend_on_how_many_columns_its_gemm_computes() -> None:
    """What sharding by output columns rests on: the CPU's GEMM gives a column slice of the weight the bits of
    those columns in the whole product (Qwen3-0.6B's q/o/gate shapes, SmolLM2's MLP, odd widths)."""
    ops = make_ops(NumericsConfig(), "cpu")
    g = torch.Generator().manual_seed(0)
    for n, k in [(2048, 1024), (1536, 576), (1000, 96), (250, 64)]:
        w, x = torch.randn(n, k, generator=g), torch.randn(9, k, generator=g)
        full = ops.linear(x, w)
        for parts in (2, 4):
            step = n // parts
            for i in range(parts):
                assert torch.equal(
                    ops.linear(x, w[i * step : (i + 1) * step].contiguous()), full[:, i * step : (i + 1) * step]
                )


@pytest.mark.parametrize(
    ("arch", "worlds"),
    [
        ("llama", (2, 4)),
        ("qwen3", (2,)),
        ("qwen3_moe", (2,)),
        ("glm_moe_dsa", (2, 4)),
        ("deepseek_v32", (2,)),
        ("qwen3_next", (2,)),
        ("qwen3_5", (2,)),
        ("granite_hybrid", (2,)),
        ("granite_hybrid_moe", (2,)),
    ],
)
def test_tp_ranks_give_the_single_rank_answer_bitwise(models_root: Path, arch: str, worlds: tuple[int, ...]) -> None:
    """Greedy and seeded requests batched together, and every prompt position's logits: TP 2 (and 4 for Llama,
    whose tiny preset has 4 query heads over 2 KV heads: KV heads replicated on 4 ranks) equal TP 1. A MoE
    model's experts are sharded whole (``enable_expert_parallel``); GLM-5 / DeepSeek-V3.2's latent heads are
    split, their latent cache, indexer and selection whole on every rank."""
    model = _made(models_root, arch, "tiny")
    ref_outs, ref_scores = _run(model, 1)
    for world in worlds:
        outs, scores = _run(model, world, enable_expert_parallel=arch not in DENSE)
        for ref, out in zip(ref_outs, outs, strict=True):
            assert_same(ref, out, f"{arch} on {world} ranks")
        assert torch.equal(scores, ref_scores)


def test_a_hybrid_on_four_ranks_gives_the_single_rank_answer(models_root: Path) -> None:
    """The hybrid's 4-rank case: Qwen3-Next's small preset has 4 gated-DeltaNet key heads (one group per
    rank), 8 experts (2 per rank) and 2 KV heads (replicated on 4 ranks)."""
    model = _made(models_root, "qwen3_next", "small")
    ref_outs, ref_scores = _run(model, 1)
    outs, scores = _run(model, 4, enable_expert_parallel=True)
    for ref, out in zip(ref_outs, outs, strict=True):
        assert_same(ref, out, "qwen3_next-small on 4 ranks")
    assert torch.equal(scores, ref_scores)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_next"])
def test_tp2_keeps_every_invariance_property_against_one_rank(models_root: Path, arch: str) -> None:
    """(a)-(i) on two ranks, each compared with the single-rank engine's cold run. The hybrid's prefix hits
    restore state snapshots and its boundaries are captured on every rank (rank 0's state calls replayed)."""
    model = str(_made(models_root, arch, "tiny"))
    rng = random.Random(2)
    prompt = [rng.randrange(3, 1000) for _ in range(37)]
    partners = [[rng.randrange(3, 1000) for _ in range(n)] for n in (9, 21, 14)]
    params = SamplingParams(temperature=0.8, seed=5, max_tokens=4, logprobs=5, ignore_eos=True)
    common = dict(block_size=16, max_num_batched_tokens=64, num_blocks=64)
    reference = LLM(model, enable_prefix_caching=False, **common).generate([prompt], params)[0]
    make = partial(LLM, model, tensor_parallel_size=2, enable_expert_parallel=arch not in DENSE, **common)
    report = check_properties(make, prompt, params, 16, partners, reference=reference)
    assert set(report.outcomes) == set(PROPERTIES)
    assert report.all_identical, report.failures()


@pytest.mark.parametrize(("arch", "method"), [("llama", "ngram"), ("llama", "draft"), ("qwen3_next", "ngram")])
def test_speculation_on_two_ranks_equals_one_rank_without_it(models_root: Path, arch: str, method: str) -> None:
    """(j) across rank counts: n-gram drafts, and a draft model (the model itself: every draft accepted); on
    the hybrid, rejected drafts roll every rank's recurrent states back."""
    model = str(_made(models_root, arch, "tiny"))
    motif = [17, 400, 23, 901, 5, 66]
    prompt = (motif * 7)[:40]
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=20, ignore_eos=True)
    ref = LLM(model).generate([prompt], params)[0]
    spec = {"method": method, "num_speculative_tokens": 3} | ({"model": model} if method == "draft" else {})
    with LLM(model, tensor_parallel_size=2, enable_expert_parallel=arch not in DENSE, speculative_config=spec) as llm:
        assert_same(ref, llm.generate([prompt], params)[0], f"{method} speculation on 2 ranks")
        drafted = llm.engine.stats()["spec_num_draft_tokens"]
    assert drafted > 0 or method == "ngram"  # n-gram lookup proposes only where the text repeats itself


def test_through_the_server_and_the_official_client(models_root: Path) -> None:
    """``kvwarden serve --tensor-parallel-size 2`` answers what one rank answers, streamed and not."""
    import openai

    from server_util import running_server

    model = str(_made(models_root, "llama", "tiny"))
    answers = {}
    for world in ("1", "2"):
        with running_server(model, "--tensor-parallel-size", world, "--served-model-name", "m") as server:
            client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
            done = client.completions.create(model="m", prompt=PROMPT, max_tokens=5, temperature=0.0, logprobs=5)
            chunks = client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "tell me"}], max_tokens=5, temperature=0.7,
                seed=3, logprobs=True, top_logprobs=3, stream=True,
            )  # fmt: skip
            streamed = [(c.choices[0].delta.content, c.choices[0].logprobs) for c in chunks if c.choices]
            answers[world] = (done.choices[0].text, done.choices[0].logprobs.top_logprobs, repr(streamed))
            metrics = server.metrics()
            assert metrics["kvwarden:tensor_parallel_size"] == float(world)
            assert (metrics["kvwarden:tensor_parallel_gathered_bytes"] > 0) == (world == "2")
    assert answers["1"] == answers["2"]


def test_a_killed_rank_fails_the_next_step_naming_it(models_root: Path) -> None:
    llm = LLM(str(_made(models_root, "llama", "tiny")), tensor_parallel_size=2)
    try:
        llm.generate([PROMPT], GREEDY)
        worker = llm.engine.parallel.workers.procs[0]
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait(timeout=10)
        with pytest.raises(RuntimeError, match=r"tensor-parallel rank 1 exited with code -9"):
            llm.generate([PROMPT[:20]], GREEDY)
        with pytest.raises(RuntimeError, match="tensor-parallel ranks are stopped"):
            llm.generate([PROMPT[:20]], GREEDY)
    finally:
        llm.close()


@pytest.mark.parametrize(
    ("arch", "kw", "message"),
    [
        ("qwen3_next", {"tensor_parallel_size": 4}, r"4 does not divide linear_num_key_heads \(2\)"),
        ("granite_hybrid", {"tensor_parallel_size": 4}, r"4 must divide mamba_n_groups \(2\) and mamba_n_heads"),
        ("qwen3_moe", {}, r"pass enable_expert_parallel \(--enable-expert-parallel\)"),
        ("llama", {"tensor_parallel_size": 3}, r"3 does not divide num_attention_heads \(4\)"),
        ("llama", {"enable_expert_parallel": True}, r"enable_expert_parallel: the model has no experts"),
        ("llama", {"speculative_config": {"method": "mtp", "num_speculative_tokens": 1}}, r"MTP speculation"),
        ("llama", {"host_cache_bytes": 1 << 20}, r"not supported with the host tier"),
    ],
)
def test_what_is_not_sharded_yet_is_refused_by_name(models_root: Path, arch: str, kw: dict, message: str) -> None:
    kw = {"tensor_parallel_size": 2, **kw}
    with pytest.raises(ValueError, match=message):
        LLM(str(_made(models_root, arch, "tiny")), **kw)


def test_the_flags_are_checked(models_root: Path) -> None:
    with pytest.raises(ValueError, match=r"tensor_parallel_size: must be an integer >= 1, got 0"):
        LLM(str(_made(models_root, "llama", "tiny")), tensor_parallel_size=0)
    with pytest.raises(ValueError, match=r"enable_expert_parallel: needs tensor_parallel_size >= 2"):
        LLM(str(_made(models_root, "qwen3_moe", "tiny")), enable_expert_parallel=True)


def test_the_bench_prints_both_exchanges_and_the_same_tokens_at_each_rank_count(models_root: Path) -> None:
    import json
    import subprocess
    import sys

    model = str(_made(models_root, "llama", "tiny"))
    cmd = [sys.executable, "-m", "kvwarden.bench.tensor_parallel", "--model", model, "--ranks", "1", "2",
           "--batch", "1", "4", "--input-len", "16", "--output-len", "4", "--prefill-len", "32"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert [r["ranks"] for r in result["engine"]] == [1, 2]
    assert all(r["same_tokens_b1"] and r["same_tokens_b4"] for r in result["engine"])
    assert [r["batch"] for r in result["exchange"]] == [1, 4]
    assert all(r["gather_ms"] > 0 and r["allreduce_ms"] > 0 for r in result["exchange"])


def test_a_disaggregated_role_is_refused_on_several_ranks(models_root: Path) -> None:
    # rank 0 holds only its own heads' KV blocks and recurrent states: nothing whole to transfer
    import subprocess
    import sys

    model = str(_made(models_root, "llama", "tiny"))
    cmd = [sys.executable, "-m", "kvwarden", "serve", model, "--role", "decode", "--tensor-parallel-size", "2"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--tensor-parallel-size: not supported with --role decode" in done.stderr
