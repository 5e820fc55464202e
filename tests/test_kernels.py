"""The canonical Triton kernels against their PyTorch references, and their invariance properties.

On a machine without a GPU these run under Triton's interpreter
(``TRITON_INTERPRET=1``, set in ``conftest.py``) on tiny float32 shapes; on a
GPU (``scripts/gpu_check.sh``) the same tests run compiled, in float32 and
bfloat16. Invariance is asserted bitwise; agreement with the reference with a
tolerance fitting the dtype.
"""

from __future__ import annotations

import dataclasses
import os
import struct

import pytest
import torch

from kvwarden.layers.kernels import attention, attention_meta, gemm, gemm_forms, pointwise, rotary, rows
from kvwarden.layers.rotary import RotaryEmbedding
from tolerance import norm_tolerance

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16] if DEVICE == "cuda" else [torch.float32]


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def rand(g: torch.Generator, *shape: int, dtype: torch.dtype = torch.float32, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEVICE)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN-safe), via the raw bytes."""
    return a.shape == b.shape and a.contiguous().view(torch.uint8).equal(b.contiguous().view(torch.uint8))


# The longest reduction any kernel test in this file and test_hybrid_kernels.py runs (a GEMM's K, an attention's
# context, a recurrent scan's positions times its head width), and the steps in series in the deepest kernel
# (attention in bfloat16: scores, the softmax's exp and sum, probabilities rounded to bfloat16, weighted values,
# the output rounded; a chunked scan's intra-chunk, state and output products).
LONGEST_REDUCTION = 4096
STAGES = 5


def close(a: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> bool:
    """Norm-wise relative error within the rounding bound of the dtype at this file's longest reduction
    (``tolerance.norm_tolerance``): a bound of the arithmetic, not of one machine's error."""
    tol = norm_tolerance(dtype, LONGEST_REDUCTION, STAGES)
    a, ref = a.double().cpu(), ref.double().cpu()
    err = (a - ref).norm() / max(ref.norm().item(), 1e-12)
    if os.environ.get("KVW_TOL_DEBUG"):
        print(f"[tol] {err.item():.3e} / {tol:.3e} = {err.item() / tol:.3f}")
    return bool(err < tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemm_rows_never_depend_on_the_batch(dtype: torch.dtype) -> None:
    g = gen(0)
    x, w, b = rand(g, 37, 40, dtype=dtype), rand(g, 24, 40, dtype=dtype), rand(g, 24, dtype=dtype)
    full = gemm.linear(x, w, b)
    assert close(full, x.double() @ w.double().T + b.double(), dtype)
    for m in (1, 3, 16, 17):  # prefixes of the batch: a row alone, a few, exactly one tile, one more
        assert same(gemm.linear(x[:m], w, b), full[:m])
    if DEVICE == "cuda":  # a row's position inside its tile does not matter to the matrix instruction;
        # the interpreter's tl.dot is numpy's BLAS, which vectorises along rows, so only the GPU can check this
        perm = torch.randperm(37, generator=g).to(DEVICE)
        assert same(gemm.linear(x[perm], w, b), full[perm])
    assert gemm.gemm_config(24, 40, dtype) == gemm.gemm_config(24, 40, dtype)  # a function of (N, K) only


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("n", "k"), [(24, 2048), (70, 2600)])  # 2600: the last split is short
def test_gemm_splits_of_k_give_the_same_bits_walked_or_in_parallel(dtype: torch.dtype, n: int, k: int) -> None:
    """K cut at fixed boundaries: the split states folded in order, by one program or by the last of many."""
    g = gen(2)
    x, w, b = rand(g, 37, k, dtype=dtype), rand(g, n, k, dtype=dtype), rand(g, n, dtype=dtype)
    cfg = gemm.gemm_config(n, k, dtype)
    k_blocks = -(-k // cfg.block_k)
    assert gemm.split_blocks(n, k, cfg) < k_blocks  # the shape really is split (several partial sums)
    counters = gemm.new_counters(DEVICE)
    walked = gemm.linear(x, w, b, parallel=False)
    assert close(walked, x.double() @ w.double().T + b.double(), dtype)
    for m in (1, 3, 17, 37):
        assert same(gemm.linear(x[:m], w, b, counters=counters, parallel=True), walked[:m])
        assert same(gemm.linear(x[:m], w, b, parallel=False), walked[:m])
        assert int(counters.abs().sum()) == 0  # each launch leaves its arrival counters zero (graphs replay it)
    assert same(gemm.linear(x[:1], w, b, counters=counters), walked[:1])  # the form the engine chooses
    unsplit = gemm.launch(x, w, b, cfg, blocks=k_blocks)  # one sum over all of K: other bits, same product
    assert close(unsplit, x.double() @ w.double().T + b.double(), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("n", "k"), [(24, 40), (20, 2048)])  # 2048: every head's K is split
def test_gemm_by_head_gives_each_head_the_bits_of_its_own_launch(dtype: torch.dtype, n: int, k: int) -> None:
    """MLA's absorbed projections: one launch over every head of a strided view, each head as its own GEMM."""
    g = gen(3)
    heads = 3
    wide = rand(g, 9, heads, k + 8, dtype=dtype)  # a head's row is a slice of a wider one (q_nope of q)
    x, w = wide[..., :k], rand(g, heads, n, k, dtype=dtype)
    counters = gemm.new_counters(DEVICE)
    y = gemm_forms.linear_heads(x, w, counters=counters)
    assert y.shape == (9, heads, n)
    for h in range(heads):
        alone = gemm.linear(x[:, h].contiguous(), w[h], parallel=False)
        assert same(y[:, h], alone)
        assert close(y[:, h], x[:, h].double() @ w[h].double().T, dtype)
        assert same(gemm_forms.linear_heads(x[:1], w, counters=counters)[:, h], alone[:1])  # one row: the parallel form
    assert int(counters.abs().sum()) == 0
    with pytest.raises(ValueError, match="linear_heads"):
        gemm_forms.linear_heads(x[:, :2], w)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("inter", "k"), [(40, 48), (100, 2048), (8, 32)])  # unsplit; split K; too narrow to fuse
