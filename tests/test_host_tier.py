"""The host tier: evicted blocks written back to host memory and loaded back layer by layer.

What must hold (invariance (k)): a request served from the host tier gives
bitwise the top-k lists of a cold run, of a device-tier hit and of no caching,
for dense and hybrid models, under concurrency, preemption, aborts in the
middle of a load and pools under pressure; both pools return to baseline.
And the wait is what makes it so: with ``unsafe_host_load`` (reads do not wait
for the copy) and an injected copy delay the logits change, and the probe says
so; with the wait, the same delay changes nothing.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import _made
from kvwarden import LLM, SamplingParams
from kvwarden.models.bundled import documents
from util import probe_arms_agree

WORDS = [w for d in documents() for w in d.text.split()]
PARAMS = SamplingParams(temperature=0.0, max_tokens=8, logprobs=5, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, seed=7, max_tokens=8, logprobs=5, ignore_eos=True)


def text(start: int, n: int) -> str:
    return " ".join(WORDS[start : start + n])


def shared_and_fillers() -> tuple[str, str, list[str]]:
    """A; B sharing A's first 120 words; fillers that push A out of a 40-block device pool."""
    a = text(0, 150)
    b = text(0, 120) + " " + text(5000, 30)
    return a, b, [text(1000 + 200 * i, 150) for i in range(4)]


def tiered(model: Path, **kw: object) -> LLM:
    return LLM(str(model), num_blocks=40, host_cache_bytes=64 << 20, **kw)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def cold(llama_tiny: Path) -> dict[str, list]:
    """Reference answers of every prompt the tests use, computed with no cache at all."""
    llm = LLM(str(llama_tiny), enable_prefix_caching=False)
    a, b, fillers = shared_and_fillers()
    prompts = [a, b, *fillers]
    return {
        "greedy": [o.logprobs for o in llm.generate(prompts, PARAMS)],
        "seeded": [o.logprobs for o in llm.generate(prompts, SEEDED)],
    }


def test_a_host_hit_equals_cold_a_device_hit_and_no_cache(llama_tiny: Path, cold: dict[str, list]) -> None:
    a, b, fillers = shared_and_fillers()
    llm = tiered(llama_tiny)
    engine = llm.engine
    llm.generate([a], PARAMS)
    device_hit = llm.generate([b], PARAMS)[0]  # A's blocks are still on the device
    assert device_hit.num_cached_tokens > 0 and engine.stats().get("prefix_cache_hits_host") == 0
    for f in fillers:
        llm.generate([f], PARAMS)
    assert engine.stats()["host_written_blocks"] > 0
    for params, key in ((PARAMS, "greedy"), (SEEDED, "seeded")):
        for f in fillers:  # push B's blocks out again
            llm.generate([f], params)
        before = engine.stats()["prefix_cache_hits_host"]
        out = llm.generate([b], params)[0]
        host_tokens = engine.stats()["prefix_cache_hits_host"] - before
        assert host_tokens >= 96, "B should have been served from the host tier"
        assert out.num_cached_tokens >= host_tokens  # cached_tokens counts both tiers
        assert out.logprobs == cold[key][1], key
    assert device_hit.logprobs == cold["greedy"][1]
    engine.check_integrity()
    assert engine.pool.num_free_blocks == engine.num_blocks


def test_the_wait_is_what_keeps_the_answer(llama_tiny: Path, cold: dict[str, list]) -> None:
    a, b, fillers = shared_and_fillers()
    results = {}
    for unsafe in (False, True):
        llm = tiered(llama_tiny, unsafe_host_load=unsafe)
        # Every load lands 300 ms late: the unsafe read comes within a millisecond or so of the submission,
        # and a margin this wide keeps the race certain on a loaded 2-core machine (at 50 ms a busy one let
        # the load land first once).
        llm.engine.host.copies.load_delay_s = 0.3
        llm.generate([a, *fillers], PARAMS)
        out = llm.generate([b], PARAMS)[0]
        assert llm.engine.stats()["prefix_cache_hits_host"] >= 96
        results[unsafe] = out.logprobs == cold["greedy"][1]
        llm.engine.check_integrity()  # even the unsafe read never frees a block a copy still uses
    assert results == {False: True, True: False}, "the safe path must match cold; the unsafe one must not"


def test_hybrid_boundary_states_travel_with_their_blocks(qwen3_next_tiny: Path) -> None:
    a, b, fillers = shared_and_fillers()
    want = LLM(str(qwen3_next_tiny), enable_prefix_caching=False).generate([b], PARAMS)[0].logprobs
    llm = LLM(str(qwen3_next_tiny), num_blocks=48, host_cache_bytes=64 << 20, block_size=32)
    llm.generate([a, *fillers], PARAMS)
    out = llm.generate([b], PARAMS)[0]
    stats = llm.engine.stats()
    assert stats["prefix_cache_hits_host"] > 0, stats
    assert out.logprobs == want
    llm.engine.check_integrity()


