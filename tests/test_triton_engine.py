"""The whole engine on the Triton backend: the invariance properties (a)-(i), bitwise.

With a GPU this is the real thing (``device="cuda"``, float32 and bfloat16).
Without one, CI runs the very same kernels through the engine under Triton's
interpreter (``kernels="triton"``, ``TRITON_INTERPRET=1`` from ``conftest.py``):
slow, so tiny models, short prompts and a few tokens - enough to exercise every
kernel, the attention plan, the recurrent scans' boundary captures and the
sampler's counter-based draws inside the real scheduler and caches.
"""

from __future__ import annotations

import random
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import _made
from kvwarden import LLM, SamplingParams
from kvwarden.bench.properties import PROPERTIES, check_properties
from util import random_tokens

GPU = torch.cuda.is_available()
BLOCK = 8
DTYPES = ["float32", "bfloat16"] if GPU else ["float32"]


def _make(model: Path, dtype: str):
    backend = {"device": "cuda"} if GPU else {"device": "cpu", "kernels": "triton"}
    # an explicit pool: engines of one check live side by side, and GPU sizing would give each the whole card
    return partial(LLM, str(model), dtype=dtype, block_size=BLOCK, max_num_batched_tokens=64, num_blocks=256, **backend)


def _case(seed: int) -> tuple[list[int], list[list[int]]]:
    rng = random.Random(seed)
    prompt = random_tokens(rng, 2 * BLOCK + 5, 1000)  # three blocks, the last one partial
    partners = [random_tokens(rng, n, 1000) for n in (9, 13, 6)]
    return prompt, partners


@pytest.mark.parametrize("dtype", DTYPES)
def test_dense_model_every_property(llama_tiny: Path, dtype: str) -> None:
    prompt, partners = _case(1)
    for params in (
        SamplingParams(temperature=0.0, max_tokens=3, logprobs=5, ignore_eos=True),
        SamplingParams(temperature=0.9, top_p=0.9, top_k=40, seed=7, max_tokens=3, logprobs=5, ignore_eos=True),
    ):
        report = check_properties(_make(llama_tiny, dtype), prompt, params, BLOCK, partners)
        assert set(report.outcomes) == set(PROPERTIES)
        assert report.all_identical, report.failures()
        assert "cached 16 tokens" in report.outcomes["b"].note  # the repeat really was a prefix hit
        assert "0 preemptions" not in report.outcomes["g"].note  # and (g) really preempted


@pytest.mark.parametrize("dtype", DTYPES)
def test_hybrid_models_every_property(hybrid_tiny: Path, dtype: str) -> None:
    """Gated DeltaNet (Qwen3-Next) and Mamba2 (Granite): recurrent states restored from boundary snapshots
    the token-by-token kernel captured, against the cold run."""
    prompt, partners = _case(2)
    params = SamplingParams(temperature=0.8, seed=11, max_tokens=3, logprobs=5, ignore_eos=True)
    only = PROPERTIES if GPU else ("b", "c", "e", "f", "h", "i")  # the interpreter is slow: the cache properties
    report = check_properties(_make(hybrid_tiny, dtype), prompt, params, BLOCK, partners, only)
    assert report.all_identical, report.failures()
    assert "cached 16 tokens" in report.outcomes["b"].note  # a hybrid hit: KV blocks and the state at 16


# On the CPU the draft proposer runs in test_verify_graphs_equal_speculation_off only (the interpreter is slow).
@pytest.mark.parametrize("method", ["draft", "mtp"] if GPU else ["mtp"])
def test_speculation_on_the_triton_backend_equals_speculation_off(qwen3_next_tiny: Path, method: str) -> None:
    """(j) on the token-by-token recurrent kernels: verify steps, rollbacks and the MTP head's own KV."""
    prompt, partners = _case(3)
    params = SamplingParams(temperature=0.8, seed=5, max_tokens=4, logprobs=5, ignore_eos=True)
    make = _make(qwen3_next_tiny, "bfloat16" if GPU else "float32")
    reference = make(enable_prefix_caching=False).generate([prompt], params)[0]
    spec = {"method": method, "num_speculative_tokens": 2}
    if method == "draft":
        spec["model"] = str(qwen3_next_tiny)  # its own draft: every draft accepted, no rollback
    only = PROPERTIES if GPU else ("b", "f")
    report = check_properties(partial(make, speculative_config=spec), prompt, params, BLOCK, partners, only, reference)
    assert report.all_identical, report.failures()


