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
* ``latent_attention``: one program per (query, block of ``HB`` heads), the query's ``K`` candidates
  walked in selection (column) order in tiles of ``BK`` with an online softmax: the tile size is a constant, the walk
  order is the selection's (a function of the scores alone), invisible candidates get ``exp(-inf) = 0``.
  The result of a query does not depend on the other queries of the launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvwarden.layers.kernels.gemm import INTERPRETED

BLOCK_KEYS = 32  # key positions per index-score tile
BLOCK_CANDIDATES = 32  # selected candidates per attention tile


@triton.jit
def _product(a, b, DOT: tl.constexpr):
    """``a [M, D] @ b [N, D]^T`` in float32: ``tl.dot`` compiled, an in-order element-wise sum interpreted."""
    if DOT:
        return tl.dot(a, tl.trans(b), input_precision="ieee")
    return tl.sum(a[:, None, :] * b[None, :, :], axis=2)


@triton.jit(do_not_specialize=["C", "T"])
def _index_scores_kernel(
    q_ptr, w_ptr, k_ptr, table_ptr, req_ptr, pos_ptr, out_ptr, T, C, scale,
    H: tl.constexpr, D: tl.constexpr, HP: tl.constexpr, DP: tl.constexpr, BN: tl.constexpr, DOT: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    j = tl.program_id(1) * BN + tl.arange(0, BN)
    h, d = tl.arange(0, HP), tl.arange(0, DP)
    req = tl.load(req_ptr + t).to(tl.int64)
    pos = tl.load(pos_ptr + t)
    visible = (j <= pos) & (j < C)
    slots = tl.load(table_ptr + req * C + j, mask=visible, other=0).to(tl.int64)
    k = tl.load(k_ptr + slots[:, None] * D + d[None, :], mask=visible[:, None] & (d[None, :] < D), other=0.0)
    row = t.to(tl.int64) * H
    q = tl.load(q_ptr + (row + h[:, None]) * D + d[None, :], mask=(h[:, None] < H) & (d[None, :] < D), other=0.0)
    w = tl.load(w_ptr + row + h, mask=h < H, other=0.0)
    s = tl.maximum(_product(q, k.to(tl.float32), DOT) * scale, 0.0)
    total = tl.sum(s * w[:, None], axis=0)
    total = tl.where(visible, total, float("-inf"))
    tl.store(out_ptr + t.to(tl.int64) * C + j, total, mask=j < C)


def index_scores(
    q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, table: torch.Tensor, req: torch.Tensor, pos: torch.Tensor,
    scale: float,
) -> torch.Tensor:  # fmt: skip
    """Scores ``[T, C]`` (float32, ``-inf`` past each query) of every query over its request's indexer keys.

    Args:
        q: ``[T, H, D]`` float32 indexer queries (rope applied).
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
        _index_scores_kernel[grid](
            q.contiguous(), w.contiguous(), keys.contiguous(), table.contiguous(), req, pos, out, t, c, scale,
            H=h, D=d, HP=hp, DP=dp, BN=BLOCK_KEYS, DOT=not INTERPRETED,
        )  # fmt: skip
    return out


@triton.jit(do_not_specialize=["T", "K"])
def _latent_attention_kernel(
    q_ptr, lat_ptr, sel_ptr, vis_ptr, out_ptr, T, K, scale,
    H: tl.constexpr, L: tl.constexpr, R: tl.constexpr, HB: tl.constexpr, LP: tl.constexpr, BK: tl.constexpr,
    DOT: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    h = tl.program_id(1) * HB + tl.arange(0, HB)
    c = tl.arange(0, LP)
    hmask = h < H
    qmask = hmask[:, None] & (c[None, :] < L)
    q = tl.load(q_ptr + (t.to(tl.int64) * H + h[:, None]) * L + c[None, :], mask=qmask, other=0.0)
    m = tl.full((HB,), float("-inf"), tl.float32)
    s_sum = tl.zeros((HB,), tl.float32)
    acc = tl.zeros((HB, LP), tl.float32)
    for k0 in range(0, K, BK):  # NOTE(invariance): fixed tiles in selection order
        kk = k0 + tl.arange(0, BK)
        kin = kk < K
        base = t.to(tl.int64) * K + kk
        vis = (tl.load(vis_ptr + base, mask=kin, other=0) != 0) & kin
        slot = tl.load(sel_ptr + base, mask=kin, other=0).to(tl.int64)
        rows = tl.load(lat_ptr + slot[:, None] * L + c[None, :], mask=vis[:, None] & (c[None, :] < L), other=0.0)
        rows = rows.to(tl.float32)
        s = _product(q, rows, DOT) * scale
        s = tl.where(vis[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_use[:, None])
        alpha = tl.exp(m - m_use)
        s_sum = s_sum * alpha + tl.sum(p, axis=1)
        if DOT:
            pv = tl.dot(p, rows, input_precision="ieee")
        else:
            pv = tl.sum(p[:, :, None] * rows[None, :, :], axis=1)
        acc = acc * alpha[:, None] + pv
        m = m_new
    out = acc / s_sum[:, None]
    tl.store(out_ptr + (t.to(tl.int64) * H + h[:, None]) * R + c[None, :], out, mask=hmask[:, None] & (c[None, :] < R))


def latent_attention(
    q: torch.Tensor, latent: torch.Tensor, selected: torch.Tensor, visible: torch.Tensor, kv_lora_rank: int,
    scale: float,
) -> torch.Tensor:  # fmt: skip
    """``[T, H, r]`` float32: each query's attention-weighted latent over its selected cache rows.

    Args:
        q: ``[T, H, L]`` float32 (``q_nope @ W_uk`` per head, then the rotated part).
        latent: ``[slots, L]`` the layer's latent cache (``[c | k_rope]`` rows).
        selected: ``[T, K]`` cache slots of each query's candidates in column order.
        visible: ``[T, K]`` which candidates it may attend to (the first always).
        kv_lora_rank: ``r``; scale: the softmax scale.
    """
    t, h, width = q.shape
    k = selected.shape[1]
    out = torch.empty((t, h, kv_lora_rank), dtype=torch.float32, device=q.device)
    if t:
        hb = 16
        grid = (t, triton.cdiv(h, hb))
        _latent_attention_kernel[grid](
            q.contiguous(), latent.contiguous(), selected.contiguous(), visible.to(torch.int8).contiguous(), out,
            t, k, scale, H=h, L=width, R=kv_lora_rank, HB=hb, LP=triton.next_power_of_2(width), BK=BLOCK_CANDIDATES,
            DOT=not INTERPRETED, num_stages=1,
        )  # fmt: skip
        # num_stages=1: GLM-5's 576-wide latent rows in bfloat16 overflowed the H200's shared memory when
        # Triton pipelined the candidate loads (264 KB of 232); the stages change scheduling, not arithmetic
    return out
