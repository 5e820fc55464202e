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


@given(rows=st.integers(1, 200), pos=st.integers(0, 199), hidden=st.sampled_from([64, 100, 576, 1000, 1536]))
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
@pytest.mark.parametrize("rep", [1, 2, 3, 4])
def test_attention_scores_do_not_depend_on_the_key_count(head_dim: int, rep: int) -> None:
    """The canonical kernel's q.k product has fixed rows (rep * 16) and inner size (head_dim) but as many
    columns as the group's keys: a score must not depend on that column count, nor on the batch count."""
    m = rep * 16
    gen = torch.Generator().manual_seed(head_dim * 10 + rep)
    q = torch.randn(3, m, head_dim, generator=gen)
    k = torch.randn(3, head_dim, 4096, generator=gen)
    full = _bits(torch.bmm(q, k))
    for n in (16, 32, 48, 160, 512, 1040, 2048):
        assert torch.equal(_bits(torch.bmm(q, k[:, :, :n])), full[:, :, :n]), n
        assert torch.equal(_bits(torch.bmm(q[:1], k[:1, :, :n])), full[:1, :, :n]), n