def test_triton_kernels_on_a_cpu_need_the_interpreter(llama_tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        LLM(str(llama_tiny), device="cpu", kernels="triton")
    with pytest.raises(ValueError, match=r"numerics\.kernels"):
        LLM(str(llama_tiny), kernels="cuda-graphs")
    if not GPU:
        with pytest.raises(ValueError, match="no CUDA device"):
            LLM(str(llama_tiny), device="cuda")


@pytest.mark.parametrize("family", ["dense", "qwen3_next", "granite_hybrid", "glm_moe_dsa"])
def test_decode_graphs_replay_the_eager_step_bit_for_bit(family: str, llama_tiny: Path, models_root: Path) -> None:
    """Pure decode steps through the CUDA-graph path (captured on a GPU; on the CPU the same padded
    static-buffer step, uncaptured) against every step eager: batch sizes padded up (5 -> 8, 3 -> 4),
    requests finishing at different steps, chunked prefills beside decodes, preemption in a small pool.
    Hybrids: recurrent states through the static slot buffer (padding rows in the scratch slot), block
    boundaries reached during graph steps staged for the prefix cache, sparse MoE routed on the device.
    Sparse attention (GLM-5): the key table built on the device as wide as the longest context served,
    the top-k pruning (8 of up to 20 keys) as eagerly."""
    model = llama_tiny if family == "dense" else _made(models_root, family, "tiny")
    rng = random.Random(4)
    prompts = [random_tokens(rng, n, 1000) for n in (5, 19, 11, 30, 8)]
    params = [SamplingParams(temperature=0.0, max_tokens=m, logprobs=5, ignore_eos=True) for m in (6, 3, 9, 5, 7)]
    params[2] = SamplingParams(temperature=0.9, seed=3, max_tokens=9, logprobs=5, ignore_eos=True)
    small = 7  # blocks of 8: not enough for all five, so some are preempted
    if family != "dense" and not GPU:  # the interpreter is slow: three requests (3 -> 4 padded) in 5 blocks
        prompts, params, small = [prompts[i] for i in (0, 2, 4)], [params[i] for i in (0, 2, 4)], 5
    graphs = "auto" if GPU else "emulate"
    runs = {}
    # Granite: the interpreter is slow; the slot buffer's preemption path is the same code for both hybrids
    pools = (256,) if family in ("granite_hybrid", "glm_moe_dsa") else (256, small)
    # DSA: a graph scores every key position served, which the interpreter walks one by one
    longest = {"max_model_len": 128} if family == "glm_moe_dsa" else {}
    for mode in ("off", graphs):
        for num_blocks in pools:
            llm = _make(model, DTYPES[-1])(max_num_seqs=8, num_blocks=num_blocks, cuda_graphs=mode, **longest)
            outs = llm.generate(prompts, params)
            runs[mode, num_blocks] = [(o.token_ids, o.logprobs, o.sampled_logprobs) for o in outs]
            engine = llm.engine
            if mode != "off":
                assert engine.runner.graphs is not None and engine.runner.graphs.replays > 0
                assert engine.runner.graphs.capture_error is None
            if num_blocks == small:
                assert engine.scheduler.num_preemptions > 0
            engine.check_integrity()
    assert all(runs[key] == runs["off", 256] for key in runs)
    # A follow-up over blocks completed in graph steps hits their staged states (hybrids); its uncached tail
    # (4 tokens), like the first prompt (5), is a prompt's last chunk that replays the query-tile-wide graph.
    llm = _make(model, DTYPES[-1])(max_num_seqs=8, cuda_graphs=graphs, **longest)
    first = llm.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0]
    follow = prompts[0] + first.token_ids + [7, 8, 9]
    params = SamplingParams(temperature=0.0, max_tokens=3, logprobs=5, ignore_eos=True)
    warm = llm.generate([follow], params)[0]
    assert warm.num_cached_tokens == 16  # blocks [0, 8) and [8, 16): the second completed by decode
    assert llm.engine.runner.graphs is not None and llm.engine.runner.graphs.tail_replays >= 2
    cold = _make(model, DTYPES[-1])(enable_prefix_caching=False, **longest).generate([follow], params)[0]
    assert (warm.token_ids, warm.logprobs) == (cold.token_ids, cold.logprobs)