def test_sparse_attention_caches_travel_together_and_the_indexer_race_shows(models_root: Path) -> None:
    """GLM-5's latent KV and indexer keys are written back, found and loaded together: a host hit gives cold's
    answer, greedy and seeded. With ``unsafe_indexer_load`` only the indexer reads before its (delayed) load
    lands - the latent KV still waits, so what changes the answer is the selection (the seed's HiCache race)."""
    model = _made(models_root, "glm_moe_dsa", "tiny")
    a, b, fillers = shared_and_fillers()
    plain = LLM(str(model), enable_prefix_caching=False)
    want = {key: plain.generate([b], params)[0].logprobs for key, params in (("greedy", PARAMS), ("seeded", SEEDED))}
    results = {}
    for race in (False, True):
        llm = tiered(model, unsafe_indexer_load=race)
        assert llm.engine.host is not None
        llm.engine.host.copies.load_delay_s = 0.3  # each layer's copies land 300 ms late (see the wait test)
        llm.generate([a, *fillers], PARAMS)
        before = llm.engine.stats()["prefix_cache_hits_host"]
        out = llm.generate([b], PARAMS)[0]
        assert llm.engine.stats()["prefix_cache_hits_host"] - before >= 96, "B should come from the host tier"
        results[race] = out.logprobs == want["greedy"]
        if not race:
            for f in fillers:  # out again, then back with a seeded request
                llm.generate([f], PARAMS)
            assert llm.generate([b], SEEDED)[0].logprobs == want["seeded"]
        llm.engine.check_integrity()
        assert llm.engine.pool.num_free_blocks == llm.engine.num_blocks
    assert results == {False: True, True: False}, "the safe path must match cold; the indexer's race must not"
    with pytest.raises(ValueError, match="unsafe_indexer_load: needs a host tier"):
        LLM(str(model), unsafe_indexer_load=True)


def test_the_indexer_race_is_refused_without_an_indexer(llama_tiny: Path) -> None:
    with pytest.raises(ValueError, match="unsafe_indexer_load: the model has no sparse-attention indexer"):
        tiered(llama_tiny, unsafe_indexer_load=True)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    order=st.permutations(range(6)),
    abort_after=st.lists(st.integers(0, 4), min_size=6, max_size=6),
    aborted=st.sets(st.integers(0, 5), max_size=2),
    num_blocks=st.sampled_from([32, 48]),
)
def test_invariance_k_under_concurrency_preemption_and_aborts(
    llama_tiny: Path,
    cold: dict[str, list],
    order: list[int],
    abort_after: list[int],
    aborted: set[int],
    num_blocks: int,
) -> None:
    """Rounds of concurrent requests over a small device pool: each completed answer equals its cold run."""
    a, b, fillers = shared_and_fillers()
    prompts = [a, b, *fillers]
    llm = LLM(str(llama_tiny), num_blocks=num_blocks, host_cache_bytes=64 << 20, max_num_batched_tokens=128)
    engine = llm.engine
    for _round in range(2):
        ids = {engine.add_request(prompts[i], PARAMS): i for i in order}
        victims = {rid for rid, i in ids.items() if i in aborted}
        done: dict[str, list] = {}
        steps = 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.logprobs
            steps += 1
            for rid in list(victims):  # abort between steps, possibly right after a load was queued
                if steps > abort_after[ids[rid]]:
                    engine.abort(rid)
                    victims.discard(rid)
            engine.check_integrity()
        for rid, logprobs in done.items():  # every request that completed, aborted ones that finished first too
            assert logprobs == cold["greedy"][ids[rid]], f"prompt {ids[rid]}"
    stats = engine.stats()
    assert stats["host_written_blocks"] > 0 and stats["prefix_cache_hits_host"] > 0
    assert engine.pool.num_free_blocks == engine.num_blocks and engine.host.host.num_pinned == 0


@pytest.mark.parametrize(
    ("arch", "race", "delay_ms"),
    [("llama", "--unsafe-host-load", 50), ("glm_moe_dsa", "--unsafe-indexer-load", 300)],
    ids=["host-load", "indexer-load"],
)
def test_the_probe_catches_the_race_and_not_the_safe_path(
    arch: str, race: str, delay_ms: int, models_root: Path, tmp_path: Path
) -> None:
    """Through real servers: the host arm's B equals the cold arm's with the wait, and not with the race (every
    load skipped, or - GLM-5's incident - only the sparse-attention indexer's keys)."""
    model = _made(models_root, arch, "tiny")
    a, b, fl = shared_and_fillers()
    tier = ["--num-blocks", "40", "--host-cache-bytes", "64M", "--inject-fault", f"host-load-delay={delay_ms}"]
    verdicts = {}
    for unsafe in (False, True):
        scenario = {
            "name": "host-tier-race",
            "max_tokens": 8,
            "ignore_eos": True,
            "requests": {
                "A": {"prompt": a},
                "B": {"prompt": b},
                **{f"F{i}": {"prompt": f} for i, f in enumerate(fl)},
            },
            "arms": {
                "cold": {"server": {"prefix_caching": False}, "steps": [{"request": "B", "repeat": 2}]},
                "host": {
                    "server": {"extra_args": tier + ([race] if unsafe else [])},
                    "steps": [{"request": "A"}] + [{"request": f"F{i}"} for i in range(4)] + [{"request": "B"}],
                },
            },
            "compare_arms": ["cold", "host"],
        }
        # the host arm's B equals the cold arm's B
        verdicts[unsafe] = probe_arms_agree(model, scenario, tmp_path / f"race-{unsafe}")
    assert verdicts == {False: True, True: False}, verdicts


