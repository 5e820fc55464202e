"""Sparse attention's Triton kernels (``layers/kernels/sparse.py``) under the interpreter: the indexer's
scores and the latent attention against the CPU reference (``layers/sparse_attention.py``), and a query's
result the same bits alone, in a batch, or over a longer slot table. Compiled on a GPU (inputs drawn on the CPU
from explicit generators, then moved)."""

from __future__ import annotations

import pytest
import torch

from kvwarden.layers import sparse_attention as ref
from kvwarden.layers.kernels import sparse
from tolerance import assert_within, norm_tolerance, reorder_bound

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _on(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.to(DEVICE) for t in tensors]


# Latent attention's steps in series: scores, the softmax's exp, its sum and the weighted latent (one rounding
# of the probabilities to bfloat16 in a bfloat16 cache's kernel), the division.
ATTENTION_STAGES = 4


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """Norm-wise relative error (``tolerance.norm_tolerance`` bounds it)."""
    got, want = got.double().cpu(), want.double().cpu()
    return ((got - want).norm() / want.norm()).item()


def _score_bound(q: torch.Tensor, keys: torch.Tensor, w: torch.Tensor, scale: float, start: int) -> torch.Tensor:
    """Rounding bound of each index score computed in another order: ``2 gamma_n`` times the same scores over
    absolute values (``sum |w_h| relu(scale |q_h| . |k|)``, each term's magnitude), ``n`` the head width plus
    the heads folded (``tests/tolerance.py``)."""
    magnitude = ref.index_scores(q.abs().double(), keys.abs().double(), w.abs().double(), scale, start)
    return torch.as_tensor(reorder_bound(torch.float32, q.shape[-1] + q.shape[1] + 1, magnitude))