def test_verify_graphs_equal_speculation_off(qwen3_next_tiny: Path, models_root: Path) -> None:
    """(j) through verify graphs: steps whose requests carry 1..k drafts replay a (k + 1)-row graph, short drafts
    padded (on the CPU the same static-buffer step, uncaptured); the hybrid keeps every token's recurrent state
    there and returns to the last accepted one on the device. MTP's random head rejects (the return) and drafts from
    its own graph the very tokens it drafts eagerly; the target as its own draft model is accepted by the greedy
    requests (the kept end state); block boundaries reached inside verify graphs are staged for the prefix cache,
    and a follow-up hits them."""
    rng = random.Random(6)
    prompts = [random_tokens(rng, n, 1000) for n in (11, 17, 10)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=6, logprobs=3, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=4, max_tokens=6, logprobs=3, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=8, logprobs=3, ignore_eos=True),
    ]
    # the interpreter is slow: GLM-5's MTP layer (DeepSeek's layout, sparse attention) through the drafting graph
    # on a GPU only (on the CPU, tests/test_dsa.py drafts with it eagerly)
    families = ["qwen3_next", "granite_hybrid", "glm_moe_dsa"] if GPU else ["qwen3_next"]
    graphs = "auto" if GPU else "emulate"
    colds: dict[str, Any] = {}
    for family in families:
        model = qwen3_next_tiny if family == "qwen3_next" else _made(models_root, family, "tiny")
        make = partial(_make(model, DTYPES[-1]), block_size=16, max_num_seqs=4)
        reference = [(o.token_ids, o.logprobs) for o in make().generate(prompts, params)]
        methods = {"draft": {"model": str(model)}}
        if family in ("qwen3_next", "glm_moe_dsa"):
            methods["mtp"] = {}
        for method, extra in methods.items():
            spec = {"method": method, "num_speculative_tokens": 2, **extra}
            llm = make(cuda_graphs=graphs, speculative_config=spec)
            drafts = _record_drafts(llm)
            got = [(o.token_ids, o.logprobs) for o in llm.generate(prompts, params)]
            assert got == reference, (family, method)
            engine, stats = llm.engine, llm.engine.stats()
            assert engine.runner.graphs is not None and engine.runner.graphs.verify_replays > 0
            # requests near max_tokens draft fewer than k, the one at its last token none: both padded to the
            # graph's width beside the others, not run eagerly
            assert engine.runner.graphs.padded_replays > 0, (family, method)
            if family == "qwen3_next":  # where these prompts and lengths leave one request draftless
                assert engine.runner.graphs.undrafted_rows > 0, (family, method)
            if method == "mtp":  # the head drafted from its own graph, the very tokens it drafts eagerly
                # after every verify replay but the last (everyone finished: nothing to draft)
                mtp_graphs = engine.speculator.proposer.graphs
                assert mtp_graphs.replays >= engine.runner.graphs.verify_replays - 1, mtp_graphs.replays
                eager = make(cuda_graphs="off", speculative_config=spec)
                eager_drafts = _record_drafts(eager)
                assert [(o.token_ids, o.logprobs) for o in eager.generate(prompts, params)] == reference
                assert drafts == eager_drafts
            accepted, drafted = stats["spec_num_accepted_tokens"], stats["spec_num_draft_tokens"]
            # the greedy requests accept their own model's drafts (the kept end state); MTP's head rejects
            assert (accepted > 0) if method == "draft" else (accepted < drafted), (method, accepted, drafted)
            engine.check_integrity()
            follow = prompts[2] + got[2][0] + [7, 8]  # 10 + 8 + 2 tokens: block [0, 16) completed while verifying
            warm = llm.generate([follow], params[0])[0]
            assert warm.num_cached_tokens == 16
            if family not in colds:  # every method's output is the reference's: the same follow-up, cold once
                colds[family] = make(enable_prefix_caching=False).generate([follow], params[0])[0]
            cold = colds[family]
            assert (warm.token_ids, warm.logprobs) == (cold.token_ids, cold.logprobs)


