"""Causal attention over the paged KV cache: prefill chunks and decode steps in one kernel.

NOTE(invariance), by construction - a query row at absolute position ``p``
computes the same bits whatever else is in the launch and however its prompt
was chunked:

* Query tiles are aligned to absolute positions: of ``B`` positions each (the
  meta's ``block_q``), tile ``p // B``, slot ``p % B``. The ``REP`` query heads sharing a KV head are rows of the
  same tile (GQA without copying K/V), each position's group padded to ``RP``
  rows (``REP`` rounded up to a power of two: Triton's tiles are powers of two,
  and GQA ratios of 3, 5, 6 or 7 are common); padding rows are masked queries,
  exact no-ops like rows past a request's end. With one tile size for every
  step (``BLOCK_Q``), a decode step of position ``p`` lands in the same slot of
  the same-shaped tile as the prefill of ``p`` would (split tile sizes: below).
* Keys are walked in tiles of ``BLOCK_N`` aligned to key position 0 (a constant of the model's head
  shape, :func:`key_tile`), grouped into splits of ``SPLIT`` keys at fixed absolute boundaries
  (0, SPLIT, 2*SPLIT, ...). Each split keeps its own online-softmax state (running max, sum,
  accumulator); the splits are then combined in split order with one fixed formula. So a row's
  arithmetic is a function of its position only: the same tiles, in the same order, with the same
  split boundaries.
* Tiles beyond a row's position (there when other rows of its tile reach
  further) are exact no-ops: their scores are ``-inf``, the running max is
  unchanged, the rescale factor is ``exp(0) = 1`` and the added terms are
  exact zeros (a split with no visible key keeps ``max = -inf, sum = 0,
  acc = 0``, and a safe max keeps ``exp`` away from ``-inf - -inf``).
* Prefill and decode run one kernel source: block sizes are constants of the
  model (head size, GQA ratio) and of the tile (next point), and the
  batch-dependent integers are not specialised.
* Decode steps and the rest may run different tiles (the model's ``QueryTiles``, ``attention_meta.py``):
  one position's group on one warp for a decode step, 128 rows (64 positions at GQA 2) on eight warps
  for a prefill chunk, a verify step or a mixed step. Each launch's ``M = max(16, block_q * RP)`` rows
  (rows past ``block_q * RP`` masked). Here the argument above is not enough: a row's products and
  reductions run in the layout Triton gives the tile, and two layouts may order a row's sums
  differently. They are used together only where the GPU computed every slot of both alike
  (``kvwarden bench attention_tiles --query-tiles`` over real checkpoints' head shapes, and the GPU tests'
  decode = prefill properties): bfloat16 and float16 on an architecture in ``attention_meta.SPLIT_TILE_ARCHS``.
  Everywhere else (float32's CUDA-core products, the CPU interpreter) one ``BLOCK_Q`` tile on four
  warps serves every step, and the argument above is the whole of it.

The split structure is what makes the parallel form (flash-decoding: one program per split storing
its state, then a fold) bitwise equal to the sequential one: both compute each split's state with the
same function (``_split_state``) and fold the states in split order with the same function (``_merge``).
Which form runs is a speed choice (few query tiles over long contexts: parallel), never a numerical one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvwarden.intmath import cdiv
from kvwarden.layers.kernels.attention_meta import BLOCK_Q, AttentionMeta, QueryTiles

__all__ = ["BLOCK_Q", "AttentionMeta", "key_tile", "paged_attention", "precompile", "split_in_parallel"]

# Keys per tile (aligned to key position 0): a constant of the model's head shape (key_tile), never of the step.
BLOCK_N, BLOCK_N_WIDE = 32, 64
WIDE_MAX_ELEMENTS = 16 * 4 * 128  # a tile's query rows x padded head size up to which keys come 64 at a time
# Keys per split: fixed absolute boundaries, combined in order (a multiple of every key tile). NOTE(invariance):
# like the key tile it moves where states are folded, so it is one constant for every step. The length is a speed
# choice measured by `kvwarden bench attention_tiles` (figures in docs/performance.md and CHANGELOG.md): shorter splits
# give a short context more programs, at the price of more folds.
SPLIT = 512
# When splits run in parallel (speed only: the bits are the same either way): launches of fewer
# (tile, head) programs than this, whose split states fit in this many programs' buffers and bytes.
FEW_PROGRAMS = 512
PARALLEL_MAX_PROGRAMS = 1 << 15
PARALLEL_MAX_BYTES = 128 << 20  # the split states' float32 buffers (the memory budget reserves them)


@triton.jit
def _split_state(
    q, k_ptr, v_ptr, tables, seq, MAXB, BS, scale, kvh, qpos, qvalid, kmax, split0,
    HKV: tl.constexpr, D: tl.constexpr, M: tl.constexpr, BLOCK_D: tl.constexpr, BN: tl.constexpr,
    SPLIT_: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """Online-softmax state (max, sum, accumulator) of one split: keys ``[split0, split0 + SPLIT_) & [0, kmax)``."""
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    n_idx = tl.arange(0, BN)
    m_s = tl.full((M,), float("-inf"), tl.float32)
    l_s = tl.zeros((M,), tl.float32)
    acc_s = tl.zeros((M, BLOCK_D), tl.float32)
    for k0 in range(split0, tl.minimum(split0 + SPLIT_, kmax), BN):
        kpos = k0 + n_idx
        kvalid = kpos < kmax
        blk = tl.load(tables + seq * MAXB + kpos // BS, mask=kvalid, other=0)
        slot = (blk * BS + kpos % BS).to(tl.int64)
        kv_off = (slot * HKV + kvh)[:, None] * D + d[None, :]
        kv_mask = kvalid[:, None] & dmask[None, :]
        k = tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * scale
        visible = (kpos[None, :] <= qpos[:, None]) & kvalid[None, :] & qvalid[:, None]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_s, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_use[:, None])
        alpha = tl.exp(m_s - m_use)
        l_s = l_s * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0)
        if IEEE:
            pv = tl.dot(p, v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc_s = acc_s * alpha[:, None] + pv
        m_s = m_new
    return m_s, l_s, acc_s


@triton.jit
def _merge(m_t, l_t, acc_t, m_s, l_s, acc_s):
    """Fold one split's state into the running total (splits are folded in split order)."""
    m_new = tl.maximum(m_t, m_s)
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    a = tl.exp(m_t - m_use)
    b = tl.exp(m_s - m_use)
    return m_new, l_t * a + l_s * b, acc_t * a[:, None] + acc_s * b[:, None]