def test_a_server_reports_both_tiers(llama_tiny: Path) -> None:
    import httpx

    from server_util import running_server

    a, b, fillers = shared_and_fillers()
    args = ["--num-blocks", "40", "--host-cache-bytes", "64M", "--served-model-name", "tiny"]
    with running_server(str(llama_tiny), *args) as server:

        def complete(prompt: str) -> dict:
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0.0, "logprobs": 5}
            resp = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
            assert resp.status_code == 200, resp.text
            return resp.json()

        for prompt in (a, *fillers):
            complete(prompt)
        answer = complete(b)
        m = server.metrics()
        host = m['kvwarden:prefix_cache_hits_total{tier="host"}']
        assert host >= 96 and m["kvwarden:host_kv_blocks_cached"] > 0
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] >= host  # both tiers count
        assert m["kvwarden:kv_blocks_used"] == 0
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvwarden.cli",
            "serve",
            str(llama_tiny),
            "--port",
            "0",
            "--inject-fault",
            "host-load-delay=5",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2 and "--host-cache-bytes" in done.stderr, done.stderr
    done = subprocess.run(
        [sys.executable, "-m", "kvwarden.cli", "serve", str(llama_tiny), "--host-cache-bytes", "lots"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "--host-cache-bytes" in done.stderr, done.stderr


def test_copies_run_in_order_and_readers_wait_only_for_their_layer() -> None:
    import torch

    from kvwarden.cache.paged_kv import PagedKV
    from kvwarden.cache.transfer import CopyEngine, slot_runs

    assert slot_runs([5, 4, 3, 9, 10, 1], [50, 40, 30, 90, 100, 10]) == (
        [(1, 1), (3, 3), (9, 2)],
        [10, 30, 40, 50, 90, 100],
    )
    bs, gen = 4, torch.Generator().manual_seed(0)

    def layer() -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(8 * bs, 2, 3, generator=gen), torch.randn(8 * bs, 2, 3, generator=gen)

    dev, host = [layer(), layer()], [layer(), layer()]
    want = [tuple(t[2 * bs : 3 * bs].clone() for t in kv) for kv in dev]  # device block 2, every layer
    copies = CopyEngine(torch.device("cpu"), bs)
    kv = PagedKV(dev)
    # Write device block 2 to host slot 6, then load host slot 6 into device block 5: FIFO makes the load see it.
    for i, ticket in enumerate(copies.write_back(dev, [2], host, [6])):
        kv.add(i, ticket, load=False)
    copies.load_delay_s = 0.2
    for i in range(2):
        kv.add(i, copies.load(host[i], [6], dev[i], [5]), load=True)
    for i in range(2):
        k, v = kv[i]  # waits for layer i's copies
        assert torch.equal(k[5 * bs : 6 * bs], want[i][0]) and torch.equal(v[5 * bs : 6 * bs], want[i][1])
    kv.settle()
    # Unsafe: the read does not wait for a delayed load and sees the block's old contents.
    copies.load_delay_s = 2.0  # far longer than the read below takes, even on a loaded machine
    unsafe = PagedKV(dev, unsafe_loads=True)
    old = dev[0][0][7 * bs : 8 * bs].clone()
    unsafe.add(0, copies.load(host[0], [6], dev[0], [7]), load=True)
    assert torch.equal(unsafe[0][0][7 * bs : 8 * bs], old)
    unsafe.settle()  # the copy still lands, and nothing is in flight after the step
    assert torch.equal(dev[0][0][7 * bs : 8 * bs], want[0][0])
    copies.close()


def test_a_host_pool_smaller_than_one_allocation(llama_tiny: Path, cold: dict[str, list]) -> None:
    a, b, fillers = shared_and_fillers()
    # Room for 3 host blocks: one allocation's write-backs evict each other's slots before they are flushed.
    llm = tiered(llama_tiny)
    per_block = llm.engine.host.host.bytes_per_block(llm.engine.host.host.layers, 16)
    llm = LLM(str(llama_tiny), num_blocks=40, host_cache_bytes=3 * per_block)
    for _ in range(2):
        llm.generate([a, *fillers], PARAMS)
        assert llm.generate([b], PARAMS)[0].logprobs == cold["greedy"][1]
    llm.engine.check_integrity()