# Granite (Mamba2's chunked scan) on a GPU only: the interpreter is slow, and tests/test_hybrid_kernels.py checks
# that kernel's splits, captures and returns on the CPU.
@pytest.mark.parametrize("family", ["qwen3_next", "granite_hybrid"] if GPU else ["qwen3_next"])
def test_chunked_scans_through_graphs_speculation_and_the_prefix_cache(family: str, models_root: Path) -> None:
    """``recurrent_scan="chunked"``: gated DeltaNet and Mamba2 on the 16-token absolute grid (blocks of 16, the
    chunk divides them). Decode graphs recompute their grid chunk from the ring of pending rows; Qwen3-Next's MTP
    verify steps run in graphs (the state after a kept token is its grid point's state, the pending rows are
    addressed by position); a follow-up restores the state at 16 from the prefix cache. Every output equals the
    same engine's eager, unspeculated, uncached run."""
    model = _made(models_root, family, "tiny")
    rng = random.Random(9)
    prompts = [random_tokens(rng, n, 1000) for n in (11, 17)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=6, logprobs=3, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=4, max_tokens=6, logprobs=3, ignore_eos=True),
    ]
    make = partial(_make(model, DTYPES[-1]), block_size=16, max_num_seqs=4, recurrent_scan="chunked")
    reference = make(cuda_graphs="off", enable_prefix_caching=False)
    assert reference.engine.states is not None and reference.engine.states.pending[0].shape[1] == 32  # 2 x 16
    expected = [(o.token_ids, o.logprobs) for o in reference.generate(prompts, params)]
    spec = {"speculative_config": {"method": "mtp", "num_speculative_tokens": 2}} if family == "qwen3_next" else {}
    llm = make(cuda_graphs="auto" if GPU else "emulate", **spec)
    got = [(o.token_ids, o.logprobs) for o in llm.generate(prompts, params)]
    assert got == expected
    graphs = llm.engine.runner.graphs
    assert graphs is not None and (graphs.verify_replays if spec else graphs.replays) > 0
    llm.engine.check_integrity()
    follow = prompts[0] + got[0][0] + [7, 8]  # 11 + 6 + 2 tokens: the state at 16 was staged while decoding
    warm = llm.generate([follow], params[0])[0]
    assert warm.num_cached_tokens == 16
    cold = reference.generate([follow], params[0])[0]
    assert (warm.token_ids, warm.logprobs) == (cold.token_ids, cold.logprobs)
    with pytest.raises(ValueError, match="block_size: 8 must be a multiple of the recurrent scan chunk"):
        make(block_size=8)
    # a return to a kept token reads the ring, which keeps a step's last 16 rows: 16 drafts are refused
    with pytest.raises(ValueError, match="num_speculative_tokens: 16 drafts make verify steps of 17 rows"):
        make(speculative_config={"method": "ngram", "num_speculative_tokens": 16})


def _record_drafts(llm: LLM) -> list[list[tuple[int, ...]]]:
    """Every step's drafts, request by request, as the proposer leaves them (filled as ``llm`` runs)."""
    speculator, log = llm.engine.speculator, []
    propose = speculator.propose

    def recorded(sched: Any, step: Any, ready: list[Any]) -> None:  # the engine's own call, passed through
        propose(sched, step, ready)
        log.append([tuple(r.spec_token_ids) for r in ready])

    speculator.propose = recorded
    return log


def test_decode_graphs_refuse_what_they_cannot_capture(qwen3_next_tiny: Path) -> None:
    # the CPU backends walk requests and experts on the host
    cpu = partial(LLM, str(qwen3_next_tiny), device="cpu", block_size=16, num_blocks=64)
    with pytest.raises(ValueError, match="cuda_graphs: 'emulate' needs a graph-capable model; recurrent"):
        cpu(cuda_graphs="emulate")
    with pytest.raises(ValueError, match="cuda_graphs: unknown 'always'"):
        _make(qwen3_next_tiny, "float32")(cuda_graphs="always")


def test_the_invariant_backend_takes_nothing_from_the_shape_dependent_one() -> None:
    """TritonOps has no shape-dependent parent: every method it does not define itself comes from the shared
    DeviceKernels (each invariant by its own argument) or is one of Ops' thin wrappers over its own
    ``pointwise`` (sigmoid, silu, softplus); none from CudaOps."""
    import inspect

    from kvwarden.layers.gpu_ops import CudaOps, DeviceKernels, TritonOps
    from kvwarden.layers.numerics import Ops

    assert CudaOps not in TritonOps.__mro__
    wrappers = {"sigmoid", "silu", "softplus"}
    for name, _ in inspect.getmembers(TritonOps, callable):
        if name.startswith("_"):
            continue
        owner = next(c for c in TritonOps.__mro__ if name in c.__dict__)
        assert owner in (TritonOps, DeviceKernels) or (owner is Ops and name in wrappers), (name, owner)
