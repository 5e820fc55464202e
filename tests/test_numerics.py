"""Canonical ops: a row's bits never depend on its batch partners or position.

Also pins the library facts the canonical kernels rely on (fixed-shape GEMM
rows are independent, bmm does not depend on its batch count, cumsum is a
sequential float64 fold), so a torch upgrade that breaks one fails here first.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvwarden.config import NumericsConfig
from kvwarden.layers.gemm_rows import torch_threads
from kvwarden.layers.numerics import CanonicalOps

OPS = CanonicalOps(NumericsConfig())
# (in, out) shapes of the presets and SmolLM2; (1536, 576) is one where plain
# torch matmul rows change with the batch size on this CPU.
SHAPES = [(64, 128), (256, 768), (768, 256), (576, 1536), (1536, 576), (576, 4096)]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


@pytest.mark.parametrize(("k", "n"), SHAPES)
@given(rows=st.integers(1, 300), pos=st.integers(0, 299), seed=st.integers(0, 1000))
@settings(max_examples=15, deadline=None)
def test_linear_row_is_independent_of_batch(k: int, n: int, rows: int, pos: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen)
    row = torch.randn(1, k, generator=gen)
    alone = OPS.linear(row, w)
    batch = torch.randn(rows, k, generator=gen)
    pos = pos % rows
    batch[pos] = row[0]
    assert torch.equal(_bits(OPS.linear(batch, w)[pos]), _bits(alone[0]))


@pytest.mark.parametrize(("k", "n"), [*SHAPES, (1024, 3072), (2048, 1024), (1536, 3072), (576, 49152)])
def test_linear_rows_match_tile_calls_at_every_row_count(k: int, n: int) -> None:
    """CanonicalOps.linear gives every row the bits of a one-thread 16-row call, up to a 2048-token
    prefill chunk, whatever this CPU's GEMM does with larger calls (it cuts batches into call sizes it
    measured to agree; on some CPUs k=1536 disagrees at 64-192 rows, k=1024..2048 from about 208)."""
    gen = torch.Generator().manual_seed(k * n)
    x, w = torch.randn(2048 if n < 10_000 else 256, k, generator=gen), torch.randn(n, k, generator=gen)
    with torch_threads(1):
        tiles = _bits(torch.cat([torch.mm(x[i : i + 16], w.t()) for i in range(0, x.shape[0], 16)]))
    ops = CanonicalOps(NumericsConfig())
    sizes = ops.gemm_sizes.calls(w.t()).sizes
    assert sizes[-1] == 16 and list(sizes) == sorted(sizes, reverse=True)
    for m in (1, 5, 16, 33, 64, 100, 112, 192, 256, 300, 528, 1024, 1500, 2048):
        if m <= x.shape[0]:
            assert torch.equal(_bits(ops.linear(x[:m], w)), tiles[:m]), (m, sizes)


@pytest.mark.parametrize(("k", "n"), [*SHAPES, (1024, 256), (1024, 3072), (2048, 1024), (896, 1024)])
def test_linear_bits_do_not_depend_on_the_thread_count(k: int, n: int) -> None:
    """``kvwarden serve`` runs on all cores but one, the Python API on all: both must give the same bits.
    A 16-row call's bits can change with the thread count where MKL splits a wide reduction across
    threads (k=1024, n=3072 on some CPUs); CanonicalOps runs such weights on one thread."""
    gen = torch.Generator().manual_seed(k + n)
    x, w = torch.randn(256, k, generator=gen), torch.randn(n, k, generator=gen)
    results = {}
    for threads in (1, 2, 3):
        with torch_threads(threads):
            ops = CanonicalOps(NumericsConfig())  # calibrates at this thread count
            results[threads] = [_bits(ops.linear(x[:m], w)) for m in (1, 5, 16, 64, 256)]
    for threads in (2, 3):
        for a, b in zip(results[1], results[threads], strict=True):
            assert torch.equal(a, b), (threads, a.shape)


@given(
    rows=st.integers(1, 200),
    pos=st.integers(0, 199),
    hidden=st.sampled_from([32, 64, 100, 256, 576, 1000, 1536, 2048, 4096, 16384]),
)
@settings(max_examples=30, deadline=None)
def test_row_and_pointwise_ops_are_independent_of_batch(rows: int, pos: int, hidden: int) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + hidden)
    x = torch.randn(rows, hidden, generator=gen) * 3
    w = torch.randn(hidden, generator=gen)
    pos = pos % rows
    row = x[pos : pos + 1].clone()
    assert torch.equal(_bits(OPS.rms_norm(x, w, 1e-6)[pos]), _bits(OPS.rms_norm(row, w, 1e-6)[0]))
    assert torch.equal(_bits(OPS.silu_mul(x, x)[pos]), _bits(OPS.silu_mul(row, row)[0]))
    assert torch.equal(_bits(OPS.exp(x)[pos]), _bits(OPS.exp(row)[0]))
    assert torch.equal(_bits(OPS.log_softmax(x)[pos]), _bits(OPS.log_softmax(row)[0]))


POINTWISE = {
    "exp": torch.exp,
    "silu": torch.nn.functional.silu,
    "sigmoid": torch.sigmoid,
    "softplus": torch.nn.functional.softplus,
}


@pytest.mark.parametrize("threads", [1, 2, 3, 4])
def test_pointwise_one_call_takes_the_vector_path_everywhere(threads: int) -> None:
    """The library fact under CanonicalOps.pointwise's single call: with the length padded by
    ``pointwise_length``, every element of a call over up to 2.6M elements comes out as a serial
    256-element call (pure SIMD blocks) computes it, at 1 to 4 intra-op threads. If torch changed its
    split of element-wise work (grain, ranges), the thread boundaries would land inside SIMD blocks,
    those elements would take the scalar remainder loop, and this test would fail."""
    gen = torch.Generator().manual_seed(threads)
    x = torch.randn(2_600_000, generator=gen) * 12
    with torch_threads(threads):
        for name, fn in POINTWISE.items():
            block = 256
            ref = _bits(torch.cat([fn(x[i : i + block]) for i in range(0, x.numel(), block)]))
            if name != "exp":  # the test can fail: a scalar remainder gives other bits (exp agrees here)
                odd = torch.cat([fn(x[i : i + 33]) for i in range(0, 33 * 3000, 33)])
                assert not torch.equal(_bits(odd), ref[: 33 * 3000]), name
            for n in (1, 33, 4000, 32768, 32769, 50_001, 98_305, 131_072, 400_007, 1_000_003, 2_600_000):
                assert torch.equal(_bits(OPS.pointwise(fn, x[:n])), ref[:n]), (name, n)


@pytest.mark.parametrize(
    ("m", "k", "n"), [(16, 16, 16), (16, 32, 16), (16, 64, 16), (16, 128, 16), (16, 16, 65), (16, 16, 129)]
)
def test_bmm_matrix_does_not_depend_on_batch_count(m: int, k: int, n: int) -> None:
    gen = torch.Generator().manual_seed(m * k * n)
    a, b = torch.randn(600, m, k, generator=gen), torch.randn(600, k, n, generator=gen)
    ref = torch.stack([a[i] @ b[i] for i in range(8)])
    for count in (1, 3, 8, 64, 600):
        c = min(count, 8)
        assert torch.equal(_bits(torch.bmm(a[:count], b[:count])[:c]), _bits(ref[:c]))


def test_cumsum_is_a_sequential_float64_fold() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 50, 7, generator=gen)
    acc = torch.zeros(3, 7, dtype=torch.float64)
    for t in range(50):
        acc = acc + x[:, t].double()
    assert torch.equal(torch.cumsum(x, dim=1)[:, -1], acc.float())
    padded = torch.cat([x, torch.zeros(3, 20, 7)], dim=1)
    assert torch.equal(torch.cumsum(padded, dim=1)[:, -1], acc.float())


@pytest.mark.parametrize("head_dim", [16, 32, 64, 128, 256])
@pytest.mark.parametrize("rep", [1, 2, 3, 4, 8])
def test_attention_scores_do_not_depend_on_the_key_count(head_dim: int, rep: int) -> None:
    """The canonical kernel's q.k product (right operand transposed, as the kernel passes it) has rows
    fixed by the item and inner size head_dim but as many columns as the group's keys: a score must not
    depend on that column count, nor on the batch count, nor on the operand's layout."""
    m = rep * 64
    gen = torch.Generator().manual_seed(head_dim * 10 + rep)
    q = torch.randn(3, m, head_dim, generator=gen)
    k = torch.randn(3, 4096, head_dim, generator=gen)
    full = _bits(torch.bmm(q, k.transpose(1, 2)))
    assert torch.equal(_bits(torch.bmm(q, k.transpose(1, 2).contiguous())), full)
    for n in (64, 128, 192, 320, 512, 1088, 2048):
        assert torch.equal(_bits(torch.bmm(q, k[:, :n].transpose(1, 2))), full[:, :, :n]), n
        assert torch.equal(_bits(torch.bmm(q[:1], k[:1, :n].transpose(1, 2))), full[:1, :, :n]), n