def _cache(g: torch.Generator, slots: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A cache of ``slots`` random rows and a random permutation of them as one request's slot table."""
    return torch.randn(slots, width, generator=g), torch.randperm(slots, generator=g)


def test_index_scores_kernel_matches_the_reference_and_is_invariant() -> None:
    g = torch.Generator().manual_seed(0)
    t, h, d, ctx = 12, 6, 24, 40
    keys, order = _cache(g, 64, d)
    q, w = torch.randn(t, h, d, generator=g), torch.randn(t, h, generator=g)
    start = ctx - t  # the chunk's queries are the context's last t positions
    table = order[:ctx].view(1, ctx)
    req, pos = torch.zeros(t, dtype=torch.int32), torch.arange(start, ctx, dtype=torch.int32)
    want = ref.index_scores(q, keys[order[:ctx]], w, d**-0.5, start).to(DEVICE)
    bound = _score_bound(q, keys[order[:ctx]], w, d**-0.5, start)
    q, w, keys, table, req, pos = _on(q, w, keys, table, req, pos)
    got = sparse.index_scores(q, w, keys, table, req, pos, d**-0.5)
    finite = torch.isfinite(want)
    assert torch.equal(finite, torch.isfinite(got))
    assert_within(got[finite].cpu(), want[finite].cpu(), bound[finite.cpu()], "index scores")
    # alone, and over a slot table padded past the context: the same bits
    wide = torch.cat([table, torch.zeros((1, 29), dtype=table.dtype, device=DEVICE)], dim=1)
    for i in (0, 7, 11):
        alone = sparse.index_scores(q[i : i + 1], w[i : i + 1], keys, wide, req[i : i + 1], pos[i : i + 1], d**-0.5)
        assert torch.equal(alone[0, :ctx], got[i])
        assert torch.isinf(alone[0, ctx:]).all()


def test_latent_attention_kernel_matches_the_reference_and_is_invariant() -> None:
    g = torch.Generator().manual_seed(1)
    t, h, r, rope, k = 5, 4, 32, 16, 40
    latent, order = _cache(g, 96, r + rope)
    q = torch.randn(t, h, r + rope, generator=g)
    selected = torch.stack([order[torch.randperm(96, generator=g)[:k]] for _ in range(t)])
    visible = torch.ones(t, k, dtype=torch.bool)
    visible[0, 10:] = False  # a short context: the rest are fill
    visible[3, 33:] = False
    want = ref.latent_attention(q, latent[selected], visible, r, 0.2, torch.exp).to(DEVICE)
    q, latent, selected, visible = _on(q, latent, selected, visible)
    got = sparse.latent_attention(q, latent, selected, visible, r, 0.2)
    assert _rel(got, want) <= norm_tolerance(torch.float32, r + rope + k, ATTENTION_STAGES)
    for i in range(t):
        alone = sparse.latent_attention(q[i : i + 1], latent, selected[i : i + 1], visible[i : i + 1], r, 0.2)
        assert torch.equal(alone[0], got[i])


@pytest.mark.parametrize("split", [sparse.SPLIT_CANDIDATES, 32])  # 32: three splits, one all invisible for row 0
def test_latent_attention_splits_give_the_same_bits_walked_or_in_parallel(
    split: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sparse, "SPLIT_CANDIDATES", split)
    g = torch.Generator().manual_seed(2)
    t, h, r, rope, k = 3, 20, 32, 8, 70  # 20 heads: two head blocks, the second partly padding; rope < 16: padded
    latent, order = _cache(g, 128, r + rope)
    q = torch.randn(t, h, r + rope, generator=g)
    selected = torch.stack([order[torch.randperm(128, generator=g)[:k]] for _ in range(t)])
    visible = torch.ones(t, k, dtype=torch.bool)
    visible[0, 20:] = False  # candidates 32-69 invisible: the later splits are the fold's identity
    want = ref.latent_attention(q, latent[selected], visible, r, 0.3, torch.exp).to(DEVICE)
    q, latent, selected, visible = _on(q, latent, selected, visible)
    walked = sparse.latent_attention(q, latent, selected, visible, r, 0.3, parallel=False)
    assert _rel(walked, want) <= norm_tolerance(torch.float32, r + rope + k, ATTENTION_STAGES)
    assert torch.equal(sparse.latent_attention(q, latent, selected, visible, r, 0.3, parallel=True), walked)
    for i in range(t):  # alone (the parallel form, chosen for a small launch) = in the batch
        alone = sparse.latent_attention(q[i : i + 1], latent, selected[i : i + 1], visible[i : i + 1], r, 0.3)
        assert torch.equal(alone[0], walked[i])


def test_bfloat16_caches_take_the_low_precision_products_with_the_same_invariance() -> None:
    """A bfloat16 model's caches: queries and probabilities rounded to bfloat16, float32 accumulation;
    close to the float32 reference, and a query's bits still the same alone, batched, walked or parallel."""
    g = torch.Generator().manual_seed(3)
    bf = torch.bfloat16
    # indexer scores: bfloat16-valued queries (as the model's rotary gives them) over a bfloat16 key cache
    t, h, d, ctx = 6, 4, 32, 20
    keys, order = _cache(g, 32, d)
    keys = keys.to(bf)
    q, w = torch.randn(t, h, d, generator=g).to(bf).float(), torch.randn(t, h, generator=g)
    table, start = order[:ctx].view(1, ctx), ctx - t
    req, pos = torch.zeros(t, dtype=torch.int32), torch.arange(start, ctx, dtype=torch.int32)
    want = ref.index_scores(q, keys.float()[order[:ctx]], w, d**-0.5, start).to(DEVICE)
    bound = _score_bound(q, keys.float()[order[:ctx]], w, d**-0.5, start)
    q, w, keys, table, req, pos = _on(q, w, keys, table, req, pos)
    got = sparse.index_scores(q, w, keys, table, req, pos, d**-0.5)
    finite = torch.isfinite(want)
    assert torch.equal(finite, torch.isfinite(got))
    # bfloat16 values multiply exactly in float32: only the float32 sums round
    assert_within(got[finite].cpu(), want[finite].cpu(), bound[finite.cpu()], "bfloat16 index scores")
    alone = sparse.index_scores(q[2:3], w[2:3], keys, table, req[2:3], pos[2:3], d**-0.5)
    assert torch.equal(alone[0], got[2])
    # latent attention: the probabilities rounded to bfloat16 for P @ V (relative error ~2^-8)
    t, h, r, rope, k = 3, 16, 32, 16, 70
    latent, order = _cache(g, 128, r + rope)
    latent = latent.to(bf)
    q = torch.randn(t, h, r + rope, generator=g).to(bf).float()
    selected = torch.stack([order[torch.randperm(128, generator=g)[:k]] for _ in range(t)])
    visible = torch.ones(t, k, dtype=torch.bool)
    visible[1, 40:] = False  # the second query's later tiles are skipped
    want = ref.latent_attention(q, latent.float()[selected], visible, r, 0.2, torch.exp).to(DEVICE)
    q, latent, selected, visible = _on(q, latent, selected, visible)
    walked = sparse.latent_attention(q, latent, selected, visible, r, 0.2, parallel=False)
    assert _rel(walked, want) <= norm_tolerance(torch.bfloat16, r + rope + k, ATTENTION_STAGES)
    assert (walked - want).abs().max().item() > 0  # the rounding really happened (not the float32 path)
    assert torch.equal(sparse.latent_attention(q, latent, selected, visible, r, 0.2, parallel=True), walked)
    for i in range(t):
        alone = sparse.latent_attention(q[i : i + 1], latent, selected[i : i + 1], visible[i : i + 1], r, 0.2)
        assert torch.equal(alone[0], walked[i])
