"""The hybrid models' batched device kernels: recurrent scans, the causal conv, the gated norm, sparse MoE.

Each kernel against a PyTorch reference (within the dtype's tolerance) and for
its invariance property (bitwise): a request's outputs and states do not depend
on how its tokens were cut into calls (prefill chunks, decode steps), on which
other requests share the launch, or on which slot holds its state. On a machine
without a GPU these run under Triton's interpreter (float32); on a GPU
(``scripts/gpu_check.sh``) compiled, in float32 and bfloat16.
"""

from __future__ import annotations

import pytest
import torch

from kvwarden.layers import gated_delta, mamba2
from kvwarden.layers.conv1d import causal_conv1d
from kvwarden.layers.kernels import conv, moe, recurrent, recurrent_grid, rows, ssd_grid
from kvwarden.layers.recurrent_plan import RecurrentMeta
from test_kernels import DEVICE, DTYPES, close, gen, rand, same

SLOTS = 5


def meta(pieces: list[tuple[int, int, int]], block: int = 4, every: bool = True) -> RecurrentMeta:
    """pieces: (request = its state slot, absolute start, rows) in one launch."""
    seqs, row = [], 0
    for slot, start, n in pieces:
        seqs.append((f"r{slot}", row, n, start, slot))
        row += n
    return RecurrentMeta.build(seqs, block, every, torch.device(DEVICE))


def run_pieces(fn, inputs: list[torch.Tensor], pieces: list[tuple[int, int, int]]):
    """Concatenate each piece's rows of every input and call ``fn(*rows, meta)``."""
    batch = [torch.cat([x[slot][s : s + n] for slot, s, n in pieces]) for x in inputs]
    return fn(*batch, meta(pieces))


# ------------------------------------------------------------------------------------- gated delta
HK, HV, DK, DV = 2, 4, 16, 20