def test_swiglu_in_the_gemm_epilogue_gives_the_unfused_bits(dtype: torch.dtype, inter: int, k: int) -> None:
    """The MLP's gate/up GEMM with SwiGLU fused: linear() then silu_mul(), bit for bit, walked or split."""
    g = gen(4)
    x, w, b = rand(g, 37, k, dtype=dtype), rand(g, 2 * inter, k, dtype=dtype), rand(g, 2 * inter, dtype=dtype)
    counters = gemm.new_counters(DEVICE)
    for bias in (None, b):
        gate_up = gemm.linear(x, w, bias, parallel=False)
        want = pointwise.silu_mul(gate_up[:, :inter], gate_up[:, inter:])
        fused = gemm_forms.linear_swiglu(x, w, bias, counters=counters)
        assert fused.shape == (37, inter)
        assert same(fused, want)
        for m in (1, 3):  # few rows: the parallel form where K is split
            assert same(gemm_forms.linear_swiglu(x[:m], w, bias, counters=counters), want[:m])
    assert int(counters.abs().sum()) == 0
    with pytest.raises(ValueError, match="even row count"):
        gemm_forms.linear_swiglu(x, w[:-1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_row_kernels_match_torch_and_are_row_invariant(dtype: torch.dtype) -> None:
    g = gen(1)
    x, res, w = rand(g, 9, 48, dtype=dtype), rand(g, 9, 48, dtype=dtype), rand(g, 48, dtype=dtype)
    y, h = rows.rms_norm(x, w, 1e-6, residual=res)
    hf = (x.float() + res.float()).to(dtype)
    assert same(h, hf)
    ref = w.float() * (hf.float() * torch.rsqrt(hf.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype).float()
    assert close(y, ref, dtype)
    assert same(rows.rms_norm(x[4:5], w, 1e-6, residual=res[4:5])[0], y[4:5])
    logits = rand(g, 5, 300, scale=3.0)
    assert close(rows.log_softmax(logits), torch.log_softmax(logits.double(), -1), torch.float32)
    assert close(rows.softmax(logits), torch.softmax(logits.double(), -1), torch.float32)
    assert same(rows.log_softmax(logits[2:3]), rows.log_softmax(logits)[2:3])
    assert close(rows.row_sum(logits), logits.double().sum(-1, keepdim=True), torch.float32)
    assert close(
        rows.l2_norm(logits, 1e-6), (logits.double().pow(2).sum(-1, keepdim=True) + 1e-6).sqrt(), torch.float32
    )
    probs = torch.softmax(rand(g, 3, 2500), -1)
    assert close(rows.cumsum(probs), probs.double().cumsum(-1), torch.float32)
    assert same(rows.cumsum(probs[1:2]), rows.cumsum(probs)[1:2])


def test_long_rows_use_fixed_tiles() -> None:
    g = gen(2)
    vocab = rows.ONE_BLOCK_MAX + 1000  # past one block: the tiled three-pass path
    logits = rand(g, 3, vocab, scale=4.0)
    out = rows.log_softmax(logits)
    assert close(out, torch.log_softmax(logits.double(), -1), torch.float32)
    assert same(rows.log_softmax(logits[1:2]), out[1:2])


@pytest.mark.parametrize("dtype", DTYPES)
def test_pointwise_kernels(dtype: torch.dtype) -> None:
    g = gen(3)
    x = rand(g, 1500, dtype=dtype, scale=4.0)
    refs = {
        "silu": torch.nn.functional.silu,
        "sigmoid": torch.sigmoid,
        "softplus": torch.nn.functional.softplus,
        "exp": torch.exp,
    }
    for op, fn in refs.items():
        y = pointwise.unary(op, x)
        assert close(y, fn(x.double()), dtype), op
        assert same(pointwise.unary(op, x[1001:1003]), y[1001:1003]), op  # an element's offset does not matter
    gate, up = rand(g, 7, 33, dtype=dtype), rand(g, 7, 33, dtype=dtype)
    y = pointwise.silu_mul(gate, up)
    assert close(y, torch.nn.functional.silu(gate.double()) * up.double(), dtype)
    assert same(pointwise.silu_mul(gate[3:4], up[3:4]), y[3:4])
    # the two halves of a fused gate/up projection, read in place (strided rows): the same bits
    fused = torch.cat([gate, up], dim=1)
    halves = fused.split(33, dim=1)
    assert halves[0].stride(0) == 66
    assert same(pointwise.silu_mul(*halves), y)
    assert same(pointwise.silu_mul(gate.view(7, 3, 11), up.view(7, 3, 11)), y.view(7, 3, 11))  # any shape


@pytest.mark.parametrize("rot", [16, 8])
def test_rotary_matches_the_table_formula(rot: int) -> None:
    g = gen(4)
    rope = RotaryEmbedding(16, rot, {"rope_type": "default", "rope_theta": 10000.0}, 64)
    x = rand(g, 6, 3, 16)
    pos = torch.tensor([0, 5, 9, 33, 34, 63])
    y = rotary.apply_rotary(
        x, pos.to(DEVICE), rope.cos[:, :rot].contiguous().to(DEVICE), rope.sin[:, :rot].contiguous().to(DEVICE)
    )
    ref = rope.apply(x.cpu(), pos)
    assert close(y.cpu(), ref, torch.float32)
    assert same(
        rotary.apply_rotary(
            x[2:3],
            pos[2:3].to(DEVICE),
            rope.cos[:, :rot].contiguous().to(DEVICE),
            rope.sin[:, :rot].contiguous().to(DEVICE),
        ),
        y[2:3],
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rot", [16, 8])
def test_rotary_fused_with_the_kv_write_gives_the_same_bits(dtype: torch.dtype, rot: int) -> None:
    """q/k/v as strided views of one fused projection; the fused kernel against rotary then a slot write."""
    g = gen(6)
    rope = RotaryEmbedding(16, rot, {"rope_type": "default", "rope_theta": 10000.0}, 64)
    cos, sin = rope.cos[:, :rot].contiguous().to(DEVICE), rope.sin[:, :rot].contiguous().to(DEVICE)
    tokens, hq, hkv, d = 5, 4, 2, 16
    qkv = rand(g, tokens, (hq + 2 * hkv) * d, dtype=dtype)
    q, k, v = (t.view(tokens, -1, d) for t in qkv.split([hq * d, hkv * d, hkv * d], dim=-1))
    pos = torch.tensor([0, 7, 8, 40, 63], device=DEVICE)
    slots = torch.tensor([9, 2, 30, 17, 4], device=DEVICE)
    k_cache, v_cache = (torch.zeros(32, hkv, d, dtype=dtype, device=DEVICE) for _ in range(2))
    q_out = rotary.rope_write_kv(q, k, v, pos, cos, sin, k_cache, v_cache, slots)
    assert same(q_out, rotary.apply_rotary(q, pos, cos, sin))
    assert same(k_cache[slots], rotary.apply_rotary(k, pos, cos, sin))
    assert same(v_cache[slots], v.contiguous())
    untouched = torch.ones(32, dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    assert not k_cache[untouched].any() and not v_cache[untouched].any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("d", "rot", "w_dtype"), [(16, 16, None), (16, 8, None), (128, 128, None), (128, 64, torch.float32)]
)
def test_qk_norm_fused_into_the_rotary_write_is_row_invariant_and_agrees(
    dtype: torch.dtype, d: int, rot: int, w_dtype: torch.dtype | None
) -> None:
    """Qwen3's per-head q/k RMSNorm inside the rotary + KV-write launch: a token's rows are the same bits alone
    or in a batch, and agree with the row kernel, then rotary, then the write (within rounding: the fused
    program may sum a row in another order). Real head sizes (128), partial rotary (the unrotated lanes keep
    the normalised value), and Qwen3-Next's float32 ``1 + w`` weights (scaled in float32, rounded once) with
    its gated q (each head's query beside its gate: a head stride of 2d)."""
    g = gen(7)
    rope = RotaryEmbedding(d, rot, {"rope_type": "default", "rope_theta": 10000.0}, 64)
    cos, sin = rope.cos[:, :rot].contiguous().to(DEVICE), rope.sin[:, :rot].contiguous().to(DEVICE)
    tokens, hq, hkv, eps = 6, 4, 2, 1e-6
    gated = w_dtype == torch.float32
    q_width = hq * d * (2 if gated else 1)
    qkv = rand(g, tokens, q_width + 2 * hkv * d, dtype=dtype, scale=3.0)
    q, k, v = qkv.split([q_width, hkv * d, hkv * d], dim=-1)
    q = q.view(tokens, hq, 2 * d)[..., :d] if gated else q.view(tokens, hq, d)
    k, v = k.view(tokens, hkv, d), v.view(tokens, hkv, d)
    q_w, k_w = (rand(g, d, dtype=w_dtype or dtype) + 1.0 for _ in range(2))
    assert rotary.fusable_norm(q, q_w, k_w)
    pos = torch.tensor([0, 7, 8, 40, 63, 1], device=DEVICE)
    slots = torch.tensor([9, 2, 30, 17, 4, 11], device=DEVICE)
    k_cache, v_cache = (torch.zeros(32, hkv, d, dtype=dtype, device=DEVICE) for _ in range(2))
    q_out = rotary.rope_write_kv(q, k, v, pos, cos, sin, k_cache, v_cache, slots, (q_w, k_w, eps))
    for t in (0, 3):  # a token alone: its rows and its cache slots hold the batch's bits
        k_alone, v_alone = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
        one = slice(t, t + 1)
        q_one = rotary.rope_write_kv(
            q[one], k[one], v[one], pos[one], cos, sin, k_alone, v_alone, slots[one], (q_w, k_w, eps)
        )
        assert same(q_one, q_out[one]) and same(k_alone[slots[one]], k_cache[slots[one]])
    q_n = rows.rms_norm(q.reshape(-1, d), q_w, eps)[0].view(tokens, hq, d)
    k_n = rows.rms_norm(k.reshape(-1, d), k_w, eps)[0].view(tokens, hkv, d)
    assert close(q_out, rotary.apply_rotary(q_n, pos, cos, sin), dtype)
    assert close(k_cache[slots], rotary.apply_rotary(k_n, pos, cos, sin), dtype)
    assert same(v_cache[slots], v.contiguous())
    ref = torch.nn.functional.rms_norm(q.double(), (d,), q_w.double(), eps)  # the norm itself, before rotary
    assert close(q_out, rope.apply(ref.cpu(), pos.cpu()).to(DEVICE), dtype)
    # a weight that would promote the rows' dtype is not fused (the caller norms first)
    assert not rotary.fusable_norm(q.to(torch.bfloat16), q_w.float().double(), k_w.double())


def _paged(g: torch.Generator, lengths: list[int], hkv: int, d: int, block: int, dtype: torch.dtype):
    """K/V for several requests in a shuffled pool of blocks."""
    total_blocks = sum(-(-n // block) for n in lengths) + 3
    order = torch.randperm(total_blocks, generator=g).tolist()
    tables, used = [], 0
    for n in lengths:
        nb = -(-n // block)
        tables.append(order[used : used + nb])
        used += nb
    k = rand(g, total_blocks * block, hkv, d, dtype=dtype)
    v = rand(g, total_blocks * block, hkv, d, dtype=dtype)
    return k, v, tables


def _reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: list[int], block: int, start: int, scale: float
):
    n = start + q.shape[0]
    slots = torch.tensor([table[p // block] * block + p % block for p in range(n)])
    kk, vv = k.cpu().double()[slots], v.cpu().double()[slots]
    rep = q.shape[1] // k.shape[1]
    kk, vv = kk.repeat_interleave(rep, 1), vv.repeat_interleave(rep, 1)
    s = torch.einsum("qhd,khd->hqk", q.cpu().double(), kk) * scale
    mask = torch.arange(n)[None, :] <= torch.arange(start, n)[:, None]
    s = s.masked_fill(~mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), vv)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("split", [attention.SPLIT, 64])  # 64: several fixed splits per row, combined in order
def test_attention_is_the_same_for_prefill_chunks_decode_and_batch(
    dtype: torch.dtype, split: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(attention, "SPLIT", split)
    g = gen(5)
    hq, hkv, d, block, scale = 4, 2, 16, 4, 0.25
    lengths = [70, 23]
    k, v, tables = _paged(g, lengths, hkv, d, block, dtype)
    qs = [rand(g, n, hq, d, dtype=dtype) for n in lengths]

    def run(pieces: list[tuple[int, int, int]]) -> torch.Tensor:
        """pieces: (request, start, length) in one launch -> outputs concatenated."""
        meta = attention.AttentionMeta.build(
            [(sum(p[2] for p in pieces[:i]), s, n, tables[r]) for i, (r, s, n) in enumerate(pieces)], DEVICE
        )
        q = torch.cat([qs[r][s : s + n] for r, s, n in pieces])
        walked = attention.paged_attention(q, k, v, meta, block, scale, parallel_splits=False)
        # the flash-decoding form (a program per split, then the fold) gives the same bits
        assert same(attention.paged_attention(q, k, v, meta, block, scale, parallel_splits=True), walked)
        # a captured graph knows only a bound on the contexts (the longest served): the splits past a
        # tile's keys exit at once, and the fold stops before them
        bounded = dataclasses.replace(meta, max_keys=meta.max_keys + 3 * attention.SPLIT)
        assert same(attention.paged_attention(q, k, v, bounded, block, scale, parallel_splits=True), walked)
        return walked

    whole = run([(0, 0, 70)])
    assert close(whole, _reference(qs[0], k, v, tables[0], block, 0, scale), dtype)
    chunked = torch.cat([run([(0, s, n)]) for s, n in ((0, 13), (13, 1), (14, 40), (54, 16))])
    assert same(chunked, whole)  # however the prompt was chunked
    for p in (0, 15, 16, 31, 32, 33, 69):  # decode of one position
        assert same(run([(0, p, 1)]), whole[p : p + 1]), p
    mixed = run([(1, 0, 23), (0, 30, 9), (0, 69, 1)][::-1])  # batch partners, any order
    assert same(mixed[:1], whole[69:70]) and same(mixed[1:10], whole[30:39])
    assert same(mixed[10:], run([(1, 0, 23)]))


@pytest.mark.parametrize(("hq", "hkv", "d"), [(6, 2, 16), (5, 1, 24), (7, 1, 20), (9, 3, 80)])
def test_attention_takes_any_gqa_ratio_and_head_size(hq: int, hkv: int, d: int) -> None:
    """GQA ratios 3, 5, 7 (SmolLM2's 9/3) and head sizes that are not powers of two (80: Phi, 96)."""
    g = gen(9)
    block, scale = 4, d**-0.5
    k, v, tables = _paged(g, [21], hkv, d, block, torch.float32)
    q = rand(g, 21, hq, d)

    def run(start: int, n: int) -> torch.Tensor:
        meta = attention.AttentionMeta.build([(0, start, n, tables[0])], DEVICE)
        return attention.paged_attention(q[start : start + n], k, v, meta, block, scale)

    whole = run(0, 21)
    assert close(whole, _reference(q, k, v, tables[0], block, 0, scale), torch.float32)
    assert same(torch.cat([run(0, 17), run(17, 1), run(18, 3)]), whole)


@pytest.mark.parametrize(("hq", "hkv", "d"), [(2, 1, 32), (4, 2, 16)])
def test_attention_query_tiles_of_other_sizes_agree_with_the_reference(hq: int, hkv: int, d: int) -> None:
    """Tiles of 1 position (padded to 16 rows for tl.dot), 4 and 64 (a GPU model's decode and prefill tiles in
    half precision: attention_meta.query_tiles): all agree with the reference. Whether two sizes give a row the
    same bits is the GPU's to show (tests/test_triton_engine.py there; the interpreter's NumPy products follow
    the tile's rows). Metas are built with BLOCK_Q's tiles unless asked otherwise."""
    g = gen(11)
    n, block, scale = 100, 16, d**-0.5
    k, v, tables = _paged(g, [n], hkv, d, block, torch.float32)
    q = rand(g, n, hq, d)
    ref = _reference(q, k, v, tables[0], block, 0, scale)

    def run(start: int, nq: int, reverse: bool = False, **block_q: int) -> torch.Tensor:
        meta = attention.AttentionMeta.build([(0, start, nq, tables[0])], DEVICE, **block_q)
        if reverse:  # the tiles in the other order (each program is independent of the others)
            meta = dataclasses.replace(meta, tile_seq=meta.tile_seq.flip(0), tile_pos0=meta.tile_pos0.flip(0))
        return attention.paged_attention(q[start : start + nq], k, v, meta, block, scale)

    default = attention.AttentionMeta.build([(0, 0, n, tables[0])], DEVICE)
    assert default.block_q == attention.BLOCK_Q and default.tile_pos0.tolist() == list(range(0, n, attention.BLOCK_Q))
    assert close(run(0, n, block_q=64), ref, torch.float32)
    # tiles of 4 positions padded to 16 rows: the rows past the tile's positions are masked (they would write
    # the next tile's rows with too few keys; the interpreter runs programs in order, so reverse them to see it)
    small = run(0, n, block_q=4)
    assert close(small, ref, torch.float32) and same(run(0, n, reverse=True, block_q=4), small)
    for p in (0, 37, n - 1):  # decode of one position in a tile of its own
        assert close(run(p, 1, block_q=1), ref[p : p + 1], torch.float32), p


@pytest.mark.parametrize("split_tiles", [False, True], ids=["uniform", "split"])
def test_precompile_runs_both_forms_and_they_agree(split_tiles: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """In the model's prefill tiles: BLOCK_Q's, or a GPU model's 128-row ones (64 positions at GQA 2)."""
    g = gen(8)
    k, v = (rand(g, 4 * 16 + 2, 2, 16) for _ in range(2))
    tiles = attention_meta.QueryTiles(1, 64, 1, 8, 32) if split_tiles else attention_meta.UNIFORM_TILES
    launched = []  # the tiles each compile ran (the interpreter runs any warps alike, so the bits cannot tell)
    real = attention.paged_attention
    monkeypatch.setattr(attention, "paged_attention", lambda q, *a, **kw: launched.append(a[2]) or real(q, *a, **kw))
    walked, parallel = attention.precompile(4, k, v, 16, tiles)  # block 0 only, over two splits
    want = (tiles.prefill, tiles.prefill_warps, tiles.block_n)
    assert [(m.block_q, m.warps, m.block_n) for m in launched] == [want, want]
    assert same(walked, parallel)
    ref = _reference(torch.ones(1, 4, 16), k, v, [0] * 65, 16, attention.SPLIT, 1.0)
    assert close(walked, ref, torch.float32)


def test_bitwise_helper_sees_the_last_bit() -> None:
    a = torch.tensor([1.0])
    b = torch.tensor([struct.unpack("<f", struct.pack("<I", struct.unpack("<I", struct.pack("<f", 1.0))[0] + 1))[0]])
    assert not same(a, b) and same(a, a.clone())


@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_weights_compute_the_bits_of_their_dequantized_twin(dtype: torch.dtype) -> None:
    """W8A16: an FP8 weight with block scales, dequantized per tile inside the GEMM, gives the bits of the same
    GEMM on ``fp8.dequantize`` of it - plain, fused SwiGLU (a block holding gate and up rows), and the MoE
    experts - and a row's bits do not depend on the batch. Blocks of 16 x 32 over 40 x 72: edge blocks."""
    from kvwarden.layers.fp8 import BlockFp8, quantize
    from kvwarden.layers.kernels import moe

    g = gen(7)
    w = torch.randn(40, 72, generator=g)
    q, s = quantize(w, (16, 32))
    fp8 = BlockFp8(q.to(DEVICE), s.to(DEVICE), (16, 32), dtype)
    dense = fp8.dequantize()
    x = rand(g, 9, 72, dtype=dtype)
    y = gemm.linear(x, fp8)
    assert same(y, gemm.linear(x, dense))
    assert same(gemm.linear(x[:1], fp8), y[:1])
    glu = gemm_forms.linear_swiglu(x, fp8)  # 20 gate rows then 20 up rows: block 1 holds both
    assert same(glu, gemm_forms.linear_swiglu(x, dense))
    experts = [quantize(torch.randn(2 * 24, 72, generator=g), (16, 32)) for _ in range(3)]
    downs = [quantize(torch.randn(72, 24, generator=g), (16, 32)) for _ in range(3)]
    w_gu = BlockFp8(*(torch.stack(t).to(DEVICE) for t in zip(*experts, strict=True)), (16, 32), dtype)
    w_dn = BlockFp8(*(torch.stack(t).to(DEVICE) for t in zip(*downs, strict=True)), (16, 32), dtype)
    chosen = torch.tensor([[0, 2], [1, 0], [2, 1], [0, 1], [2, 0], [1, 2], [0, 2], [1, 0], [2, 1]], device=DEVICE)
    weights = torch.full((9, 2), 0.5, dtype=dtype, device=DEVICE)
    got = moe.experts(x, chosen, weights, w_gu, w_dn)
    assert same(got, moe.experts(x, chosen, weights, w_gu.dequantize(), w_dn.dequantize()))
    assert same(moe.experts(x[3:4], chosen[3:4], weights[3:4], w_gu, w_dn), got[3:4])
