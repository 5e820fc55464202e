"""Gated-DeltaNet kernels: kvwarden's batched token-by-token scan against flash-linear-attention's.

What the field maintains (``fla-core``: ``chunk_gated_delta_rule`` for prefill,
``fused_recurrent_gated_delta_rule`` for decode, the kernels vLLM copies)
against ``kvwarden.layers.kernels.recurrent.gated_delta``, on a GPU, on one
layer of a model's shape (default: Qwen3-Next-80B's 16 key / 32 value heads of
128; ``--preset 0.6b`` for kvwarden's preset), bfloat16 inputs, float32 state:

* speed: prefill of one prompt (1K / 4K / 16K tokens), decode steps of 1 /
  16 / 64 / 256 requests (median of CUDA-event timings);
* invariance, bitwise: (1) a prompt in two calls (the state carried) vs one
  call; (2) the token at position p decoded from the prefill's state vs the
  same position inside the prefill (fla: the chunk kernel then the recurrent
  kernel, vLLM's pairing); (3) a request beside a partner (varlen) vs alone;
* error against a float64 token-by-token reference.

    python bench/fla_compare.py                   # needs a GPU and fla-core (scripts/gpu_check.sh carries it)

Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch

OTHER = "kvwarden, 16 cols / 4 warps"  # the launch shape before flash-linear-attention's was adopted
SHAPES = {"qwen3-next-80b": (16, 32, 128, 128), "0.6b": (8, 16, 128, 128)}


def bitwise(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.contiguous().view(torch.uint8).equal(b.contiguous().view(torch.uint8))


def inputs(t: int, hk: int, hv: int, dk: int, dv: int, gen: torch.Generator) -> dict[str, Any]:
    """Raw layer inputs (the conv's output and in_proj_ba's), as kvwarden's kernel reads them."""
    rep = hv // hk
    x = torch.randn(t, 2 * hk * dk + hv * dv, generator=gen).to(torch.bfloat16)
    ba = torch.randn(t, hk * 2 * rep, generator=gen).to(torch.bfloat16)
    neg_a = -torch.rand(hv, generator=gen) * 4
    dt_bias = torch.randn(hv, generator=gen)
    return {"hk": hk, **{k: v.cuda() for k, v in {"x": x, "ba": ba, "neg_a": neg_a, "dt_bias": dt_bias}.items()}}


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


def ours(inp: dict[str, Any], lens: list[int], state: torch.Tensor, **launch: int) -> torch.Tensor:
    from kvwarden.layers.kernels.recurrent import gated_delta
    from kvwarden.layers.recurrent_plan import RecurrentMeta

    seqs, row = [], 0
    for i, n in enumerate(lens):
        seqs.append((f"r{i}", row, n, 0, i))
        row += n
    meta = RecurrentMeta.build(seqs, 1 << 30, True, torch.device("cuda"))
    return gated_delta(inp["x"], inp["ba"], inp["neg_a"], inp["dt_bias"], state, meta, inp["hk"], **launch)[0]


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
    s0 = torch.zeros(1, hv, dk, dv, device="cuda")
    part = {k: v[:, :cut] for k, v in args.items()}
    rest = {k: v[:, cut:] for k, v in args.items()}
    out: dict[str, dict[str, bool]] = {}
    for name, fn in (("fla chunk", fla_chunk), ("fla fused_recurrent", fla_recurrent)) if fla else ():
        whole, _ = fn(args, s0.clone())
        o1, s1 = fn(part, s0.clone())
        o2, _ = fn(rest, s1)
        one, _ = fla_recurrent({k: v[:, cut : cut + 1] for k, v in args.items()}, s1)  # decode after the prefix
        pair = {k: torch.cat([v, v[:, :300]], 1) for k, v in args.items()}
        cu = torch.tensor([0, t, t + 300], device="cuda", dtype=torch.long)
        both, _ = fn(pair, torch.zeros(2, hv, dk, dv, device="cuda"), cu)
        out[name] = {
            "two calls = one": bitwise(torch.cat([o1, o2], 1), whole),
            "decode = prefill": bitwise(one[:, 0], whole[:, cut]),
            "beside a partner = alone": bitwise(both[:, :t], whole),
        }
    state = torch.zeros(2, hv, dk, dv, device="cuda")
    whole = ours(inp, [t], state)
    state = torch.zeros(2, hv, dk, dv, device="cuda")
    first = ours({**inp, "x": inp["x"][:cut], "ba": inp["ba"][:cut]}, [cut], state)
    second = ours({**inp, "x": inp["x"][cut:], "ba": inp["ba"][cut:]}, [t - cut], state.clone())
    state2 = torch.zeros(2, hv, dk, dv, device="cuda")
    ours({**inp, "x": inp["x"][:cut], "ba": inp["ba"][:cut]}, [cut], state2)
    one = ours({**inp, "x": inp["x"][cut : cut + 1], "ba": inp["ba"][cut : cut + 1]}, [1], state2)
    pair = {**inp, "x": torch.cat([inp["x"][:300], inp["x"]]), "ba": torch.cat([inp["ba"][:300], inp["ba"]])}
    both = ours(pair, [300, t], torch.zeros(2, hv, dk, dv, device="cuda"))
    out["kvwarden"] = {
        "two calls = one": bitwise(torch.cat([first, second]), whole),
        "decode = prefill": bitwise(one[0], whole[cut]),
        "beside a partner = alone": bitwise(both[300:], whole),
    }
    return out


