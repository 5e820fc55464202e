"""The compiled CPU kernels (``layers/cpu_kernels``): each one's invariance argument, checked bitwise, and
its agreement with the PyTorch path it replaces, within float32 rounding.

The kernels are built by the real build (``g++`` from ``scripts/install.sh``'s prerequisites) into the
session's cache; a build that fails is checked too, with a compiler that really does not exist.
"""

from __future__ import annotations

import logging
import random
from functools import partial
from itertools import pairwise
from pathlib import Path

import pytest
import torch

from kvwarden import LLM, SamplingParams
from kvwarden.bench.properties import PROPERTIES, check_properties
from kvwarden.config import NumericsConfig
from kvwarden.engine.row_math import CompiledRowMath, RowMath
from kvwarden.layers.attention import SeqAttn
from kvwarden.layers.backends import make_ops
from kvwarden.layers.cpu_kernels.build import BuildError, build
from kvwarden.layers.cpu_kernels.library import CpuKernels, load
from kvwarden.layers.cpu_ops import CompiledCpuOps
from kvwarden.layers.gemm_rows import torch_threads
from kvwarden.layers.kernels.attention_meta import UNIFORM_TILES
from kvwarden.layers.numerics import CanonicalOps
from kvwarden.layers.rotary import RotaryEmbedding
from reference import model_tol
from tolerance import (
    ELEMENTWISE_ULPS,
    abs_dot,
    assert_within,
    elementwise_bound,
    frequency_bound,
    log_softmax_bound,
    norm_tolerance,
    reorder_bound,
)
from util import random_tokens


@pytest.fixture(scope="module")
def kernels() -> CpuKernels:
    return load()


@pytest.fixture(scope="module")
def ops(kernels: CpuKernels) -> CompiledCpuOps:
    return CompiledCpuOps(NumericsConfig(), kernels)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# (n, k): Qwen3-0.6B's q/o/gate (1024 -> 2048 / 3072), SmolLM2-135M's MLP (576 -> 1536), an LM head's
# odd vocabulary, and sizes that are not multiples of a panel or a register block.
GEMM_SHAPES = [(2048, 1024), (1536, 576), (1000, 96), (37, 53), (16, 1)]


@pytest.mark.parametrize(("n", "k"), GEMM_SHAPES)
def test_gemm_row_is_its_own_whatever_the_rows_and_threads(kernels: CpuKernels, n: int, k: int) -> None:
    """A row's bits are those of the one-row call at any row count and any thread count."""
    g = _gen(n * 7 + k)
    w = torch.randn(n, k, generator=g) / k**0.5
    bias = torch.randn(n, generator=g)
    x = torch.randn(41, k, generator=g)
    alone = torch.cat([kernels.linear(x[i : i + 1], w, bias) for i in range(x.shape[0])])
    # the weight's panels kept (the default budget) or packed per call (none kept): the same bits
    unkept = CpuKernels(kernels.lib, kernels.rows_per_block, pack_budget=0)
    for rows in (1, 2, 5, 6, 7, 13, 41):
        for threads in (1, 2, 3):
            with torch_threads(threads):
                got = kernels.linear(x[:rows], w, bias)
                assert torch.equal(unkept.linear(x[:rows], w, bias), got), f"{rows} rows packed per call"
            assert torch.equal(got, alone[:rows]), f"{rows} rows on {threads} threads"
    assert unkept.packed_bytes == 0
    # a row of a strided view (a column slice of a fused projection's output) reads the same values
    wide = torch.cat([x, torch.randn(41, 5, generator=g)], 1)[:, :k]
    assert torch.equal(kernels.linear(wide, w, bias), alone)
    # a dot product of k terms plus the bias, in another order than torch's (tests/tolerance.py)
    bound = reorder_bound(torch.float32, k + 1, abs_dot(x, w.T) + bias.double().abs())
    assert_within(alone, x @ w.T + bias, bound, f"GEMM {n} x {k}")


def test_packed_weights_stay_within_their_budget(kernels: CpuKernels) -> None:
    """Panels are kept for the first weights that fit the budget, whole; later ones are packed per call."""
    g = _gen(5)
    small = CpuKernels(kernels.lib, kernels.rows_per_block, pack_budget=4 * 64 * 32)
    first, second, x = torch.randn(64, 32, generator=g), torch.randn(32, 32, generator=g), torch.randn(3, 32)
    small.linear(x, first)
    small.linear(x, second)
    assert small.packed_bytes == 4 * 64 * 32  # the second did not fit what the first left
    assert small.pack(first).panels is not None and small.pack(second).panels is None
    assert torch.equal(small.linear(x, second), kernels.linear(x, second))


