"""Sparse attention's GPU kernels (GLM-5 / DeepSeek-V3.2): the indexer's scores over the paged indexer
cache, and latent attention over each query's selected cache rows. The selection between them is
``kernels/topk.py``; ``models/mla_block.py`` calls all three on the Triton backend, and
``layers/sparse_attention.py`` (the CPU path) is their reference in the tests.

NOTE(invariance), by construction:

* ``index_scores``: one program per (query, tile of ``BN`` key positions). A score is
  ``sum_h w[h] * relu(scale * q[h] . k[j])``: the dot products come from one fixed-shape product per
  tile (``[HP, DP] x [DP, BN]``, shapes from the model's indexer heads and head size), the heads are
  summed by one ``tl.sum`` over a fixed ``HP`` axis. Nothing depends on the number of queries in the
  launch, on the request's context length or on which tile a key lands in beyond its position: every
  tile has the same shape and a key's column in it does not change its arithmetic (compiled ``tl.dot``
  treats every column of its tile alike; under the interpreter the product is an element-wise multiply
  and an in-order sum, as in ``kernels/gemm.py``). Positions past the query score ``-inf``.
* ``latent_attention``: per (query, block of ``HB`` heads), the query's ``K`` candidates in selection
  (column) order, cut into splits of ``SPLIT_CANDIDATES`` at fixed boundaries (0, S, 2S, ...) and walked
  in tiles of ``BK`` with an online softmax per split; the splits' states are then folded in split order
  by one formula (``attention._merge``). A score is the latent part's product plus the rotary part's
  (two fixed-shape products, no padding of the 576-wide row to 1,024); the values are the latent part
  only. Tile and split sizes are constants, the order is the selection's (a function of the scores
  alone), invisible candidates get ``exp(-inf) = 0`` and an all-invisible split is the fold's identity.
  As for paged attention, the splits run walked in one program or in parallel (one program per split,
  then a fold; decode-sized launches), with the same state function and fold: a speed choice only. The
  result of a query does not depend on the other queries of the launch. A tile of candidates none of
  which is visible is skipped: which tiles those are follows from the query's own selection.
* Precision (both kernels): a bfloat16 / float16 cache's products run on the tensor cores with the
  queries (and the probabilities, for ``P @ V``) rounded to its dtype and float32 accumulation; a float32
  cache keeps IEEE float32 products. The rounding points are fixed per model, like the tiles.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvwarden.layers.kernels.attention import _merge
from kvwarden.layers.kernels.gemm import INTERPRETED

BLOCK_KEYS = 32  # key positions per index-score tile
BLOCK_CANDIDATES = 32  # selected candidates per attention tile
SPLIT_CANDIDATES = 128  # candidates per split (a multiple of BLOCK_CANDIDATES): fixed boundaries, folded in order
LOW_PRECISION = (torch.bfloat16, torch.float16)  # caches whose products run on the tensor cores
HEADS_PER_PROGRAM = 16  # a tile's query heads (the matrix product's smallest row count)
FEW_PROGRAMS = 128  # launches of fewer (query, head block) programs than this run their splits in parallel


@triton.jit
def _product(a, b, DOT: tl.constexpr, LOWP: tl.constexpr):
    """``a [M, D] @ b [N, D]^T`` accumulated in float32: ``tl.dot`` compiled (the tensor cores' bf16/fp16 path
    when ``LOWP``, else IEEE float32), an in-order element-wise sum of the same inputs interpreted."""
    if DOT:
        if LOWP:
            return tl.dot(a, tl.trans(b))
        return tl.dot(a, tl.trans(b), input_precision="ieee")
    return tl.sum(a.to(tl.float32)[:, None, :] * b.to(tl.float32)[None, :, :], axis=2)


@triton.jit(do_not_specialize=["C", "T"])
def _index_scores_kernel(
    q_ptr, w_ptr, k_ptr, table_ptr, req_ptr, pos_ptr, out_ptr, T, C, scale,
    H: tl.constexpr, D: tl.constexpr, HP: tl.constexpr, DP: tl.constexpr, BN: tl.constexpr, DOT: tl.constexpr,
    LOWP: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    j0 = tl.program_id(1) * BN
    j = j0 + tl.arange(0, BN)
    pos = tl.load(pos_ptr + t)
    total = tl.full((BN,), float("-inf"), tl.float32)
    if j0 <= pos:  # a tile wholly past the query is all -inf: no key is loaded (a prefill's upper half)
        h, d = tl.arange(0, HP), tl.arange(0, DP)
        req = tl.load(req_ptr + t).to(tl.int64)
        visible = (j <= pos) & (j < C)
        slots = tl.load(table_ptr + req * C + j, mask=visible, other=0).to(tl.int64)
        k = tl.load(k_ptr + slots[:, None] * D + d[None, :], mask=visible[:, None] & (d[None, :] < D), other=0.0)
        if not LOWP:
            k = k.to(tl.float32)
        row = t.to(tl.int64) * H
        hd = (h[:, None] < H) & (d[None, :] < D)
        q = tl.load(q_ptr + (row + h[:, None]) * D + d[None, :], mask=hd, other=0.0)
        w = tl.load(w_ptr + row + h, mask=h < H, other=0.0)
        s = tl.maximum(_product(q, k, DOT, LOWP) * scale, 0.0)
        total = tl.where(visible, tl.sum(s * w[:, None], axis=0), float("-inf"))
    tl.store(out_ptr + t.to(tl.int64) * C + j, total, mask=j < C)


def index_scores(
    q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, table: torch.Tensor, req: torch.Tensor, pos: torch.Tensor,
    scale: float,
) -> torch.Tensor:  # fmt: skip
    """Scores ``[T, C]`` (float32, ``-inf`` past each query) of every query over its request's indexer keys.

    The products take the cache's precision: a bfloat16 (float16) cache multiplies queries rounded to it on
    the tensor cores, accumulating in float32. For a model of that dtype the rounding is exact (its queries
    come from projections and a rotary computed in it); a float32 cache keeps IEEE float32 products.

    Args:
        q: ``[T, H, D]`` indexer queries (rope applied), in the model's dtype or float32.
        w: ``[T, H]`` float32 head weights (``weights_proj`` output times ``H ** -0.5``).
        keys: ``[slots, D]`` the layer's indexer cache.
        table: ``[R, C]`` each request's cache slot per position (padded past its context).
        req: ``[T]`` request of each query; ``pos``: ``[T]`` its position.
        scale: ``D ** -0.5``.
    """
    t, h, d = q.shape
    c = table.shape[1]
    out = torch.empty((t, c), dtype=torch.float32, device=q.device)
    if t and c:
        hp, dp = max(16, triton.next_power_of_2(h)), max(16, triton.next_power_of_2(d))
        grid = (t, triton.cdiv(c, BLOCK_KEYS))
        lowp = keys.dtype in LOW_PRECISION
        _index_scores_kernel[grid](
            q.to(keys.dtype if lowp else torch.float32).contiguous(), w.contiguous(), keys.contiguous(),
            table.contiguous(), req, pos, out, t, c, scale,
            H=h, D=d, HP=hp, DP=dp, BN=BLOCK_KEYS, DOT=not INTERPRETED, LOWP=lowp,
        )  # fmt: skip
    return out


@triton.jit
def _latent_q(q_ptr, t, h, H, L, R: tl.constexpr, RP: tl.constexpr, EP: tl.constexpr):
    """A query's ``[HB, RP]`` latent part and ``[HB, EP]`` rotary part (a row is ``L = R + rope`` wide)."""
    cr, er = tl.arange(0, RP), tl.arange(0, EP)
    row = (t.to(tl.int64) * H + h[:, None]) * L
    hmask = h[:, None] < H
    q_c = tl.load(q_ptr + row + cr[None, :], mask=hmask & (cr[None, :] < R), other=0.0)
    q_r = tl.load(q_ptr + row + R + er[None, :], mask=hmask & (er[None, :] < L - R), other=0.0)
    return q_c, q_r


