"""Hybrid invariance: (a)-(g) of the engine core, (h) the contamination scenario,
(i) multi-turn follow-ups; and the production bug re-created on demand.

Floats are compared by their bytes; no tolerance anywhere.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvwarden import LLM, RequestOutput, SamplingParams
from kvwarden.probe.fingerprint import first_divergence
from util import assert_same, exact, random_tokens

PROPERTY = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _params(seeded: bool, seed: int, max_tokens: int = 8) -> SamplingParams:
    if seeded:
        return SamplingParams(temperature=0.9, top_k=40, seed=seed, max_tokens=max_tokens, logprobs=20, ignore_eos=True)
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=20, ignore_eos=True)


def _cold(model: Path, prompt: list[int], params: SamplingParams, **kw: object) -> RequestOutput:
    return LLM(str(model), enable_prefix_caching=False, **kw).generate([prompt], params)[0]


@given(
    prompt_len=st.integers(1, 140),
    shared=st.integers(0, 140),
    block_size=st.sampled_from([16, 32]),
    budget_extra=st.integers(0, 150),
    seeded=st.booleans(),
    seed=st.integers(0, 2**31),
)
@PROPERTY
def test_hybrid_prefix_hits_budgets_and_caching_off(
    hybrid_tiny: Path, prompt_len: int, shared: int, block_size: int, budget_extra: int, seeded: bool, seed: int
) -> None:
    rng = random.Random(seed)
    prompt = random_tokens(rng, prompt_len, 1000)
    params = _params(seeded, seed)
    ref = _cold(hybrid_tiny, prompt, params)
    llm = LLM(str(hybrid_tiny), block_size=block_size, max_num_batched_tokens=block_size + budget_extra)
    llm.generate([prompt[: min(shared, prompt_len)] + random_tokens(rng, 7, 1000)], _params(False, 0, 3))
    assert_same(ref, llm.generate([prompt], params)[0], "after a request sharing a prefix")
    warm = llm.generate([prompt], params)[0]
    assert_same(ref, warm, "warm repeat")
    if prompt_len > block_size:
        # every block boundary has a state, so the hit is as long as for a dense model
        assert warm.num_cached_tokens == (prompt_len - 1) // block_size * block_size
    llm.engine.check_integrity()


@given(
    prompt_len=st.integers(1, 120),
    partner_lens=st.lists(st.integers(1, 90), max_size=20),
    joins=st.lists(st.integers(0, 10), max_size=20),
    aborts=st.lists(st.integers(0, 14), max_size=20),
    budget=st.integers(16, 200),
    seed=st.integers(0, 2**31),
)
@PROPERTY
def test_hybrid_batch_partners(
    hybrid_tiny: Path,
    prompt_len: int,
    partner_lens: list[int],
    joins: list[int],
    aborts: list[int],
    budget: int,
    seed: int,
) -> None:
    rng = random.Random(seed)
    prompt = random_tokens(rng, prompt_len, 1000)
    params = _params(seed % 2 == 0, seed, max_tokens=8)
    ref = _cold(hybrid_tiny, prompt, params)
    llm = LLM(str(hybrid_tiny), max_num_batched_tokens=budget, max_num_seqs=32)
    engine = llm.engine
    assert engine.states is not None
    free_slots, free_blocks = engine.states.num_free_working, engine.pool.num_free_blocks
    target = engine.add_request(prompt, params)
    live: dict[int, str] = {}
    result = None
    for step in range(400):
        for i, n in enumerate(partner_lens):
            if (joins[i] if i < len(joins) else 0) == step:
                live[i] = engine.add_request(random_tokens(rng, n, 1000), _params(True, i, 5))
            if i < len(aborts) and aborts[i] == step and i in live:
                engine.abort(live.pop(i))
        for out in engine.step():
            if out.request_id == target and out.finished:
                result = out
        if result is not None:
            break
    while engine.has_unfinished_requests():
        engine.step()
    assert result is not None
    assert_same(ref, result, "among partners")
    engine.check_integrity()
    assert engine.states.num_free_working == free_slots
    assert engine.pool.num_free_blocks == free_blocks


def _spec_method(model: Path) -> str:
    return "mtp" if "qwen3_next" in model.name else "ngram"


def _contamination(model: Path, a_len: int, chunking: str, numerics: str, block: int = 16, b_len: int = 44):
    """The contamination scenario (docs/production-story.md §1) at small scale.

    A once, then B ten times; both share the first 24 tokens.
    """
    rng = random.Random(7)
    doc = random_tokens(rng, 24, 1000)
    a = doc + random_tokens(rng, a_len - len(doc), 1000)
    b = doc + random_tokens(rng, b_len - len(doc), 1000)
    kw = {
        "block_size": block,
        "chunking": chunking,
        "numerics": numerics,
        # Speculation on, as in production (its pull-back is part of the align rule): Qwen3-Next's own
        # MTP head, n-gram lookup for Granite (no head).
        "speculative_config": {"method": _spec_method(model), "num_speculative_tokens": 1},
    }
    params = _params(False, 0, 6)
    cold = LLM(str(model), max_num_batched_tokens=512, **kw).generate([b], params)[0]
    llm = LLM(str(model), max_num_batched_tokens=512, **kw)
    llm.generate([a], params)
    runs = [llm.generate([b], params)[0] for _ in range(10)]
    llm.engine.check_integrity()
    return cold, runs


@pytest.mark.parametrize("chunking", ["kvwarden", "legacy-align", "legacy-align-fixed"])
def test_h_contamination_scenario_is_harmless_with_canonical_numerics(hybrid_tiny: Path, chunking: str) -> None:
    cold, runs = _contamination(hybrid_tiny, a_len=28, chunking=chunking, numerics="canonical")
    assert any(r.num_cached_tokens > 0 for r in runs)
    for i, run in enumerate(runs):
        assert_same(cold, run, f"B run {i} after A ({chunking})")


def test_legacy_rule_with_vendor_numerics_shows_the_production_symptom(hybrid_tiny: Path) -> None:
    cold, runs = _contamination(hybrid_tiny, a_len=28, chunking="legacy-align", numerics="shape-dependent")
    first = runs[0]
    assert first.num_cached_tokens == 0, "A saved no state at the shared boundary: B's first run is cold"
    assert exact(first.logprobs) == exact(cold.logprobs)
    for run in runs[1:]:
        assert run.num_cached_tokens == 16  # A's KV + B's own state at 16
        assert first_divergence(cold.logprobs, run.logprobs) == 0, "differs from the first generated token"
        assert exact(run.logprobs) == exact(runs[1].logprobs)


def test_a_slightly_longer_saves_the_state_and_the_symptom_disappears(hybrid_tiny: Path) -> None:
    cold, runs = _contamination(hybrid_tiny, a_len=33, chunking="legacy-align", numerics="shape-dependent")
    assert runs[0].num_cached_tokens == 16  # A's own chunk ended at 16 and saved the state there
    for run in runs:
        assert exact(run.logprobs) == exact(cold.logprobs)


def test_the_one_line_fix_makes_repeats_stable(hybrid_tiny: Path) -> None:
    cold, runs = _contamination(hybrid_tiny, a_len=28, chunking="legacy-align-fixed", numerics="shape-dependent")
    for run in runs:
        assert exact(run.logprobs) == exact(cold.logprobs)


def test_i_multi_turn_follow_up_cold_and_warm(hybrid_tiny: Path) -> None:
    rng = random.Random(3)
    first = random_tokens(rng, 53, 1000)
    params = _params(False, 0, 12)
    llm = LLM(str(hybrid_tiny), max_num_batched_tokens=40)
    answer = llm.generate([first], params)[0]
    follow = first + answer.token_ids + random_tokens(rng, 9, 1000)
    warm = llm.generate([follow], params)[0]
    assert warm.num_cached_tokens >= 64, "blocks finished during decode are reused"
    assert_same(_cold(hybrid_tiny, follow, params), warm, "multi-turn follow-up")


def test_preemption_and_aborts_return_state_slots(hybrid_tiny: Path) -> None:
    rng = random.Random(5)
    prompts = [random_tokens(rng, rng.randrange(20, 70), 1000) for _ in range(6)]
    params = _params(False, 0, 16)
    refs = [_cold(hybrid_tiny, p, params) for p in prompts]
    llm = LLM(str(hybrid_tiny), num_blocks=14, max_num_batched_tokens=64, max_num_seqs=4)
    engine = llm.engine
    assert engine.states is not None
    outs = llm.generate(prompts, params)
    assert engine.scheduler.num_preemptions > 0
    for ref, out in zip(refs, outs, strict=True):
        assert_same(ref, out, "after preemption")
    doomed = [engine.add_request(p, params) for p in prompts[:3]]
    engine.step()
    engine.step()
    for rid in doomed:
        engine.abort(rid)
    with pytest.raises(ValueError, match="prompt"):
        engine.add_request([5, 10**7], params)
    engine.check_integrity()
    assert engine.states.num_free_working == 4
    assert engine.pool.num_free_blocks == 14


def test_block_size_must_be_a_multiple_of_the_scan_chunk(hybrid_tiny: Path) -> None:
    with pytest.raises(ValueError, match="block_size: 24 must be a multiple"):
        LLM(str(hybrid_tiny), block_size=24)