def test_gemm_refuses_layouts_it_cannot_read(kernels: CpuKernels) -> None:
    w = torch.randn(32, 8)
    with pytest.raises(ValueError, match="x: 7 columns"):
        kernels.linear(torch.randn(3, 7), w)
    with pytest.raises(ValueError, match="float32"):
        kernels.linear(torch.randn(3, 8, dtype=torch.float64), w)
    with pytest.raises(ValueError, match="bias"):
        kernels.linear(torch.randn(3, 8), w, torch.randn(31))


def test_row_kernels_agree_with_torch_and_keep_rows_apart(ops: CompiledCpuOps) -> None:
    g = _gen(3)
    ref = CanonicalOps(NumericsConfig())
    x, res, w = torch.randn(9, 1000, generator=g), torch.randn(9, 1000, generator=g), torch.rand(1000, generator=g)
    normed = ops.rms_norm(x, w, 1e-6)
    # sum of 1000 squares (relative gamma_1000: every term positive), then sqrt, divide, scale
    rms_bound = elementwise_bound(ref.rms_norm(x, w, 1e-6), 1000 + 3 + ELEMENTWISE_ULPS)
    assert_within(normed, ref.rms_norm(x, w, 1e-6), rms_bound, "rms_norm")
    assert torch.equal(ops.rms_norm(x[4:5], w, 1e-6), normed[4:5])
    n2, h2 = ops.add_rms_norm(x, res, w, 1e-6)
    rn, rh = ref.add_rms_norm(x, res, w, 1e-6)
    assert torch.equal(h2, rh)  # one rounded add, as torch's
    assert_within(n2, rn, elementwise_bound(rn, 1000 + 3 + ELEMENTWISE_ULPS), "add_rms_norm")
    gate, up = torch.randn(9, 2 * 777, generator=g).split(777, 1)  # column slices of one GEMM output
    got = ops.silu_mul(gate, up)
    want = ref.silu_mul(gate, up)  # g / (1 + exp(-g)) * u: exp, add, divide, multiply
    assert_within(got, want, elementwise_bound(want, ELEMENTWISE_ULPS + 3), "silu_mul")
    assert torch.equal(ops.silu_mul(gate[2:3], up[2:3]), got[2:3])
    with torch_threads(3):
        assert torch.equal(ops.silu_mul(gate, up), got)
        assert torch.equal(ops.rms_norm(x, w, 1e-6), normed)


@pytest.mark.parametrize("vocab", [2048, 49152, 37])
def test_log_softmax_rows_are_their_own(kernels: CpuKernels, vocab: int) -> None:
    """The sampler's log-softmax: every row of a step in one call, each with the one-row call's bits at any
    thread count, within float32 rounding of torch's; the engine's sampler uses it."""
    g = _gen(vocab)
    logits = torch.randn(7, vocab, generator=g) * 6
    math = CompiledRowMath(kernels)
    got = math.log_softmax_rows(logits)
    truth = torch.log_softmax(logits.double(), -1)
    theirs = (torch.log_softmax(logits, -1).double() - truth).abs().max()  # torch's own float32 error
    assert_within(got, truth, log_softmax_bound(logits), f"log_softmax over {vocab}")
    print(f"\n[log_softmax {vocab}] ours {(got.double() - truth).abs().max():.2e}, torch's {theirs:.2e}")
    for i in range(logits.shape[0]):
        assert torch.equal(math.log_softmax(logits[i : i + 1]), got[i : i + 1])
    with torch_threads(3):
        assert torch.equal(math.log_softmax_rows(logits), got)
    assert torch.equal(math.log_softmax_rows(logits[:, :vocab].T.contiguous().T), got)  # a strided view