@pytest.mark.parametrize(("k", "n"), [(32, 320), (64, 1024), (128, 129), (256, 320), (64, 33), (64, 65), (64, 129)])
@given(rows=st.integers(1, 64).map(lambda r: 4 * r), seed=st.integers(0, 1000))
@settings(max_examples=12, deadline=None)
def test_gemm_row_depends_on_its_row_only_for_row_counts_of_four(k: int, n: int, rows: int, seed: int) -> None:
    """The fact that lets the canonical attention pack a decode step's query heads into round_up(rep, 4)
    rows while a prefill tile uses rep * 64: for row counts that are multiples of 4, an output row's bits
    depend on its input row and the right operand only, not on the row count or where the row sits, in
    mm and in bmm. Shapes: scores (head_dim x keys), P @ [V | 1] (key tile x head_dim + 1). (Linears do not
    rely on it: with k >= 1024 some CPUs break it, see test_linear_rows_match_tile_calls_at_every_row_count.)"""
    gen = torch.Generator().manual_seed(seed)
    a, b = torch.randn(256, k, generator=gen), torch.randn(k, n, generator=gen)
    ref = _bits(torch.mm(a, b))
    pick = torch.randperm(256, generator=gen)[:rows]
    assert torch.equal(_bits(torch.mm(a[pick], b)), ref[pick])
    batched = torch.bmm(a[pick].expand(3, rows, k), b.expand(3, k, n))
    assert torch.equal(_bits(batched[2]), ref[pick])