@triton.jit
def _tile_rows(
    tile_seq, tile_pos0, seq_row0, seq_start, seq_nq, tile, kvh,
    HQ: tl.constexpr, D: tl.constexpr, REP: tl.constexpr, RP: tl.constexpr, BLOCK_D: tl.constexpr,
    BQ: tl.constexpr, M: tl.constexpr,
):  # fmt: skip
    """A query tile's request, positions, validity and visible key count, and where its ``[M, BLOCK_D]``
    block of q (and of the output) lies: offsets and mask. Row ``m`` is position ``m // RP``'s query head
    ``kvh * REP + m % RP``; rows with ``m % RP >= REP`` pad the group to a power of two and are invalid,
    as are rows ``m >= BQ * RP`` (a tile of fewer than 16 rows padded for ``tl.dot``)."""
    seq = tl.load(tile_seq + tile)
    pos0 = tl.load(tile_pos0 + tile)
    row0 = tl.load(seq_row0 + seq)
    start = tl.load(seq_start + seq)
    nq = tl.load(seq_nq + seq)
    m_idx = tl.arange(0, M)
    qpos = pos0 + m_idx // RP
    head = kvh * REP + m_idx % RP
    qvalid = (qpos >= start) & (qpos < start + nq) & (m_idx % RP < REP)
    if M > BQ * RP:  # resolved at compile time: the engine's tiles (M = BQ * RP) compile as before
        qvalid = qvalid & (m_idx < BQ * RP)
    rows = row0 + qpos - start
    kmax = tl.minimum(pos0 + BQ, start + nq)  # keys any row of this tile can see: [0, kmax)
    d = tl.arange(0, BLOCK_D)
    q_off = (rows.to(tl.int64) * HQ + head)[:, None] * D + d[None, :]
    q_mask = qvalid[:, None] & (d < D)[None, :]
    return seq, qpos, qvalid, kmax, q_off, q_mask