@pytest.mark.parametrize(("head_dim", "rotary_dim", "qk_norm"), [(64, 64, True), (32, 16, False), (48, 48, False)])
def test_rope_and_kv_write_agree_with_torch(ops: CompiledCpuOps, head_dim: int, rotary_dim: int, qk_norm: bool) -> None:
    g = _gen(head_dim + rotary_dim)
    rows, hq, hkv, slots_n = 11, 4, 2, 64
    rope = RotaryEmbedding(head_dim, rotary_dim, {"rope_theta": 10000.0}, 512)
    fused = torch.randn(rows, (hq + 2 * hkv) * head_dim, generator=g)  # q, k, v as views of one projection
    q, k, v = fused.split([hq * head_dim, hkv * head_dim, hkv * head_dim], 1)
    q, k, v = (t.view(rows, -1, head_dim) for t in (q, k, v))
    positions = torch.randint(0, 500, (rows,), generator=g)
    slots = torch.randperm(slots_n, generator=g)[:rows]
    norms = (torch.rand(head_dim, generator=g), torch.rand(head_dim, generator=g), 1e-6) if qk_norm else None
    ref_ops = CanonicalOps(NumericsConfig())
    ref_kv = (torch.zeros(slots_n, hkv, head_dim), torch.zeros(slots_n, hkv, head_dim + 1))
    ref_q = ref_ops.rope_write_kv(rope, q, k, v, positions, ref_kv, slots, norms)
    kv = (torch.zeros(slots_n, hkv, head_dim), torch.zeros(slots_n, hkv, head_dim))
    got_q = ops.rope_write_kv(rope, q, k, v, positions, kv, slots, norms)
    # a per-head RMSNorm (a reduction over head_dim) then a rotation (two products and an add)
    tol = norm_tolerance(torch.float32, head_dim, stages=2)
    for got, want in ((got_q, ref_q), (kv[0], ref_kv[0])):
        assert ((got.double() - want.double()).norm() / want.double().norm()).item() <= tol
    assert torch.equal(kv[1], ref_kv[1][..., :head_dim])  # V is copied, not computed
    one = ops.rope_write_kv(rope, q[3:4], k[3:4], v[3:4], positions[3:4], kv, slots[3:4], norms)
    assert torch.equal(one, got_q[3:4])


def test_seeded_draws_are_the_samplers_race(kernels: CpuKernels) -> None:
    """The compiled temperature-only draw: a row's token is the same alone, in a batch and on any thread
    count; it is the PyTorch path's token (the same counter noise over probabilities equal to rounding); and
    its frequencies follow the distribution."""
    g = _gen(11)
    math = CompiledRowMath(kernels)
    logits = torch.randn(64, 2048, generator=g) * 3
    temps = [0.3 + 0.05 * i for i in range(64)]
    seeds, positions = list(range(64)), [1000 + 7 * i for i in range(64)]
    batch = math.draw_rows(logits, temps, seeds, positions)
    assert batch is not None
    for i in range(64):
        params = SamplingParams(temperature=temps[i], seed=seeds[i])
        assert math.draw(logits[i], params, seeds[i], positions[i]) == batch[i]
        assert RowMath().draw(logits[i], params, seeds[i], positions[i]) == batch[i]
    with torch_threads(3):
        assert math.draw_rows(logits, temps, seeds, positions) == batch
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1, 0.0])
    row = torch.log(probs)
    draws = math.draw_rows(row.expand(4000, 5), [1.0] * 4000, [7] * 4000, list(range(4000)))
    assert draws is not None
    counts = torch.bincount(torch.tensor(draws), minlength=5).double() / 4000
    assert counts[4] == 0
    assert_within(counts, probs, frequency_bound(probs, 4000), "draw frequencies")


def _attend(
    ops: CompiledCpuOps,
    q: torch.Tensor,
    kv: tuple[torch.Tensor, torch.Tensor],
    pieces: list[tuple[int, int]],
    slots: torch.Tensor,
) -> torch.Tensor:
    """One step over the requests ``(start_pos, num_queries)`` of one shared context (rows in order); the
    context's scattered slots are a block table of one-slot blocks."""
    seqs, row = [], 0
    for start, n in pieces:
        seqs.append(SeqAttn(row_start=row, num_queries=n, start_pos=start, slots=slots))
        row += n
    plan = ops.attention_plan(seqs, row, [slots.tolist()] * len(seqs), 0, 1, UNIFORM_TILES)  # (GPU tiles only)
    return ops.attention(q, kv, plan, 0.125, 1)