def speed(hk: int, hv: int, dk: int, dv: int, gen: torch.Generator, fla: bool) -> list[dict[str, Any]]:
    rows = []
    for t in (1024, 4096, 16384):
        inp = inputs(t, hk, hv, dk, dv, gen)
        args = fla_args(inp, hk, hv, dk, dv)
        s0 = torch.zeros(1, hv, dk, dv, device="cuda")
        state = torch.zeros(1, hv, dk, dv, device="cuda")
        row = {"what": f"prefill {t}", "kvwarden": timed(lambda i=inp, t=t, s=state: ours(i, [t], s))}
        row[OTHER] = timed(lambda i=inp, t=t, s=state: ours(i, [t], s, cols=16, warps=4))
        if fla:
            row["fla chunk"] = timed(lambda a=args, s=s0: fla_chunk(a, s))
            row["fla fused_recurrent"] = timed(lambda a=args, s=s0: fla_recurrent(a, s))
        rows.append(row)
    for b in (1, 16, 64, 256):
        inp = inputs(b, hk, hv, dk, dv, gen)
        args = fla_args(inp, hk, hv, dk, dv)
        args = {k: v.transpose(0, 1).contiguous() for k, v in args.items()}  # [B, 1, ...]
        s0 = torch.zeros(b, hv, dk, dv, device="cuda")
        state = torch.zeros(b, hv, dk, dv, device="cuda")
        row = {"what": f"decode b{b}", "kvwarden": timed(lambda i=inp, b=b, s=state: ours(i, [1] * b, s))}
        row[OTHER] = timed(lambda i=inp, b=b, s=state: ours(i, [1] * b, s, cols=16, warps=4))
        if fla:
            row["fla fused_recurrent"] = timed(lambda a=args, s=s0: fla_recurrent(a, s))
        rows.append(row)
    return rows


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
    rows = speed(hk, hv, dk, dv, gen, have)
    result["speed_s"] = rows
    print(f"\n| step | fla chunk | fla fused_recurrent | kvwarden | {OTHER} |\n|---|---|---|---|---|")
    for r in rows:
        keys = ("fla chunk", "fla fused_recurrent", "kvwarden", OTHER)
        cells = [f"{r[k] * 1e3:.3f} ms" if k in r else "-" for k in keys]
        print(f"| {r['what']} | " + " | ".join(cells) + " |")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
