"""Gated-DeltaNet kernels: kvwarden's scans against flash-linear-attention's.

What the field maintains (``fla-core``: ``chunk_gated_delta_rule`` for prefill,
``fused_recurrent_gated_delta_rule`` for decode, the kernels vLLM copies)
against kvwarden's two: the canonical chunked scan on the absolute grid
(``kvwarden.layers.kernels.recurrent_grid``) and the fast path's token-by-token
loop (``kvwarden.layers.kernels.recurrent``), on a GPU, on one
layer of a model's shape (default: Qwen3-Next-80B's 16 key / 32 value heads of
128; ``--preset 0.6b`` for kvwarden's preset), bfloat16 inputs, float32 state:

* speed: prefill of one prompt (1K / 4K / 16K tokens), decode steps of 1 /
  16 / 64 / 256 requests (median of CUDA-event timings);
* invariance, bitwise: (1) a prompt in two calls (the state carried) vs one
  call; (2) the token at position p decoded from the prefill's state vs the
  same position inside the prefill (fla: the chunk kernel then the recurrent
  kernel, vLLM's pairing); (3) a request beside a partner (varlen) vs alone;
* error against a float64 token-by-token reference.

    kvwarden bench fla_compare                   # needs a GPU and fla-core (scripts/gpu_check.sh carries it)
    TRITON_INTERPRET=1 kvwarden bench fla_compare --preset tiny   # a CPU smoke run: no speed rows, no fla

Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch

GRID = "kvwarden grid (canonical)"  # chunks of 16 on the absolute grid, tensor cores
LOOP = "kvwarden token loop (fast path)"  # the token-by-token kernel
CHUNK = 16  # the engine's default numerics.scan_chunk
# (chunk, dot precision) of the grid's timed rows: the engine's, CUDA cores instead of tensor cores, the largest chunk
VARIANTS = ((CHUNK, "tf32x3"), (CHUNK, "ieee"), (64, "tf32x3"))
SHAPES = {"qwen3-next-80b": (16, 32, 128, 128), "0.6b": (8, 16, 128, 128), "tiny": (1, 2, 16, 16)}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def bitwise(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.contiguous().view(torch.uint8).equal(b.contiguous().view(torch.uint8))


def inputs(t: int, hk: int, hv: int, dk: int, dv: int, gen: torch.Generator) -> dict[str, Any]:
    """Raw layer inputs (the conv's output and in_proj_ba's), as kvwarden's kernel reads them."""
    rep = hv // hk
    x = torch.randn(t, 2 * hk * dk + hv * dv, generator=gen).to(torch.bfloat16)
    ba = torch.randn(t, hk * 2 * rep, generator=gen).to(torch.bfloat16)
    neg_a = -torch.rand(hv, generator=gen) * 4
    dt_bias = torch.randn(hv, generator=gen)
    return {"hk": hk, **{k: v.to(DEVICE) for k, v in {"x": x, "ba": ba, "neg_a": neg_a, "dt_bias": dt_bias}.items()}}


def fla_args(inp: dict[str, Any], hk: int, hv: int, dk: int, dv: int) -> dict[str, torch.Tensor]:
    """The same function in fla's arguments: q, k [1, T, Hk, dk] (l2-normalised in the kernel), gates precomputed."""
    x, ba = inp["x"], inp["ba"]
    t, rep = x.shape[0], hv // hk
    q = x[:, : hk * dk].reshape(1, t, hk, dk)
    k = x[:, hk * dk : 2 * hk * dk].reshape(1, t, hk, dk)
    v = x[:, 2 * hk * dk :].reshape(1, t, hv, dv)
    b = ba.view(t, hk, 2 * rep)[..., :rep].reshape(1, t, hv).float()
    a = ba.view(t, hk, 2 * rep)[..., rep:].reshape(1, t, hv).float()
    g = inp["neg_a"] * torch.nn.functional.softplus(a + inp["dt_bias"])
    return {"q": q, "k": k, "v": v, "g": g, "beta": torch.sigmoid(b)}