@pytest.mark.parametrize(("hq", "hkv", "d"), [(4, 2, 64), (3, 1, 40), (2, 2, 128)])
def test_attention_in_place_is_one_function_of_the_position(ops: CompiledCpuOps, hq: int, hkv: int, d: int) -> None:
    """Prefill in one piece, in chunks of any size and as decode rows beside other requests: the same bits
    for every position, read straight from scattered cache slots; and close to a float64 softmax."""
    g = _gen(hq * 100 + d)
    length, pool = 150, 400
    slots = torch.randperm(pool, generator=g)[:length]
    kv = ops.new_kv_cache(pool, hkv, d, torch.float32)
    assert kv[1].shape[-1] == d  # the in-place layout: no ones column
    kv[0].normal_(generator=g)
    kv[1].normal_(generator=g)
    q = torch.randn(length, hq, d, generator=g)
    whole = _attend(ops, q, kv, [(0, length)], slots)
    for cuts in ([0, 7, 8, 40, 129, 150], [0, 1, 2, 3, 64, 150], [0, 149, 150]):
        pieces = [(a, b - a) for a, b in pairwise(cuts)]
        got = _attend(ops, q, kv, pieces, slots)  # each piece a request of its own in one step
        assert torch.equal(got, whole), cuts
    decode_rows = [5, 77, 149]
    got = _attend(ops, q[decode_rows].contiguous(), kv, [(p, 1) for p in decode_rows], slots)
    assert torch.equal(got, whole[decode_rows])
    with torch_threads(3):
        assert torch.equal(_attend(ops, q, kv, [(0, length)], slots), whole)
    k, v = kv[0][slots].double(), kv[1][slots].double()
    group = hq // hkv
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.repeat_interleave(group, 1)) * 0.125
    scores = scores.masked_fill(torch.ones(length, length, dtype=torch.bool).triu(1), float("-inf"))
    ref = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.repeat_interleave(group, 1))
    # scores (d terms), the softmax's exp and sum (up to 150 keys), weighted values, the division
    err = ((whole.double() - ref).norm() / ref.norm()).item()
    assert err <= norm_tolerance(torch.float32, max(d, length), stages=4), err


def test_the_engine_serves_canonical_cpu_numerics_on_the_compiled_kernels(llama_tiny: Path) -> None:
    """``auto`` takes the compiled kernels; ``torch`` keeps PyTorch's; both hold every property; the two
    agree to float32 rounding (they are different kernels, so not bitwise)."""
    rng = random.Random(4)
    prompt = random_tokens(rng, 21, 1000)
    partners = [random_tokens(rng, n, 1000) for n in (9, 13, 6)]
    params = SamplingParams(temperature=0.0, max_tokens=3, logprobs=5, ignore_eos=True)
    outs = {}
    for source in ("auto", "torch"):
        llm = LLM(str(llama_tiny), kernels=source, block_size=8, max_num_batched_tokens=64, num_blocks=256)
        assert isinstance(llm.engine.ops, CompiledCpuOps) == (source == "auto")
        assert isinstance(llm.engine.row_math, CompiledRowMath) == (source == "auto")
        outs[source] = llm.generate([prompt], params)[0]
    assert outs["auto"].token_ids == outs["torch"].token_ids
    tol = model_tol(llama_tiny, llm.score(prompt), len(prompt) + 3)  # float32 rounding of this shape
    for a, b in zip(outs["auto"].sampled_logprobs, outs["torch"].sampled_logprobs, strict=True):
        assert abs(a - b) <= tol, (a, b, tol)
    for source in ("auto", "torch"):
        make = partial(LLM, str(llama_tiny), kernels=source, block_size=8, max_num_batched_tokens=64, num_blocks=256)
        report = check_properties(make, prompt, params, 8, partners)
        assert set(report.outcomes) == set(PROPERTIES)
        assert report.all_identical, (source, report.failures())


def test_a_failed_build_falls_back_with_its_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("KVWARDEN_HOME", str(tmp_path))  # an empty cache: the build really runs
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with pytest.raises(BuildError, match="no-such-compiler"):
        build()
    with caplog.at_level(logging.WARNING, logger="kvwarden.layers.backends"):
        ops = make_ops(NumericsConfig(), "cpu")
    assert type(ops) is CanonicalOps
    assert "no-such-compiler" in caplog.text and "PyTorch" in caplog.text
    with pytest.raises(ValueError, match=r"kernels='compiled'.*no-such-compiler"):
        make_ops(NumericsConfig(kernels="compiled"), "cpu")
    # a compiler that runs and fails: its exit status and the log's path are in the reason
    monkeypatch.setenv("CXX", "false")
    with pytest.raises(BuildError, match=r"exit 1; log .*\.log"):
        build()
    assert not list((tmp_path / "kernels").glob("*.so*"))  # nothing half-written is left to be opened


def test_kernel_sources_are_checked() -> None:
    with pytest.raises(ValueError, match=r"numerics\.kernels"):
        NumericsConfig(kernels="mkl")
    with pytest.raises(ValueError, match="shape-dependent"):
        NumericsConfig(mode="shape-dependent", kernels="compiled")
    with pytest.raises(ValueError, match="CPU kernels"):
        make_ops(NumericsConfig(kernels="torch"), "cuda")