@triton.jit
def _candidates_state(
    q_c, q_r, lat_ptr, sel_ptr, vis_ptr, t, K, split0, scale, L,
    R: tl.constexpr, HB: tl.constexpr, RP: tl.constexpr, EP: tl.constexpr, BK: tl.constexpr,
    SPLIT_: tl.constexpr, DOT: tl.constexpr, LOWP: tl.constexpr,
):  # fmt: skip
    """Online-softmax state (max, sum, latent accumulator) of one split: candidates ``[split0, split0 + SPLIT_)``."""
    cr, er = tl.arange(0, RP), tl.arange(0, EP)
    m = tl.full((HB,), float("-inf"), tl.float32)
    s_sum = tl.zeros((HB,), tl.float32)
    acc = tl.zeros((HB, RP), tl.float32)
    for k0 in range(split0, tl.minimum(split0 + SPLIT_, K), BK):  # NOTE(invariance): fixed tiles in selection order
        kk = k0 + tl.arange(0, BK)
        kin = kk < K
        base = t.to(tl.int64) * K + kk
        vis = (tl.load(vis_ptr + base, mask=kin, other=0) != 0) & kin
        # NOTE(invariance): a tile with no visible candidate is skipped. Which tiles those are is a function
        # of the query's selection alone (its -inf candidates), so a query skips the same tiles in any launch.
        if tl.sum(vis.to(tl.int32), axis=0) > 0:
            slot = tl.load(sel_ptr + base, mask=kin, other=0).to(tl.int64)
            c_mask = vis[:, None] & (cr[None, :] < R)
            rows_c = tl.load(lat_ptr + slot[:, None] * L + cr[None, :], mask=c_mask, other=0.0)
            r_mask = vis[:, None] & (er[None, :] < L - R)
            rows_r = tl.load(lat_ptr + slot[:, None] * L + R + er[None, :], mask=r_mask, other=0.0)
            if not LOWP:
                rows_c, rows_r = rows_c.to(tl.float32), rows_r.to(tl.float32)
            s = (_product(q_c, rows_c, DOT, LOWP) + _product(q_r, rows_r, DOT, LOWP)) * scale
            s = tl.where(vis[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(s - m_use[:, None])
            alpha = tl.exp(m - m_use)
            s_sum = s_sum * alpha + tl.sum(p, axis=1)
            if LOWP:  # the probabilities rounded to the cache's dtype for the product (as flash attention)
                p = p.to(rows_c.dtype)
            if DOT:
                pv = tl.dot(p, rows_c) if LOWP else tl.dot(p, rows_c, input_precision="ieee")
            else:
                pv = tl.sum(p.to(tl.float32)[:, :, None] * rows_c.to(tl.float32)[None, :, :], axis=1)
            acc = acc * alpha[:, None] + pv
            m = m_new
    return m, s_sum, acc


@triton.jit
def _store_out(out_ptr, t, h, acc, s_sum, H, R: tl.constexpr, RP: tl.constexpr):
    cr = tl.arange(0, RP)
    out = acc / s_sum[:, None]
    tl.store(
        out_ptr + (t.to(tl.int64) * H + h[:, None]) * R + cr[None, :], out, mask=(h[:, None] < H) & (cr[None, :] < R)
    )


@triton.jit(do_not_specialize=["T", "K"])
def _latent_attention_kernel(
    q_ptr, lat_ptr, sel_ptr, vis_ptr, out_ptr, T, K, scale,
    H: tl.constexpr, L: tl.constexpr, R: tl.constexpr, HB: tl.constexpr, RP: tl.constexpr, EP: tl.constexpr,
    BK: tl.constexpr, SPLIT_: tl.constexpr, DOT: tl.constexpr, LOWP: tl.constexpr,
):  # fmt: skip
    """Walked: one program per (query, head block), every split in turn, folded as it finishes."""
    t = tl.program_id(0)
    h = tl.program_id(1) * HB + tl.arange(0, HB)
    q_c, q_r = _latent_q(q_ptr, t, h, H, L, R, RP, EP)
    m_t = tl.full((HB,), float("-inf"), tl.float32)
    l_t = tl.zeros((HB,), tl.float32)
    acc_t = tl.zeros((HB, RP), tl.float32)
    for split0 in range(0, K, SPLIT_):
        m_s, l_s, acc_s = _candidates_state(
            q_c, q_r, lat_ptr, sel_ptr, vis_ptr, t, K, split0, scale, L, R, HB, RP, EP, BK, SPLIT_, DOT, LOWP
        )
        m_t, l_t, acc_t = _merge(m_t, l_t, acc_t, m_s, l_s, acc_s)
    _store_out(out_ptr, t, h, acc_t, l_t, H, R, RP)


@triton.jit(do_not_specialize=["T", "K", "NSPLIT"])
def _latent_split_kernel(
    q_ptr, lat_ptr, sel_ptr, vis_ptr, m_ptr, l_ptr, acc_ptr, T, K, NSPLIT, scale,
    H: tl.constexpr, L: tl.constexpr, R: tl.constexpr, HB: tl.constexpr, RP: tl.constexpr, EP: tl.constexpr,
    BK: tl.constexpr, SPLIT_: tl.constexpr, DOT: tl.constexpr, LOWP: tl.constexpr,
):  # fmt: skip
    """Parallel: one program per (query, head block, split), its state stored for the fold."""
    t = tl.program_id(0)
    hb = tl.program_id(1)
    split = tl.program_id(2)
    h = hb * HB + tl.arange(0, HB)
    q_c, q_r = _latent_q(q_ptr, t, h, H, L, R, RP, EP)
    m_s, l_s, acc_s = _candidates_state(
        q_c, q_r, lat_ptr, sel_ptr, vis_ptr, t, K, split * SPLIT_, scale, L, R, HB, RP, EP, BK, SPLIT_, DOT, LOWP
    )
    base = ((t.to(tl.int64) * tl.num_programs(1) + hb) * NSPLIT + split) * HB + tl.arange(0, HB)
    tl.store(m_ptr + base, m_s)
    tl.store(l_ptr + base, l_s)
    tl.store(acc_ptr + base[:, None] * RP + tl.arange(0, RP)[None, :], acc_s)


@triton.jit(do_not_specialize=["T", "NSPLIT"])
def _latent_fold_kernel(
    m_ptr, l_ptr, acc_ptr, out_ptr, T, NSPLIT,
    H: tl.constexpr, R: tl.constexpr, HB: tl.constexpr, RP: tl.constexpr,
):  # fmt: skip
    """Parallel: the stored split states of a (query, head block) folded in split order."""
    t = tl.program_id(0)
    hb = tl.program_id(1)
    h = hb * HB + tl.arange(0, HB)
    m_t = tl.full((HB,), float("-inf"), tl.float32)
    l_t = tl.zeros((HB,), tl.float32)
    acc_t = tl.zeros((HB, RP), tl.float32)
    for split in range(0, NSPLIT):
        base = ((t.to(tl.int64) * tl.num_programs(1) + hb) * NSPLIT + split) * HB + tl.arange(0, HB)
        m_s = tl.load(m_ptr + base)
        l_s = tl.load(l_ptr + base)
        acc_s = tl.load(acc_ptr + base[:, None] * RP + tl.arange(0, RP)[None, :])
        m_t, l_t, acc_t = _merge(m_t, l_t, acc_t, m_s, l_s, acc_s)
    _store_out(out_ptr, t, h, acc_t, l_t, H, R, RP)


def latent_attention(
    q: torch.Tensor, latent: torch.Tensor, selected: torch.Tensor, visible: torch.Tensor, kv_lora_rank: int,
    scale: float, parallel: bool | None = None,
) -> torch.Tensor:  # fmt: skip
    """``[T, H, r]`` float32: each query's attention-weighted latent over its selected cache rows.

    A bfloat16 cache takes ``q`` rounded to bfloat16 (exact for a bfloat16 model: ``q_nope @ W_uk`` and the
    rotary run in it) and rounds the softmax probabilities to it for ``P @ V``; see the module docstring.

    Args:
        q: ``[T, H, L]`` (``q_nope @ W_uk`` per head, then the rotated part), any float dtype.
        latent: ``[slots, L]`` the layer's latent cache (``[c | k_rope]`` rows).
        selected: ``[T, K]`` cache slots of each query's candidates in column order.
        visible: ``[T, K]`` which candidates it may attend to (the first always).
        kv_lora_rank: ``r``; scale: the softmax scale.
        parallel: run each split in its own program, then fold (``None``: when the launch has few
            (query, head block) programs, as a decode step has). The same bits either way.
    """
    t, h, width = q.shape
    k = selected.shape[1]
    out = torch.empty((t, h, kv_lora_rank), dtype=torch.float32, device=q.device)
    if not t:
        return out
    hb = HEADS_PER_PROGRAM
    heads = triton.cdiv(h, hb)
    # padded widths of the latent and rotary parts (16 at least: a matrix product's smallest inner size)
    rp, ep = (max(16, triton.next_power_of_2(n)) for n in (kv_lora_rank, width - kv_lora_rank))
    nsplit = triton.cdiv(k, SPLIT_CANDIDATES)
    if parallel is None:
        parallel = nsplit > 1 and t * heads < FEW_PROGRAMS
    lowp = latent.dtype in LOW_PRECISION  # products in the cache's precision, as index_scores
    q = q.to(latent.dtype if lowp else torch.float32)
    args = (q.contiguous(), latent.contiguous(), selected.contiguous(), visible.to(torch.int8).contiguous())
    const = dict(H=h, L=width, R=kv_lora_rank, HB=hb, RP=rp, EP=ep, BK=BLOCK_CANDIDATES, SPLIT_=SPLIT_CANDIDATES)
    const |= dict(DOT=not INTERPRETED, LOWP=lowp)
    # num_stages=1: GLM-5's latent rows in bfloat16 overflowed the H200's shared memory when Triton pipelined
    # the candidate loads (264 KB of 232); stages and warps change scheduling, never arithmetic
    if not parallel:
        _latent_attention_kernel[(t, heads)](*args, out, t, k, scale, **const, num_warps=8, num_stages=1)
        return out
    states = t * heads * nsplit * hb
    m_buf = torch.empty((states,), dtype=torch.float32, device=q.device)
    l_buf = torch.empty_like(m_buf)
    acc_buf = torch.empty((states, rp), dtype=torch.float32, device=q.device)
    _latent_split_kernel[(t, heads, nsplit)](
        *args, m_buf, l_buf, acc_buf, t, k, nsplit, scale, **const, num_warps=8, num_stages=1
    )
    _latent_fold_kernel[(t, heads)](m_buf, l_buf, acc_buf, out, t, nsplit, H=h, R=kv_lora_rank, HB=hb, RP=rp)
    return out