@triton.jit(do_not_specialize=["MAXB", "BS"])
def _attention_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, seq_row0, seq_start, seq_nq, tables, tile_seq, tile_pos0, MAXB, BS, scale,
    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, REP: tl.constexpr, RP: tl.constexpr,
    BLOCK_D: tl.constexpr, BQ: tl.constexpr, M: tl.constexpr, BN: tl.constexpr, SPLIT_: tl.constexpr,
    IEEE: tl.constexpr,
):  # fmt: skip
    """One program per (query tile, KV head): every split in turn, folded as it finishes."""
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    seq, qpos, qvalid, kmax, q_off, q_mask = _tile_rows(
        tile_seq, tile_pos0, seq_row0, seq_start, seq_nq, tile, kvh, HQ, D, REP, RP, BLOCK_D, BQ, M
    )
    q = tl.load(q_ptr + q_off, mask=q_mask, other=0.0)
    m_t = tl.full((M,), float("-inf"), tl.float32)
    l_t = tl.zeros((M,), tl.float32)
    acc_t = tl.zeros((M, BLOCK_D), tl.float32)
    for split0 in range(0, kmax, SPLIT_):
        m_s, l_s, acc_s = _split_state(
            q, k_ptr, v_ptr, tables, seq, MAXB, BS, scale, kvh, qpos, qvalid, kmax, split0,
            HKV, D, M, BLOCK_D, BN, SPLIT_, IEEE,
        )  # fmt: skip
        m_t, l_t, acc_t = _merge(m_t, l_t, acc_t, m_s, l_s, acc_s)
    out = acc_t / l_t[:, None]
    tl.store(o_ptr + q_off, out.to(o_ptr.dtype.element_ty), mask=q_mask)


@triton.jit(do_not_specialize=["MAXB", "BS", "NSPLIT"])
def _attention_split_kernel(
    q_ptr, k_ptr, v_ptr, m_ptr, l_ptr, acc_ptr, seq_row0, seq_start, seq_nq, tables, tile_seq, tile_pos0,
    MAXB, BS, NSPLIT, scale,
    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, REP: tl.constexpr, RP: tl.constexpr,
    BLOCK_D: tl.constexpr, BQ: tl.constexpr, M: tl.constexpr, BN: tl.constexpr, SPLIT_: tl.constexpr,
    IEEE: tl.constexpr,
):  # fmt: skip
    """One program per (query tile, KV head, split): the split's state, stored for the fold."""
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq, qpos, qvalid, kmax, q_off, q_mask = _tile_rows(
        tile_seq, tile_pos0, seq_row0, seq_start, seq_nq, tile, kvh, HQ, D, REP, RP, BLOCK_D, BQ, M
    )
    split0 = split * SPLIT_
    if split0 < kmax:  # splits past the tile's keys do not exist (the fold stops before them)
        q = tl.load(q_ptr + q_off, mask=q_mask, other=0.0)
        m_s, l_s, acc_s = _split_state(
            q, k_ptr, v_ptr, tables, seq, MAXB, BS, scale, kvh, qpos, qvalid, kmax, split0,
            HKV, D, M, BLOCK_D, BN, SPLIT_, IEEE,
        )  # fmt: skip
        base = ((tile * HKV + kvh) * NSPLIT + split).to(tl.int64) * M
        m_idx = tl.arange(0, M)
        tl.store(m_ptr + base + m_idx, m_s)
        tl.store(l_ptr + base + m_idx, l_s)
        tl.store(acc_ptr + (base + m_idx)[:, None] * BLOCK_D + tl.arange(0, BLOCK_D)[None, :], acc_s)