def _gdn_case(g: torch.Generator, n: int, dtype: torch.dtype):
    x = rand(g, SLOTS, n, 2 * HK * DK + HV * DV, dtype=dtype)
    ba = rand(g, SLOTS, n, HK * 2 * (HV // HK), dtype=dtype)
    neg_a = (-torch.rand(HV, generator=g) * 2).to(DEVICE)
    dt_bias = torch.randn(HV, generator=g).to(DEVICE)
    return x, ba, neg_a, dt_bias


def _gdn_reference(x, ba, neg_a, dt_bias, s0):
    """transformers-style preprocessing, then the token-by-token reference in float64."""
    x, ba = x.double().cpu(), ba.double().cpu()
    n, rep = x.shape[0], HV // HK
    q = x[:, : HK * DK].view(n, HK, DK)
    k = x[:, HK * DK : 2 * HK * DK].view(n, HK, DK)
    v = x[:, 2 * HK * DK :].view(n, HV, DV)
    q = torch.nn.functional.normalize(q, dim=-1, eps=0) * DK**-0.5
    k = torch.nn.functional.normalize(k, dim=-1, eps=0)
    q, k = q.repeat_interleave(rep, 1), k.repeat_interleave(rep, 1)
    b = ba.view(n, HK, 2 * rep)[..., :rep].reshape(n, HV)
    a = ba.view(n, HK, 2 * rep)[..., rep:].reshape(n, HV)
    beta = torch.sigmoid(b)
    decay = neg_a.double().cpu() * torch.nn.functional.softplus(a + dt_bias.double().cpu())
    out, state = gated_delta.recurrent_step(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), decay.t(), beta.t(), s0.double().cpu()
    )
    return out.transpose(0, 1), state


@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_delta_is_the_same_however_the_tokens_arrive(dtype: torch.dtype) -> None:
    g = gen(11)
    n = 13
    x, ba, neg_a, dt_bias = _gdn_case(g, n, dtype)
    s0 = torch.randn(SLOTS, HV, DK, DV, generator=g).to(DEVICE)

    def scan(pieces):
        state = s0.clone()
        out, caps = run_pieces(
            lambda xx, bb, m: recurrent.gated_delta(xx, bb, neg_a, dt_bias, state, m, HK), [x, ba], pieces
        )
        return out, caps, state

    whole, caps, state = scan([(1, 0, n)])  # one request (slot 1), 13 tokens, block 4: captures after 4, 8, 12
    ref_out, ref_state = _gdn_reference(x[1], ba[1], neg_a, dt_bias, s0[1])
    assert close(whole.float(), ref_out, dtype) and close(state[1], ref_state, torch.float32)
    assert caps.shape[0] == 3 and same(state[0], s0[0])  # other slots untouched
    # the same request in pieces (a chunk, decode steps, a chunk ending on a boundary), beside partners
    st = s0.clone()
    outs = []
    for lo, hi in ((0, 5), (5, 6), (6, 8), (8, 13)):
        pieces = [(3, 0, 2), (1, lo, hi - lo), (0, 0, 1)]  # partners in other slots, before and after
        m = meta(pieces)
        xs = torch.cat([x[3][:2], x[1][lo:hi], x[0][:1]])
        bs = torch.cat([ba[3][:2], ba[1][lo:hi], ba[0][:1]])
        o, c = recurrent.gated_delta(xs, bs, neg_a, dt_bias, st, m, HK)
        outs.append(o[2 : 2 + hi - lo])
        mine = [i for i, cap in enumerate(m.captures) if cap.request_id == "r1"]
        for i in mine:  # the state at 4 / 8 / 12 however it was reached
            assert same(c[i], caps[m.captures[i].pos // 4 - 1]), m.captures[i]
    assert same(torch.cat(outs), whole) and same(st[1], state[1])


def _states_along(x, ba, neg_a, dt_bias, s0, upto: list[int]) -> list[torch.Tensor]:
    """The float64 reference state after each of the first ``p`` tokens, for ``p`` in ``upto``."""
    return [_gdn_reference(x[:p], ba[:p], neg_a, dt_bias, s0)[1] for p in upto]


@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_delta_grid_is_the_same_however_the_tokens_arrive(dtype: torch.dtype) -> None:
    """The chunked (tensor-core) scan on the absolute grid: close to the token-by-token float64 reference,
    and bitwise the same for any split into prefill chunks and decode steps, beside any partners."""
    g = gen(21)
    n, chunk = 40, 16  # two full grid chunks and a tail; blocks of 16: boundaries at 16 and 32
    x, ba, neg_a, dt_bias = _gdn_case(g, n, dtype)
    s0 = torch.randn(SLOTS, HV, DK, DV, generator=g).to(DEVICE)
    ring0 = torch.zeros(SLOTS, 2 * chunk, x.shape[-1] + ba.shape[-1], device=DEVICE)

    def call(state, ring, pieces, tokens=None):
        seqs, row = [], 0
        for slot, start, n_rows in pieces:
            seqs.append((f"r{slot}", row, n_rows, start, slot))
            row += n_rows
        m = RecurrentMeta.build(seqs, chunk, True, torch.device(DEVICE), tokens)
        xs = torch.cat([x[slot][st : st + k] for slot, st, k in pieces])
        bs = torch.cat([ba[slot][st : st + k] for slot, st, k in pieces])
        out, caps = recurrent_grid.gated_delta_grid(xs, bs, neg_a, dt_bias, state, ring, m, HK)
        return out, caps, m

    state, ring = s0.clone(), ring0.clone()
    whole, caps, _ = call(state, ring, [(1, 0, n)])
    ref_out, _ = _gdn_reference(x[1], ba[1], neg_a, dt_bias, s0[1])
    at16, at32 = _states_along(x[1], ba[1], neg_a, dt_bias, s0[1], [16, 32])
    assert close(whole.float(), ref_out, dtype)
    # the working state is the state at the last grid point (32); the boundaries' states were captured
    assert close(state[1], at32, torch.float32) and caps.shape[0] == 2
    assert close(caps[0], at16, torch.float32) and same(caps[1], state[1]) and same(state[0], s0[0])
    # the ring holds the raw rows since the grid point, at position % 2C
    assert same(ring[1][0:8, : x.shape[-1]], x[1][32:40].float())

    # pieces: decode steps inside a chunk, chunks ending on and across grid points, partners around them
    st, rg = s0.clone(), ring0.clone()
    outs = []
    for lo, hi in ((0, 5), (5, 6), (6, 17), (17, 18), (18, 33), (33, 34), (34, 40)):
        out, c, m = call(st, rg, [(3, 0, 2), (1, lo, hi - lo), (0, 0, 1)])
        outs.append(out[2 : 2 + hi - lo])
        for i, cap in enumerate(m.captures):
            if cap.request_id == "r1":
                assert same(c[i], caps[cap.pos // 16 - 1]), cap
    assert same(torch.cat(outs), whole) and same(st[1], state[1])

    # a verify-style step keeps "the state after token t" = the state at t's grid point, and returning to
    # one of them (the state and the position; the ring is addressed by position) continues bit for bit
    st, rg = s0.clone(), ring0.clone()
    call(st, rg, [(1, 0, 14)])
    out, kept, m = call(st, rg, [(1, 14, 4)], tokens={"r1": range(3)})  # tokens 14..17, kept after 14, 15, 16
    assert [c.pos for c in m.captures] == [15, 16, 17]
    assert same(kept[0], s0[1]) and same(kept[1], caps[0]) and same(kept[2], caps[0])
    assert same(out, whole[14:18])
    st[1] = kept[0]  # drafts 15.. rejected: back to the state after token 14 (position 15)
    out, _, _ = call(st, rg, [(1, 15, 25)])
    assert same(out, whole[15:40]) and same(st[1], state[1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_mamba2_is_the_same_however_the_tokens_arrive(dtype: torch.dtype) -> None:
    g = gen(12)
    n, h, grp, p, ns = 11, 4, 2, 20, 16
    x = rand(g, SLOTS, n, h * p + 2 * grp * ns, dtype=dtype)
    dt = rand(g, SLOTS, n, h, dtype=dtype)
    dt_bias = torch.randn(h, generator=g).to(DEVICE)
    a = (-torch.rand(h, generator=g)).to(DEVICE)
    d = torch.randn(h, generator=g).to(DEVICE)
    s0 = torch.randn(SLOTS, h, p, ns, generator=g).to(DEVICE)
    limit = (0.0, float("inf"))

    def scan(pieces, state):
        return run_pieces(
            lambda xx, tt, m: recurrent.mamba2(xx, tt, dt_bias, a, d, state, m, grp, limit), [x, dt], pieces
        )

    state = s0.clone()
    y, caps = scan([(2, 0, n)], state)
    xr = x[2].double().cpu()
    step = torch.nn.functional.softplus(dt[2].double().cpu() + dt_bias.double().cpu())
    rep = h // grp
    bb = xr[:, h * p : h * p + grp * ns].view(n, grp, ns).repeat_interleave(rep, 1)
    cc = xr[:, h * p + grp * ns :].view(n, grp, ns).repeat_interleave(rep, 1)
    ref_y, ref_state = mamba2.recurrent_step(
        xr[:, : h * p].view(n, h, p).transpose(0, 1), step.t(), a.double().cpu(), bb.transpose(0, 1),
        cc.transpose(0, 1), d.double().cpu(), s0[2].double().cpu(),
    )  # fmt: skip
    assert close(y, ref_y.transpose(0, 1), torch.float32) and close(state[2], ref_state, torch.float32)
    st = s0.clone()
    outs = [scan([(4, 0, 3), (2, lo, hi - lo)], st)[0][3:] for lo, hi in ((0, 1), (1, 4), (4, 9), (9, 10), (10, 11))]
    assert same(torch.cat(outs), y) and same(st[2], state[2])
    assert caps.shape[0] == 2  # boundaries 4 and 8


@pytest.mark.parametrize("dtype", DTYPES)
def test_mamba2_grid_is_the_same_however_the_tokens_arrive(dtype: torch.dtype) -> None:
    """Mamba2's chunked SSD scan on the absolute grid: close to the token-by-token float64 reference, bitwise
    the same for any split, beside partners, and a verify step's kept states are their grid points' states."""
    g = gen(22)
    n, h, grp, p, ns, chunk = 40, 4, 2, 20, 16, 16
    x = rand(g, SLOTS, n, h * p + 2 * grp * ns, dtype=dtype)
    dt = rand(g, SLOTS, n, h, dtype=dtype)
    dt_bias = torch.randn(h, generator=g).to(DEVICE)
    a = (-torch.rand(h, generator=g)).to(DEVICE)
    d = torch.randn(h, generator=g).to(DEVICE)
    s0 = torch.randn(SLOTS, h, p, ns, generator=g).to(DEVICE)
    ring0 = torch.zeros(SLOTS, 2 * chunk, x.shape[-1] + h, device=DEVICE)
    limit = (0.0, float("inf"))

    def call(state, ring, pieces, tokens=None):
        seqs, row = [], 0
        for slot, start, k in pieces:
            seqs.append((f"r{slot}", row, k, start, slot))
            row += k
        m = RecurrentMeta.build(seqs, chunk, True, torch.device(DEVICE), tokens)
        xs = torch.cat([x[slot][st : st + k] for slot, st, k in pieces])
        ts = torch.cat([dt[slot][st : st + k] for slot, st, k in pieces])
        y, caps = ssd_grid.mamba2_grid(xs, ts, dt_bias, a, d, state, ring, m, grp, limit)
        return y, caps, m

    def reference(upto: int):
        xr = x[2][:upto].double().cpu()
        step = torch.nn.functional.softplus(dt[2][:upto].double().cpu() + dt_bias.double().cpu())
        rep = h // grp
        bb = xr[:, h * p : h * p + grp * ns].view(upto, grp, ns).repeat_interleave(rep, 1)
        cc = xr[:, h * p + grp * ns :].view(upto, grp, ns).repeat_interleave(rep, 1)
        y, st = mamba2.recurrent_step(
            xr[:, : h * p].view(upto, h, p).transpose(0, 1), step.t(), a.double().cpu(), bb.transpose(0, 1),
            cc.transpose(0, 1), d.double().cpu(), s0[2].double().cpu(),
        )  # fmt: skip
        return y.transpose(0, 1), st

    state, ring = s0.clone(), ring0.clone()
    y, caps, _ = call(state, ring, [(2, 0, n)])
    ref_y, _ = reference(n)
    assert close(y, ref_y, torch.float32) and caps.shape[0] == 2  # boundaries 16 and 32
    assert close(state[2], reference(32)[1], torch.float32) and close(caps[0], reference(16)[1], torch.float32)
    assert same(caps[1], state[2]) and same(state[0], s0[0])
    st, rg = s0.clone(), ring0.clone()
    outs = []
    for lo, hi in ((0, 1), (1, 15), (15, 16), (16, 33), (33, 34), (34, 40)):
        out, c, m = call(st, rg, [(4, 0, 3), (2, lo, hi - lo)])
        outs.append(out[3:])
        for i, cap in enumerate(m.captures):
            if cap.request_id == "r2":
                assert same(c[i], caps[cap.pos // 16 - 1]), cap
    assert same(torch.cat(outs), y) and same(st[2], state[2])
    st, rg = s0.clone(), ring0.clone()
    call(st, rg, [(2, 0, 14)])
    out, kept, m = call(st, rg, [(2, 14, 4)], tokens={"r2": range(3)})  # kept after tokens 14, 15, 16
    assert same(kept[0], s0[2]) and same(kept[1], caps[0]) and same(kept[2], caps[0]) and same(out, y[14:18])
    st[2] = kept[1]  # drafts 16.. rejected: back to the state after token 15 (position 16, a grid point)
    out, _, _ = call(st, rg, [(2, 16, 24)])
    assert same(out, y[16:40]) and same(st[2], state[2])


def test_the_fast_path_captures_only_where_a_chunk_ends_on_a_boundary() -> None:
    kept = meta([(0, 0, 10), (1, 2, 6)], block=4, every=False)
    assert [(c.request_id, c.pos) for c in kept.captures] == [("r1", 8)]
    every = meta([(0, 0, 10), (1, 2, 6)], block=4)
    assert [(c.request_id, c.pos) for c in every.captures] == [("r0", 4), ("r0", 8), ("r1", 4), ("r1", 8)]


# -------------------------------------------------------------------------------------- causal conv
@pytest.mark.parametrize("dtype", DTYPES)
def test_causal_conv_is_the_same_however_the_tokens_arrive(dtype: torch.dtype) -> None:
    g = gen(13)
    n, c, k, wide = 9, 40, 4, 64
    x = rand(g, SLOTS, n, wide, dtype=dtype)  # the conv reads 40 of 64 columns, out of order
    cols = torch.randperm(wide, generator=g)[:c].to(torch.int32).to(DEVICE)
    w, b = rand(g, c, k, dtype=dtype), rand(g, c, dtype=dtype)
    w0 = torch.randn(SLOTS, k - 1, c, generator=g).to(dtype).float().to(DEVICE)

    windows = w0.clone()
    y = run_pieces(lambda xx, m: conv.causal_conv(xx, cols, windows, w, b, m), [x], [(1, 0, n)])
    ref, ref_window = causal_conv1d(x[1][:, cols.long()].cpu(), w0[1].cpu(), w.cpu(), b.cpu(), torch.nn.functional.silu)
    assert close(y, ref, dtype) and same(windows[1].cpu(), ref_window.float())
    wins = w0.clone()
    outs = []
    for lo, hi in ((0, 1), (1, 2), (2, 7), (7, 9)):  # windows shorter and longer than K - 1
        pieces = [(0, 0, 3), (1, lo, hi - lo)]
        outs.append(run_pieces(lambda xx, m: conv.causal_conv(xx, cols, wins, w, b, m), [x], pieces)[3:])
    assert same(torch.cat(outs), y) and same(wins[1], windows[1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_norm_matches_transformers_formula(dtype: torch.dtype) -> None:
    g = gen(14)
    tokens, heads, d, rep, group = 5, 4, 24, 2, 100
    x, w = rand(g, tokens, heads, d, dtype=dtype), rand(g, d, dtype=dtype)
    z_src = rand(g, tokens, (heads // rep) * group, dtype=dtype)
    base = 52  # z of key-head group j starts at j * group + base
    y = rows.rms_norm_gated(x, w, 1e-6, z_src, group, base, rep)
    zz = torch.stack([z_src[:, (h // rep) * group + base + (h % rep) * d :][:, :d] for h in range(heads)], 1).float()
    xf = x.float()
    normed = (w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)).float()
    assert close(y, (normed * torch.nn.functional.silu(zz)).to(dtype), dtype)
    assert same(rows.rms_norm_gated(x[3:4], w, 1e-6, z_src[3:4], group, base, rep), y[3:4])


# ------------------------------------------------------------------------------------------ sparse MoE
@pytest.mark.parametrize("dtype", DTYPES)
def test_moe_experts_rows_do_not_depend_on_who_else_chose_the_expert(dtype: torch.dtype) -> None:
    g = gen(15)
    rows_, hid, inter, e, topk = 37, 48, 40, 6, 2
    x = rand(g, rows_, hid, dtype=dtype)
    w_gu, w_d = rand(g, e, 2 * inter, hid, dtype=dtype, scale=0.2), rand(g, e, hid, inter, dtype=dtype, scale=0.2)
    chosen = torch.stack([torch.randperm(e, generator=g)[:topk] for _ in range(rows_)]).to(DEVICE)
    chosen[:20, 0] = 3  # one expert chosen by many tokens: several tiles of it
    chosen[:20, 1] = torch.where(chosen[:20, 1] == 3, 4, chosen[:20, 1])
    weights = torch.rand(rows_, topk, generator=g).to(dtype).to(DEVICE)
    out = moe.experts(x, chosen, weights, w_gu, w_d)
    for r in (0, 5, 36):
        for rank in range(topk):
            ex = int(chosen[r, rank])
            gu = (x[r].double() @ w_gu[ex].double().T).to(dtype).double()
            act = (torch.nn.functional.silu(gu[:inter]).to(dtype).double() * gu[inter:]).to(dtype).double()
            ref = (act @ w_d[ex].double().T).to(dtype).double() * weights[r, rank].double()
            assert close(out[r, rank], ref, dtype)
    for sub in ([5], [36, 0], list(range(3, 30))):  # alone, reordered, a different crowd per expert
        idx = torch.tensor(sub, device=DEVICE)
        assert same(moe.experts(x[idx], chosen[idx], weights[idx], w_gu, w_d), out[idx])
    shared, gate = rand(g, rows_, hid, dtype=dtype), rand(g, rows_, 1, dtype=dtype)
    y = moe.combine(out, shared, gate)
    sg = torch.sigmoid(gate.float()).to(dtype)
    ref = (out[:, 0].float() + out[:, 1].float()).to(dtype).float() + (shared.float() * sg.float()).to(dtype).float()
    assert close(y, ref.to(dtype), dtype)  # (a GPU may contract the gate's product into the add)
    assert same(moe.combine(out[7:9], shared[7:9], gate[7:9]), y[7:9])


@pytest.mark.parametrize("mode", ["softmax-topk-renorm", "softmax-topk", "topk-softmax"])
def test_moe_routing_is_a_stable_top_k_and_the_tiles_cover_every_pair(mode: str) -> None:
    """Qwen's routing (softmax over all, then the top k, renormalised or not) and Granite's (the top k logits,
    then their softmax)."""
    g = gen(16)
    rows_, e, topk = 9, 10, 3
    logits = rand(g, rows_, e)
    logits[2] = 0.5  # every expert tied: the lowest indices win, in order
    logits[4, 7] = logits[4, 1] = 3.0  # a tie for the top: expert 1 before 7
    normalize, first = mode == "softmax-topk-renorm", mode == "topk-softmax"
    weights, chosen = moe.route(logits, topk, normalize, torch.float32, first)
    scores = logits.double().cpu() if first else torch.softmax(logits.double().cpu(), -1)
    ref_w, ref_i = torch.sort(scores, dim=-1, descending=True, stable=True)
    ref_w, ref_i = ref_w[:, :topk], ref_i[:, :topk]
    if first:
        ref_w = torch.softmax(ref_w, -1)
    if normalize:
        ref_w = ref_w / ref_w.sum(-1, keepdim=True)
    assert chosen.cpu().tolist() == ref_i.tolist()
    assert close(weights, ref_w, torch.float32)
    assert same(moe.route(logits[4:5], topk, normalize, torch.float32, first)[0], weights[4:5])
    order, expert, first, nrows = moe.dispatch(chosen, e, 4)
    flat = chosen.reshape(-1).cpu()
    seen = []
    for t in range(expert.shape[0]):
        n, f, ex = int(nrows[t]), int(first[t]), int(expert[t])
        pairs = order[f : f + n].cpu().tolist()
        assert all(int(flat[p]) == ex for p in pairs) and pairs == sorted(pairs)  # one expert, pair order
        seen += pairs
    assert sorted(seen) == list(range(rows_ * topk))  # every pair in exactly one tile
