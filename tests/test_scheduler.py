"""Scheduler: token budget, max_num_seqs, chunked prefill, preemption by recompute."""

from __future__ import annotations

import random
from itertools import pairwise
from pathlib import Path

from kvwarden import LLM, SamplingParams
from kvwarden.cache.block_pool import BlockPool
from kvwarden.cache.kv_cache_manager import KVCacheManager
from kvwarden.config import SchedulerConfig
from kvwarden.engine.request import Request
from kvwarden.engine.scheduler import Scheduler
from util import assert_same, random_tokens


def _scheduler(budget: int, max_seqs: int, blocks: int = 64, block_size: int = 4) -> Scheduler:
    pool = BlockPool(blocks, enable_caching=True)
    kv = KVCacheManager(pool, block_size, True)
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs), kv, block_size)


def _request(rid: str, n: int) -> Request:
    ids = list(range(100 + n, 100 + 2 * n))
    return Request(request_id=rid, all_token_ids=list(ids), prompt_token_ids=list(ids))


def _fake_sample(sched: Scheduler, out) -> None:
    for chunk in sched.update(out):
        chunk.request.append_token(7)


def test_budget_and_max_num_seqs_hold_every_step() -> None:
    sched = _scheduler(budget=10, max_seqs=2)
    reqs = [_request(f"r{i}", n) for i, n in enumerate([23, 5, 9])]
    for r in reqs:
        sched.add(r)
    seen_chunks = []
    for _ in range(40):
        out = sched.schedule()
        if not out:
            break
        assert out.num_batched_tokens <= 10
        assert len(sched.running) <= 2
        seen_chunks.append([(c.request.request_id, c.start, c.num_tokens) for c in out.chunks])
        _fake_sample(sched, out)
        for r in list(sched.running):
            if len(r.output_token_ids) >= 3:
                sched.finish(r, "length")
        sched.kv.check_integrity()
    # r0's 23-token prompt is prefilled in chunks that exactly follow num_computed_tokens
    r0 = [c for step in seen_chunks for c in step if c[0] == "r0"]
    assert r0[0] == ("r0", 0, 10)
    starts = [c[1] for c in r0]
    assert starts == sorted(starts) and all(b - a == n for (_, a, n), (_, b, _) in pairwise(r0))
    assert all(len(r.output_token_ids) == 3 for r in reqs)
    assert sched.kv.pool.num_free_blocks == 64


def test_preemption_by_recompute_keeps_outputs_identical(llama_tiny: Path) -> None:
    rng = random.Random(0)
    prompts = [random_tokens(rng, rng.randrange(20, 60), 1000) for _ in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=20, logprobs=20, ignore_eos=True)
    refs = [LLM(str(llama_tiny), enable_prefix_caching=False).generate([p], params)[0] for p in prompts]
    # 20 blocks of 8 tokens cannot hold 8 requests of ~60 tokens: requests get preempted.
    llm = LLM(str(llama_tiny), block_size=8, num_blocks=20, max_num_batched_tokens=64)
    outs = llm.generate(prompts, params)
    assert llm.engine.scheduler.num_preemptions > 0
    assert any(o.num_preemptions for o in outs)
    for ref, out in zip(refs, outs, strict=True):
        assert_same(ref, out, "after preemption")
    llm.engine.check_integrity()
    assert llm.engine.pool.num_free_blocks == 20


def test_a_request_larger_than_the_pool_finishes_with_length(llama_tiny: Path) -> None:
    llm = LLM(str(llama_tiny), block_size=4, num_blocks=4)
    out = llm.generate([list(range(3, 13))], SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))[0]
    assert out.finish_reason == "length"
    assert 0 < len(out.token_ids) < 50
    assert llm.engine.pool.num_free_blocks == 4


def test_scheduler_limits_default_by_device_and_pass_through(llama_tiny: Path) -> None:
    """Unset limits take the device's defaults (the CPU's here); given ones are kept, the CLI leaves them unset."""
    from kvwarden.commands.engine_args import add_engine_args
    from kvwarden.config import scheduler_limits

    assert scheduler_limits("cpu", None, None) == (512, 32)
    assert scheduler_limits("cpu", 100, None) == (100, 32)
    assert scheduler_limits("cpu", None, 7) == (512, 7)
    llm = LLM(str(llama_tiny), device="cpu")
    cfg = llm.engine.scheduler.config
    assert (cfg.max_num_batched_tokens, cfg.max_num_seqs) == (512, 32)
    llm = LLM(str(llama_tiny), device="cpu", max_num_batched_tokens=64, max_num_seqs=3)
    cfg = llm.engine.scheduler.config
    assert (cfg.max_num_batched_tokens, cfg.max_num_seqs) == (64, 3)
    import argparse

    p = argparse.ArgumentParser()
    add_engine_args(p)
    args = p.parse_args(["m"])
    assert args.max_num_batched_tokens is None and args.max_num_seqs is None
    helps = {a.dest: a.help for a in p._actions}
    assert "8192 on a GPU" in helps["max_num_batched_tokens"] and "256 GPU" in helps["max_num_seqs"]