@triton.jit(do_not_specialize=["NSPLIT"])
def _attention_fold_kernel(
    o_ptr, m_ptr, l_ptr, acc_ptr, seq_row0, seq_start, seq_nq, tile_seq, tile_pos0, NSPLIT,
    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, REP: tl.constexpr, RP: tl.constexpr,
    BLOCK_D: tl.constexpr, BQ: tl.constexpr, M: tl.constexpr, SPLIT_: tl.constexpr,
):  # fmt: skip
    """One program per (query tile, KV head): the stored split states folded in split order."""
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    _seq, _qpos, _qvalid, kmax, q_off, q_mask = _tile_rows(
        tile_seq, tile_pos0, seq_row0, seq_start, seq_nq, tile, kvh, HQ, D, REP, RP, BLOCK_D, BQ, M
    )
    d = tl.arange(0, BLOCK_D)
    m_idx = tl.arange(0, M)
    m_t = tl.full((M,), float("-inf"), tl.float32)
    l_t = tl.zeros((M,), tl.float32)
    acc_t = tl.zeros((M, BLOCK_D), tl.float32)
    for split0 in range(0, kmax, SPLIT_):
        base = ((tile * HKV + kvh) * NSPLIT + split0 // SPLIT_).to(tl.int64) * M
        m_s = tl.load(m_ptr + base + m_idx)
        l_s = tl.load(l_ptr + base + m_idx)
        acc_s = tl.load(acc_ptr + (base + m_idx)[:, None] * BLOCK_D + d[None, :])
        m_t, l_t, acc_t = _merge(m_t, l_t, acc_t, m_s, l_s, acc_s)
    out = acc_t / l_t[:, None]
    tl.store(o_ptr + q_off, out.to(o_ptr.dtype.element_ty), mask=q_mask)


def key_tile(rows: int, block_d: int) -> int:
    """``BLOCK_N`` for a model's head shape (``rows``: a query tile's rows, ``BLOCK_Q`` x the padded GQA group).

    64 keys a tile where the tile's rows x head fit, else 32, the tile measured before (H100,
    ``kvwarden bench attention_tiles``, 64 against 32 keys): Qwen3-0.6B's 32 x 128 (GQA 2), a decode step of 64
    requests over 512 keys 71 against 85 us, a 2,048-token prefill 202 against 281; GQA 3-4 at head 128
    (Llama-3-8B, Qwen3-8B, the Granite preset: 64 x 128, ``--heads 32,8,128``) 75 against 83 us, 300
    against 350 (256 requests over 640 keys) and 236 against 269 (prefill), one request over 16K keys
    level. Larger tiles were not measured at 64 keys; Qwen3-Next's 128 x 256 already holds a thread's
    255 registers in its accumulator at 4 warps.
    NOTE(invariance): the tile moves the online softmax's rescale points, so it is fixed per model.
    """
    return BLOCK_N_WIDE if rows * block_d <= WIDE_MAX_ELEMENTS else BLOCK_N


def split_in_parallel(tiles: int, hkv: int, nsplit: int, rows: int, block_d: int) -> bool:
    """Whether a launch runs its splits in parallel: several splits, few (tile, head) programs (a long
    context's decode or short tail, where walking the splits would leave most of the GPU idle), and
    split states within the program and byte budgets. A speed choice only (module docstring)."""
    programs = tiles * hkv
    state_bytes = programs * nsplit * rows * (block_d + 2) * 4
    return (
        nsplit > 1
        and programs < FEW_PROGRAMS
        and programs * nsplit <= PARALLEL_MAX_PROGRAMS
        and state_bytes <= PARALLEL_MAX_BYTES
    )


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMeta,
    block_size: int,
    scale: float,
    parallel_splits: bool | None = None,
    tiles: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """Causal attention of ``q [rows, Hq, D]`` over ``k_cache``/``v_cache [slots, Hkv, D]``, in the query
    tiles of ``meta`` (``meta.block_q`` positions each, ``meta.warps`` warps a program).

    ``parallel_splits``: run each fixed split in its own program and fold them
    after (flash-decoding), or walk them in one program; ``None`` chooses by the
    launch (few tiles over long contexts: in parallel). Both give the same bits:
    the same split states, folded in the same order by the same function.
    ``tiles``: ``(BLOCK_N, num_warps, num_stages)``, optionally with the split
    length as a fourth, instead of the module's, for ``kvwarden bench attention_tiles``
    only (``BLOCK_N`` and the split move the softmax's rescale and fold points,
    so the engine never passes it: every step must use the same).
    """
    block_n, warps, stages, split = (*tiles, SPLIT)[:4] if tiles else (0, meta.warps, 2, SPLIT)
    q = q.contiguous()
    rows, hq, d = q.shape
    hkv = k_cache.shape[1]
    out = torch.empty_like(q)
    tiles = meta.tile_seq.numel()
    if rows == 0 or tiles == 0:
        return out
    rep = hq // hkv
    rp = triton.next_power_of_2(rep)  # a position's query heads padded to a power of two (tile shapes)
    block_d = max(16, triton.next_power_of_2(d))
    bq = meta.block_q  # the step's tile (decode or prefill: the model's QueryTiles)
    m = max(16, bq * rp)  # the tile's rows (tl.dot needs 16; rows past bq * rp are masked)
    const = dict(HQ=hq, HKV=hkv, D=d, REP=rep, RP=rp, BLOCK_D=block_d, BQ=bq, M=m)
    ieee = q.dtype == torch.float32
    nsplit = cdiv(meta.max_keys, split) if meta.max_keys else 0
    # the model's: its QueryTiles' (meta.block_n), else of its head shape at BLOCK_Q's tile whatever bq
    block_n = block_n or meta.block_n or key_tile(BLOCK_Q * rp, block_d)
    if split % block_n:  # a key tile may not straddle a split's boundary (its keys would count twice)
        raise ValueError(f"SPLIT={split} is not a multiple of the key tile {block_n}")
    if parallel_splits is None:
        parallel_splits = split_in_parallel(tiles, hkv, nsplit, m, block_d)
    if not parallel_splits or nsplit < 1:
        _attention_kernel[(tiles, hkv)](
            q, k_cache, v_cache, out,
            meta.seq_row0, meta.seq_start, meta.seq_nq, meta.block_tables, meta.tile_seq, meta.tile_pos0,
            meta.block_tables.shape[1], block_size, scale,
            **const, BN=block_n, SPLIT_=split, IEEE=ieee, num_warps=warps, num_stages=stages,
        )  # fmt: skip
        return out
    m_buf = torch.empty((tiles * hkv * nsplit * m,), dtype=torch.float32, device=q.device)
    l_buf = torch.empty_like(m_buf)
    acc_buf = torch.empty((tiles * hkv * nsplit * m, block_d), dtype=torch.float32, device=q.device)
    _attention_split_kernel[(tiles, hkv, nsplit)](
        q, k_cache, v_cache, m_buf, l_buf, acc_buf,
        meta.seq_row0, meta.seq_start, meta.seq_nq, meta.block_tables, meta.tile_seq, meta.tile_pos0,
        meta.block_tables.shape[1], block_size, nsplit, scale,
        **const, BN=block_n, SPLIT_=split, IEEE=ieee, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    _attention_fold_kernel[(tiles, hkv)](
        out, m_buf, l_buf, acc_buf, meta.seq_row0, meta.seq_start, meta.seq_nq, meta.tile_seq, meta.tile_pos0,
        nsplit, **const, SPLIT_=split, num_warps=4,
    )  # fmt: skip
    return out


def precompile(
    hq: int, k_cache: torch.Tensor, v_cache: torch.Tensor, block_size: int, tiles: QueryTiles
) -> tuple[torch.Tensor, torch.Tensor]:
    """Compile both forms of the kernel, in the prefill tiles of ``tiles``, before the first request needs them.

    A first prefix hit over more than one split would otherwise pay the parallel form's compile
    (about half a second) inside its time to first token. Reads block 0 only; returns the walked
    and the parallel output of one query over ``SPLIT + 1`` keys (callers drop them).
    """
    d = k_cache.shape[2]
    q = torch.ones((1, hq, d), dtype=k_cache.dtype, device=k_cache.device)
    blocks = cdiv(SPLIT + 1, block_size)
    seqs = [(0, SPLIT, 1, [0] * blocks)]  # one query in a prefill's tile
    meta = AttentionMeta.build(seqs, k_cache.device, **tiles.meta_fields(decode_only=False))
    walked = paged_attention(q, k_cache, v_cache, meta, block_size, 1.0, parallel_splits=False)
    return walked, paged_attention(q, k_cache, v_cache, meta, block_size, 1.0, parallel_splits=True)