def ours(
    inp: dict[str, Any],
    lens: list[int],
    state: torch.Tensor,
    kernel: str = GRID,
    starts: list[int] | None = None,
    ring: torch.Tensor | None = None,
    **launch: Any,
) -> torch.Tensor:
    """kvwarden's scan over requests ``i`` (state slot ``i``) of ``lens[i]`` rows from ``starts[i]``.

    ``kernel``: the canonical chunked scan (``GRID``, with its ring of pending rows: pass the same ``ring``
    to calls that continue a request) or the token-by-token loop (``LOOP``, the fast path's)."""
    from kvwarden.layers.kernels.recurrent import gated_delta
    from kvwarden.layers.kernels.recurrent_grid import gated_delta_grid
    from kvwarden.layers.recurrent_plan import RecurrentMeta

    seqs, row = [], 0
    for i, n in enumerate(lens):
        seqs.append((f"r{i}", row, n, starts[i] if starts else 0, i))
        row += n
    args = (inp["x"], inp["ba"], inp["neg_a"], inp["dt_bias"], state)
    if kernel == LOOP:
        meta = RecurrentMeta.build(seqs, 1 << 30, True, torch.device(DEVICE))
        return gated_delta(*args, meta, inp["hk"], **launch)[0]
    if ring is None:
        ring = new_ring(inp, state.shape[0])
    meta = RecurrentMeta.build(seqs, 1 << 30, True, torch.device(DEVICE), chunk=ring.shape[1] // 2)
    return gated_delta_grid(*args, ring, meta, inp["hk"], **launch)[0]


def new_ring(inp: dict[str, Any], slots: int, chunk: int = CHUNK) -> torch.Tensor:
    return torch.zeros(slots, 2 * chunk, inp["x"].shape[1] + inp["ba"].shape[1], device=DEVICE)


def fla_chunk(args: dict[str, torch.Tensor], state: torch.Tensor, cu: torch.Tensor | None = None):
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    return chunk_gated_delta_rule(
        **args, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu
    )


def fla_recurrent(args: dict[str, torch.Tensor], state: torch.Tensor, cu: torch.Tensor | None = None):
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

    return fused_recurrent_gated_delta_rule(
        **args, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu
    )


def timed(fn: Any) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e-3


def invariance(hk: int, hv: int, dk: int, dv: int, gen: torch.Generator, fla: bool) -> dict[str, dict[str, bool]]:
    t, cut = 1000, 437
    inp = inputs(t, hk, hv, dk, dv, gen)
    args = fla_args(inp, hk, hv, dk, dv)
    s0 = torch.zeros(1, hv, dk, dv, device=DEVICE)
    part = {k: v[:, :cut] for k, v in args.items()}
    rest = {k: v[:, cut:] for k, v in args.items()}
    out: dict[str, dict[str, bool]] = {}
    for name, fn in (("fla chunk", fla_chunk), ("fla fused_recurrent", fla_recurrent)) if fla else ():
        whole, _ = fn(args, s0.clone())
        o1, s1 = fn(part, s0.clone())
        o2, _ = fn(rest, s1)
        one, _ = fla_recurrent({k: v[:, cut : cut + 1] for k, v in args.items()}, s1)  # decode after the prefix
        pair = {k: torch.cat([v, v[:, :300]], 1) for k, v in args.items()}
        cu = torch.tensor([0, t, t + 300], device=DEVICE, dtype=torch.long)
        both, _ = fn(pair, torch.zeros(2, hv, dk, dv, device=DEVICE), cu)
        out[name] = {
            "two calls = one": bitwise(torch.cat([o1, o2], 1), whole),
            "decode = prefill": bitwise(one[:, 0], whole[:, cut]),
            "beside a partner = alone": bitwise(both[:, :t], whole),
        }
    for name in (GRID, LOOP):

        def part(lo: int, hi: int) -> dict[str, Any]:
            return {**inp, "x": inp["x"][lo:hi], "ba": inp["ba"][lo:hi]}

        state, ring = torch.zeros(2, hv, dk, dv, device=DEVICE), new_ring(inp, 2)
        whole = ours(inp, [t], state, name, [0], ring)
        state, ring = torch.zeros(2, hv, dk, dv, device=DEVICE), new_ring(inp, 2)
        first = ours(part(0, cut), [cut], state, name, [0], ring)
        s_cut, r_cut = state.clone(), ring.clone()
        second = ours(part(cut, t), [t - cut], state, name, [cut], ring)
        one = ours(part(cut, cut + 1), [1], s_cut, name, [cut], r_cut)
        pair = {**inp, "x": torch.cat([inp["x"][:300], inp["x"]]), "ba": torch.cat([inp["ba"][:300], inp["ba"]])}
        both = ours(pair, [300, t], torch.zeros(2, hv, dk, dv, device=DEVICE), name, [0, 0], new_ring(inp, 2))
        out[name] = {
            "two calls = one": bitwise(torch.cat([first, second]), whole),
            "decode = prefill": bitwise(one[0], whole[cut]),
            "beside a partner = alone": bitwise(both[300:], whole),
        }
    return out


def errors(hk: int, hv: int, dk: int, dv: int, gen: torch.Generator, fla: bool) -> dict[str, float]:
    """Relative error (Frobenius) of each kernel's outputs over 1,000 tokens against float64 token by token."""
    from kvwarden.layers import gated_delta as ref

    t = 1000
    inp = inputs(t, hk, hv, dk, dv, gen)
    args = fla_args(inp, hk, hv, dk, dv)
    rep = hv // hk
    q = torch.nn.functional.normalize(args["q"][0].double(), dim=-1, eps=1e-3) * dk**-0.5
    k = torch.nn.functional.normalize(args["k"][0].double(), dim=-1, eps=1e-3)
    q, k = q.repeat_interleave(rep, 1).transpose(0, 1), k.repeat_interleave(rep, 1).transpose(0, 1)
    v, g, beta = args["v"][0].double().transpose(0, 1), args["g"][0].double().t(), args["beta"][0].double().t()
    truth = ref.recurrent_step(q, k, v, g, beta, torch.zeros(hv, dk, dv, dtype=torch.float64, device=DEVICE))[0]
    truth = truth.transpose(0, 1)  # [t, hv, dv]

    def err(out: torch.Tensor) -> float:
        return ((out.double() - truth).norm() / truth.norm()).item()

    inp32 = {**inp, "x": inp["x"].float(), "ba": inp["ba"].float()}  # float32 outputs: the scan's own error
    got = {}
    for prec in ("tf32x3", "ieee", "tf32"):
        state = torch.zeros(1, hv, dk, dv, device=DEVICE)
        got[f"{GRID}, {prec}"] = err(ours(inp32, [t], state, GRID, [0], precision=prec))
    got[LOOP] = err(ours(inp32, [t], torch.zeros(1, hv, dk, dv, device=DEVICE), LOOP))
    if fla:
        f32 = {k: (v.float() if v.is_floating_point() else v) for k, v in args.items()}
        try:
            got["fla chunk"] = err(fla_chunk(f32, torch.zeros(1, hv, dk, dv, device=DEVICE))[0][0])
        except Exception as e:  # a row of the table, not the run
            print(f"fla chunk on float32 inputs failed: {e}")
            got["fla chunk"] = float("nan")
    return got


def speed(hk: int, hv: int, dk: int, dv: int, gen: torch.Generator, fla: bool) -> list[dict[str, Any]]:
    rows = []
    for t in (1024, 4096, 16384):
        inp = inputs(t, hk, hv, dk, dv, gen)
        args = fla_args(inp, hk, hv, dk, dv)
        s0 = torch.zeros(1, hv, dk, dv, device=DEVICE)
        state = torch.zeros(1, hv, dk, dv, device=DEVICE)
        row: dict[str, Any] = {"what": f"prefill {t}"}
        for c, prec in VARIANTS:
            ring = new_ring(inp, 1, c)
            row[f"{GRID} C={c} {prec}"] = timed(
                lambda i=inp, t=t, s=state, r=ring, pr=prec: ours(i, [t], s, GRID, [0], r, precision=pr)
            )
        row[LOOP] = timed(lambda i=inp, t=t, s=state: ours(i, [t], s, LOOP))
        if fla:
            row["fla chunk"] = timed(lambda a=args, s=s0: fla_chunk(a, s))
            row["fla fused_recurrent"] = timed(lambda a=args, s=s0: fla_recurrent(a, s))
        rows.append(row)
    for b in (1, 16, 64, 256):
        inp = inputs(b, hk, hv, dk, dv, gen)
        args = fla_args(inp, hk, hv, dk, dv)
        args = {k: v.transpose(0, 1).contiguous() for k, v in args.items()}  # [B, 1, ...]
        s0 = torch.zeros(b, hv, dk, dv, device=DEVICE)
        state = torch.zeros(b, hv, dk, dv, device=DEVICE)
        row = {"what": f"decode b{b}"}
        # the grid's dearest decode step: the last row of a chunk (C - 1 pending rows, then the state update);
        # its cheapest, the first row of a chunk
        for c, prec in VARIANTS:
            ring = new_ring(inp, b, c)
            for pos in (c - 1, 0):
                row[f"{GRID} C={c} {prec} @{pos}"] = timed(
                    lambda i=inp, b=b, s=state, r=ring, p=pos, pr=prec: ours(
                        i, [1] * b, s, GRID, [p] * b, r, precision=pr
                    )
                )
        row[LOOP] = timed(lambda i=inp, b=b, s=state: ours(i, [1] * b, s, LOOP))
        if fla:
            row["fla fused_recurrent"] = timed(lambda a=args, s=s0: fla_recurrent(a, s))
        rows.append(row)
    return rows


def summarize(figures: dict[str, Any]) -> list[tuple[str, str]]:
    """One (label, value) pair per line of the GPU script's summary: bitwise checks per kernel."""
    return [
        ("bitwise (two calls, decode, partner)", str({k: list(v.values()) for k, v in figures["invariance"].items()}))
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(SHAPES), default="qwen3-next-80b")
    args = p.parse_args()
    hk, hv, dk, dv = SHAPES[args.preset]
    gen = torch.Generator().manual_seed(0)
    result: dict[str, Any] = {"bench": "fla_compare", "shape": {"hk": hk, "hv": hv, "dk": dk, "dv": dv}}
    try:
        import fla

        result["fla"] = fla.__version__
    except ImportError as e:
        print(f"fla-core is not importable ({e}); only kvwarden's rows are measured")
        result["fla"] = None
    have = result["fla"] is not None
    inv = invariance(hk, hv, dk, dv, gen, have)
    result["invariance"] = inv
    print("| kernel | two calls = one | decode = prefill | beside a partner = alone |\n|---|---|---|---|")
    for name, r in inv.items():
        print(f"| {name} | {r['two calls = one']} | {r['decode = prefill']} | {r['beside a partner = alone']} |")
    err = errors(hk, hv, dk, dv, gen, have)
    result["relative_error"] = err
    print("\n| kernel (float32 inputs) | relative error vs float64 |\n|---|---|")
    for name, e in err.items():
        print(f"| {name} | {e:.2e} |")
    rows = speed(hk, hv, dk, dv, gen, have) if DEVICE == "cuda" else []
    result["speed_s"] = rows
    if rows:  # (none on the CPU)
        print("\n| step | kernel | median time |\n|---|---|---|")
    for r in rows:
        for name, t in r.items():
            if name != "what":
                print(f"| {r['what']} | {name} | {t * 1e3:.3f} ms |")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
