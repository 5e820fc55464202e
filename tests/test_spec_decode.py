"""Speculative decoding never changes the answer (property (j)), and reports its acceptance.

The reference is always the same request with speculation off; speculation on
must give the same token ids and top-20 logprobs, bit for bit, for every
proposer (MTP head, draft model, n-gram), k in 1..4, greedy and seeded, dense
and both hybrid families, under partners, budgets, prefix caching and preemption.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvwarden import LLM, SamplingParams
from kvwarden.bench.properties import check_properties
from util import assert_same, random_tokens

PROPERTY = settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
BLOCK = 16
MEM = 32 * 1024 * 1024  # a small KV pool: engines are built by the dozen here


@pytest.fixture(scope="module")
def families(llama_tiny: Path, qwen3_next_tiny: Path, models_root: Path) -> dict[str, Path]:
    from kvwarden.models.make_model import make_model

    granite = models_root / "granite_hybrid-tiny-s0"
    if not (granite / "model.safetensors").is_file():
        make_model("granite_hybrid", "tiny", 0, granite)
    return {"llama": llama_tiny, "qwen3_next": qwen3_next_tiny, "granite_hybrid": granite}


@pytest.fixture(scope="module")
def other_draft(models_root: Path) -> Path:
    """A different small model with the same (bundled-text) tokenizer: mostly wrong drafts."""
    from kvwarden.models.make_model import make_model

    out = models_root / "llama-tiny-s7"
    if not (out / "model.safetensors").is_file():
        make_model("llama", "tiny", 7, out)
    return out


def _params(seeded: bool, seed: int, max_tokens: int = 12) -> SamplingParams:
    if seeded:
        return SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=seed, max_tokens=max_tokens, logprobs=20)
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=20, ignore_eos=True)


def _repetitive(rng: random.Random, n: int) -> list[int]:
    """A prompt whose tail repeats earlier n-grams, so the n-gram proposer has something to propose."""
    motif = random_tokens(rng, rng.randint(3, 9), 1000)
    out: list[int] = []
    while len(out) < n:
        out += motif if rng.random() < 0.7 else random_tokens(rng, 3, 1000)
    return out[:n]


def _spec(method: str, k: int, model: Path, draft: Path) -> dict:
    spec: dict = {"method": method, "num_speculative_tokens": k}
    if method == "draft":
        spec["model"] = str(draft)
    return spec


@given(
    family=st.sampled_from(["llama", "qwen3_next", "granite_hybrid"]),
    method=st.sampled_from(["ngram", "draft", "mtp"]),
    self_draft=st.booleans(),
    k=st.integers(1, 4),
    seeded=st.booleans(),
    seed=st.integers(0, 2**16),
    prompt_len=st.integers(2 * BLOCK + 1, 4 * BLOCK),
)
@PROPERTY
def test_j_speculation_on_equals_speculation_off(
    families: dict[str, Path],
    other_draft: Path,
    family: str,
    method: str,
    self_draft: bool,
    k: int,
    seeded: bool,
    seed: int,
    prompt_len: int,
) -> None:
    if method == "mtp" and family != "qwen3_next":
        method = "ngram"  # only Qwen3-Next checkpoints carry an MTP head
    model = families[family]
    draft = model if self_draft else other_draft
    rng = random.Random(seed)
    prompt = _repetitive(rng, prompt_len)
    partners = [_repetitive(rng, rng.randint(5, 40)) for _ in range(3)]
    params = _params(seeded, seed)
    reference = LLM(str(model), enable_prefix_caching=False, block_size=BLOCK, kv_cache_memory=MEM)
    ref = reference.generate([prompt], params)[0]
    spec = _spec(method, k, model, draft)

    def make(**overrides: object) -> LLM:
        kw = {"block_size": BLOCK, "kv_cache_memory": MEM, "speculative_config": spec, **overrides}
        return LLM(str(model), **kw)  # type: ignore[arg-type]

    # (a) and (i) compare speculation-on runs with each other; the rest compare them with speculation off
    only = ("b", "c", "d", "e", "f", "g", "h")
    report = check_properties(make, prompt, params, BLOCK, partners, only=only, reference=ref)
    assert report.all_identical, report.failures()


@pytest.mark.parametrize("family", ["llama", "qwen3_next", "granite_hybrid"])
def test_every_proposer_and_k_equals_speculation_off_and_drafts(
    families: dict[str, Path], other_draft: Path, family: str
) -> None:
    """A fixed sweep beside the property: each proposer, k = 1..4, greedy and seeded; drafts were scored."""
    model = families[family]
    rng = random.Random(11)
    prompts = [_repetitive(rng, 40), _repetitive(rng, 23), random_tokens(rng, 30, 1000)]
    methods = ["ngram", "draft"] + (["mtp"] if family == "qwen3_next" else [])
    for seeded, ks in ((False, (1, 4)), (True, (2, 3))):
        params = [_params(seeded, 100 + i, 16) for i in range(len(prompts))]
        ref = LLM(str(model), kv_cache_memory=MEM).generate(prompts, params)
        for method in methods:
            for k in ks:
                llm = LLM(str(model), kv_cache_memory=MEM, speculative_config=_spec(method, k, model, model))
                outs = llm.generate(prompts, params)
                for r, o in zip(ref, outs, strict=True):
                    assert_same(r, o, f"{family} {method} k={k} seeded={seeded}")
                drafts = sum(o.spec_stats.num_draft_tokens for o in outs if o.spec_stats)
                # n-gram lookup proposes only when the text repeats itself (test_ngram_lookup below)
                assert drafts > 0 or method == "ngram", f"{family} {method} k={k}: nothing was proposed"
                _assert_baseline(llm)


def test_ngram_lookup_proposes_what_followed_the_latest_match() -> None:
    from kvwarden.engine.spec.proposers import NgramProposer

    lookup = NgramProposer(1, 3).lookup
    assert lookup([1, 2, 3, 4, 9, 2, 3], 2) == [4, 9]  # "2 3" seen before, followed by 4 9
    assert lookup([1, 2, 3, 4, 5, 2, 3, 7, 9, 2, 3], 3) == [7, 9, 2]  # the latest match wins
    assert lookup([5, 6, 7, 1, 2, 3, 8, 6, 7], 4) == [1, 2, 3, 8]  # the longest n-gram first
    assert lookup([1, 2, 3], 2) == []
    assert NgramProposer(2, 3).lookup([1, 9, 4, 1], 2) == []  # a 1-gram match is below prompt_lookup_min


def _assert_baseline(llm: LLM) -> None:
    engine = llm.engine
    engine.check_integrity()
    assert engine.pool.num_free_blocks == engine.num_blocks, "KV blocks leaked"
    if engine.states is not None:
        assert engine.states.num_free_working == engine.states.num_working, "state slots leaked"
        assert not engine.states._checkpoints, "a speculation checkpoint outlived its step"


def test_self_draft_accepts_every_greedy_token_and_reports_it(families: dict[str, Path]) -> None:
    model = families["qwen3_next"]
    prompt = random_tokens(random.Random(5), 37, 1000)
    params = SamplingParams(temperature=0.0, max_tokens=21, ignore_eos=True)
    out = LLM(str(model), speculative_config=_spec("draft", 4, model, model)).generate([prompt], params)[0]
    stats = out.spec_stats
    assert stats is not None
    assert stats.num_accepted_tokens == stats.num_draft_tokens > 0
    assert stats.accept_rate == 1.0
    # 21 tokens: one from the prefill step, then 4 verify steps of 5 (the last capped by max_tokens)
    assert stats.num_drafts == 4 and stats.accept_length == 1 + stats.num_accepted_tokens / 4
    assert LLM(str(model)).generate([prompt], params)[0].spec_stats is None


def test_rejection_acceptance_is_lossless_for_greedy_and_labelled_otherwise(families: dict[str, Path]) -> None:
    model = families["granite_hybrid"]
    prompt = _repetitive(random.Random(2), 40)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "acceptance": "rejection"}
    greedy = _params(False, 0, 16)
    assert_same(
        LLM(str(model)).generate([prompt], greedy)[0],
        LLM(str(model), speculative_config=spec).generate([prompt], greedy)[0],
    )
    seeded = [_params(True, s, 16) for s in range(6)]
    llm = LLM(str(model), speculative_config=spec)
    outs = llm.generate([prompt] * 6, seeded)
    assert all(len(o.token_ids) == 16 for o in outs)
    _assert_baseline(llm)


def test_abort_and_preemption_during_speculation_leave_the_pools_at_baseline(families: dict[str, Path]) -> None:
    for family in ("llama", "qwen3_next"):
        model = families[family]
        rng = random.Random(4)
        prompts = [_repetitive(rng, 30 + 5 * i) for i in range(6)]
        params = [_params(i % 2 == 1, i, 24) for i in range(6)]
        ref = LLM(str(model), kv_cache_memory=MEM).generate(prompts, params)
        # a pool too small for everyone: requests are preempted while they speculate
        need = -(-(30 + 25 + 24) // BLOCK) + 2
        llm = LLM(str(model), num_blocks=need + 2, speculative_config=_spec("draft", 3, model, model))
        outs = llm.generate(prompts, params)
        assert llm.engine.scheduler.num_preemptions > 0
        for r, o in zip(ref, outs, strict=True):
            assert_same(r, o, f"{family} preempted while speculating")
        _assert_baseline(llm)
        # aborts after a few verify steps, and bad input beside them
        engine = llm.engine
        ids = [engine.add_request(p, q) for p, q in zip(prompts, params, strict=True)]
        for _ in range(4):
            engine.step()
        with pytest.raises(ValueError, match="prompt"):
            engine.add_request([10**9], params[0])
        for rid in ids[::2]:
            engine.abort(rid)
        while engine.has_unfinished_requests():
            engine.step()
        _assert_baseline(llm)
        proposer = llm.engine.speculator.proposer  # type: ignore[union-attr]
        draft = proposer.draft  # type: ignore[union-attr]
        assert not proposer.shadows  # type: ignore[union-attr]
        assert draft.pool.num_free_blocks == draft.num_blocks, "draft-model KV blocks leaked"


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({"method": "eagle", "num_speculative_tokens": 2}, "method"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": -1}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": "2"}, "num_speculative_tokens"),
        ({"method": "ngram"}, "num_speculative_tokens"),
        ({"method": "draft", "num_speculative_tokens": 2}, "model"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
            "prompt_lookup_min",
        ),
        ({"method": "ngram", "num_speculative_tokens": 2, "acceptance": "typical"}, "acceptance"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1},
            "draft_tensor_parallel_size",
        ),
    ],
)
def test_bad_speculative_config_names_the_field(families: dict[str, Path], spec: dict, field: str) -> None:
    with pytest.raises(ValueError, match=rf"speculative_config\.{field}"):
        LLM(str(families["llama"]), speculative_config=spec)


def test_a_draft_without_the_targets_vocabulary_or_a_model_without_mtp_is_refused(
    families: dict[str, Path], llama_small: Path
) -> None:
    with pytest.raises(ValueError, match=r"speculative_config\.model: .* another vocabulary"):
        LLM(
            str(families["llama"]),
            speculative_config={"method": "draft", "model": str(llama_small), "num_speculative_tokens": 2},
        )
    with pytest.raises(ValueError, match=r"speculative_config\.method: 'mtp' needs a multi-token-prediction head"):
        LLM(str(families["llama"]), speculative_config={"method": "mtp", "num_speculative_tokens": 2})


def test_canonical_contamination_with_mtp_is_stable_and_equal_to_speculation_off(families: dict[str, Path]) -> None:
    """The seed's scenario with speculation really on (kvwarden's defaults): nothing moves."""
    model = families["qwen3_next"]
    rng = random.Random(7)
    doc = random_tokens(rng, 24, 1000)
    a, b = doc + random_tokens(rng, 4, 1000), doc + random_tokens(rng, 20, 1000)
    params = _params(False, 0, 8)
    off = LLM(str(model)).generate([b], params)[0]
    llm = LLM(str(model), speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    llm.generate([a], params)
    runs = [llm.generate([b], params)[0] for _ in range(4)]
    assert any(r.num_cached_tokens > 0 for r in runs)
    for i, run in enumerate(runs):
        assert_same(off, run, f"B run {i} after A, MTP on")


def test_the_mtp_heads_cache_is_counted_in_the_pool_budget(families: dict[str, Path]) -> None:
    # The head's attention layer keeps K/V for every pool slot: a pool sized without it overcommits the
    # budget (on a GPU at gpu_memory_utilization, the head's allocation ran out of memory).
    from kvwarden.cache.state_pool import StatePool
    from kvwarden.engine.model_runner import kv_bytes_per_block

    budget = 8 * 1024 * 1024
    plain = LLM(str(families["qwen3_next"]), kv_cache_memory=budget).engine
    mtp = LLM(
        str(families["qwen3_next"]),
        kv_cache_memory=budget,
        speculative_config={"method": "mtp", "num_speculative_tokens": 2},
    ).engine
    model, block = plain.loaded.model, plain.config.cache.block_size
    per_block = kv_bytes_per_block(model, block) + StatePool.snapshot_bytes(model.recurrent_specs())
    one_layer = kv_bytes_per_block(model, block) // model.num_attention_layers
    assert plain.num_blocks == budget // per_block
    assert mtp.num_blocks == budget // (per_block + one_layer) < plain.num_blocks
