"""Sparse attention's key selection: kvwarden's deterministic top-k against ``torch.topk`` and the incident's
arrival-order selection, and the DSA preset's prefill and decode beside a dense model of its size.

Selection rows: ``rows`` queries x ``keys`` index scores (|N(0, 1)| * 3, float32; the arrival selection
rounds them to bfloat16 as production indexers score; ``--sink`` puts one far larger score in column 0 of
every row), best of ``--repeats`` timings each. On the CPU the
deterministic path is the stable sort (``layers/sparse_attention.py``); on a GPU also the Triton kernel
(``layers/kernels/topk.py``). The tie column: rows whose ``k``-th and next score are equal, in float32 and
after rounding to bfloat16 - the ties the incident needs.

Model rows: prefill tokens/s of one prompt and greedy decode tokens/s at batch 1 for the DSA model
(``--dsa-model``, default ``builtin:glm_moe_dsa-small``) with the deterministic selection and with the
incident's (``unsafe_topk``), beside a dense-attention model (``--dense-model``, default
``builtin:qwen3_moe-small``), canonical numerics.

    kvwarden bench topk                 # CPU, 4K-64K keys, 1-256 rows
    kvwarden bench topk --quick         # smoke run
    kvwarden bench topk --device cuda --dsa-model builtin:glm_moe_dsa-0.6b \
        --dense-model builtin:qwen3-0.6b --prompt-len 4096     # GPU figures at GLM-5's top-k of 2,048

Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from kvwarden.layers.sparse_attention import arrival_topk, select_topk


def best_of(fn: Callable[[], object], repeats: int, sync: Callable[[], None]) -> float:
    fn()
    sync()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return min(times)


def selection_rows(args: argparse.Namespace, device: str) -> list[dict]:
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    g = torch.Generator().manual_seed(0)
    out = []
    for keys in args.keys:
        for rows in args.rows:
            scores = torch.randn(rows, keys, generator=g).abs() * 3
            if args.sink:  # an attention sink: column 0 scores far above the rest in every row
                scores[:, 0] = 1000.0
            scores = scores.to(device)
            k = min(args.k, keys)
            low = scores.to(torch.bfloat16).float()
            ranked = torch.sort(scores, dim=-1, descending=True).values
            ranked_low = torch.sort(low, dim=-1, descending=True).values
            row = {
                "keys": keys,
                "rows": rows,
                "k": k,
                "torch_topk_ms": 1e3 * best_of(partial(torch.topk, scores, k, dim=-1), args.repeats, sync),
                "deterministic_ms": 1e3 * best_of(partial(select_topk, scores, k, True), args.repeats, sync),
                "arrival_ms": 1e3 * best_of(partial(arrival_topk, low, k, rows), args.repeats, sync),
                "ties_f32": (ranked[:, k - 1] == ranked[:, k]).float().mean().item() if k < keys else 0.0,
                "ties_bf16": (ranked_low[:, k - 1] == ranked_low[:, k]).float().mean().item() if k < keys else 0.0,
            }
            if device == "cuda":
                from kvwarden.layers.kernels.topk import topk_triton

                row["triton_ms"] = 1e3 * best_of(partial(topk_triton, scores, k), args.repeats, sync)
                if args.variants:
                    row["gpu_ms"] = gpu_times(scores, k, args.graphs)
            out.append(row)
    return out


VARIANTS = {  # name -> topk_triton keywords (every one gives the same answer, checked against the default)
    "1 prog b2048 w8": {"split": 0, "block": 2048, "num_warps": 8},
    "1 prog b2048 w8 passes": {"split": 0, "block": 2048, "num_warps": 8, "buckets": False},
    "1 prog b2048 w4": {"split": 0, "block": 2048, "num_warps": 4},
    "1 prog b1024 w4": {"split": 0, "block": 1024, "num_warps": 4},
    "1 prog b1024 w2": {"split": 0, "block": 1024, "num_warps": 2},
    "1 prog b4096 w8": {"split": 0, "block": 4096, "num_warps": 8},
    "split 2048 w4": {"split": 2048, "block": 2048, "num_warps": 4, "buckets": False},
    "split 4096 w8": {"split": 4096, "block": 4096, "num_warps": 8, "buckets": False},
    "split 8192 w8": {"split": 8192, "block": 4096, "num_warps": 8, "buckets": False},
    "split 16384 w8": {"split": 16384, "block": 4096, "num_warps": 8, "buckets": False},
    # the bucket shortcut split over a row's chunks (topk_split.py): range, buckets, sub-buckets, list, select
    "split-b 2048 w4": {"split": 2048, "block": 2048, "num_warps": 4, "buckets": True},
    "split-b 4096 w4": {"split": 4096, "block": 4096, "num_warps": 4, "buckets": True},
    "split-b 4096 w8": {"split": 4096, "block": 4096, "num_warps": 8, "buckets": True},
    "split-b 8192 w8": {"split": 8192, "block": 4096, "num_warps": 8, "buckets": True},
    "split-b 16384 w8": {"split": 16384, "block": 4096, "num_warps": 8, "buckets": True},
}


def replayed(fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` captured in a CUDA graph after a warm call (which compiles its kernels): its replay.

    Events around an eager call of a form of several launches time the host's launch gaps as well (the
    split forms' five launches read 0.04-0.13 ms for the same kernels from run to run on the H100); a
    replay times the kernels alone, as a decode step replayed from its graph runs them.
    """
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def gpu_times(scores: torch.Tensor, k: int, graphs: bool = False) -> dict[str, float]:
    """Device time (CUDA events, median) of torch.topk and each kernel shape; ``graphs``: each replayed
    from a CUDA graph (no host launch gaps), else called eagerly."""
    from triton.testing import do_bench

    from kvwarden.layers.kernels.topk import topk_triton

    def timed(fn: Callable[[], object], replay: bool = graphs) -> float:
        return do_bench(replayed(fn) if replay else fn, warmup=10, rep=50, return_mode="median")

    reference, default = partial(torch.topk, scores, k, dim=-1), partial(topk_triton, scores, k)
    out = {"torch.topk": timed(reference)}
    want = topk_triton(scores, k)
    for name, kw in VARIANTS.items():
        try:  # a shape the compiler refuses (or a wrong answer) is reported, not fatal
            got = topk_triton(scores, k, **kw)
            same = all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
            ms = timed(partial(topk_triton, scores, k, **kw))
            out[name] = ms if same else float("nan")
        except Exception as e:  # recorded in the table as a failed shape
            print(f"[topk] variant {name!r} failed: {type(e).__name__}: {str(e)[:200]}")
            out[name] = float("nan")
    # what topk_triton picks by itself, timed after the variants: a shape's first timed kernel read up to 2x
    # its later repeats on the H100 (2026-12-07: 0.132 against 0.062 ms for the same launch at 16 x 64K)
    out["default"] = timed(default)
    if graphs:  # the same two eager, in the same run: the launch gaps' share, on the same card and buffers
        out["torch.topk eager"], out["default eager"] = timed(reference, False), timed(default, False)
    return out


def model_rows(args: argparse.Namespace, device: str) -> list[dict]:
    from kvwarden import LLM, SamplingParams

    rng = random.Random(0)
    prompt = [rng.randrange(3, 1000) for _ in range(args.prompt_len)]
    params = SamplingParams(temperature=0.0, max_tokens=args.decode_tokens, ignore_eos=True)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    out = []
    for label, model, unsafe in (
        (f"{args.dsa_model} (deterministic top-k)", args.dsa_model, False),
        (f"{args.dsa_model} (incident's top-k)", args.dsa_model, True),
        (f"{args.dense_model} (dense attention)", args.dense_model, False),
    ):
        kw = {"unsafe_topk": True} if unsafe else {}
        llm = LLM(
            model, device=device, dtype=args.dtype, enable_prefix_caching=False,
            max_num_batched_tokens=max(4096, args.prompt_len), **kw,
        )  # fmt: skip
        llm.generate([prompt], params)  # warm-up: every kernel shape the timed calls use compiles here
        # prefill: a one-token generation (one chunk, the last row's logits); decode over the whole prompt
        # (where the selection prunes): a long generation less the one-token one
        t = time.perf_counter()
        llm.generate([prompt], one)
        t1 = time.perf_counter()
        llm.generate([prompt], params)
        prefill, decode = t1 - t, (time.perf_counter() - t1) - (t1 - t)
        del llm  # its cache pool goes back before the next engine sizes its own
        out.append(
            {
                "model": label,
                "prefill_tok_s": args.prompt_len / prefill,
                "decode_tok_s": (args.decode_tokens - 1) / decode,
            }
        )
    return out


def summarize(figures: dict[str, Any]) -> list[tuple[str, str]]:
    """One (label, value) pair per line of the GPU script's summary: selection ratios, device times, model rows."""
    sel, sink = figures["selection"], figures.get("sink")
    big = [r for r in sel if r["keys"] >= 8192]
    fast = "triton" if any("triton_ms" in r for r in sel) else "deterministic"  # the CPU has no Triton kernel
    ratio = [(r["keys"], r["rows"], round(r["torch_topk_ms"] / r[f"{fast}_ms"], 2)) for r in (sel if sink else big)]
    out = [(f"with a sink: torch.topk / {fast}" if sink else f"torch.topk / {fast} at 8K+ keys", str(ratio))]
    timed = [r for r in big if "gpu_ms" in r]  # --variants on a GPU
    if timed:
        best = [(r["keys"], r["rows"], *b) for r in timed if (b := _best_shape(r["gpu_ms"]))]
        out.append(("device time: torch.topk / best shape (8K+)", str(best)))
        default = [(r["keys"], r["rows"], round(r["gpu_ms"]["torch.topk"] / r["gpu_ms"]["default"], 2)) for r in timed]
        out.append(
            ("device time: torch.topk / default (8K+)", f"{'graphs' if figures.get('graphs') else 'eager'} {default}")
        )
    if figures.get("models"):
        rows = [(r["model"][:40], round(r["prefill_tok_s"]), round(r["decode_tok_s"], 1)) for r in figures["models"]]
        out.append(("DSA vs dense prefill|decode tok/s", str(rows)))
    return out


def _best_shape(gpu_ms: dict[str, float]) -> tuple[str, float] | None:
    """The fastest kernel shape (not torch.topk, the default or an eager timing; NaN: it failed) and torch.topk's
    time over its; None when no shape ran."""
    ran = [
        (v, n) for n, v in gpu_ms.items() if n not in ("torch.topk", "default") and not n.endswith("eager") and v == v
    ]
    if not ran:
        return None
    ms, name = min(ran)
    return name, round(gpu_ms["torch.topk"] / ms, 2)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--keys", type=int, nargs="+", default=[4096, 8192, 16384, 32768, 65536])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 256])
    p.add_argument("--k", type=int, default=2048, help="keys selected per row (GLM-5: 2048)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--dtype", default=None, help="model rows' dtype (default: bfloat16 on cuda, float32 on cpu)")
    p.add_argument("--dsa-model", default="builtin:glm_moe_dsa-small")
    p.add_argument("--dense-model", default="builtin:qwen3_moe-small")
    p.add_argument("--no-models", action="store_true", help="selection rows only")
    p.add_argument(
        "--sink", action="store_true",
        help="column 0 of every row scores 1000 (the rest |N(0, 1)| * 3): an attention sink, the kernel's bucket "
        "shortcut's worst case (every other score lands in a few buckets, so it takes the passes over the row)",
    )  # fmt: skip
    p.add_argument("--variants", action="store_true", help="GPU: device time of each kernel shape and torch.topk")
    p.add_argument(
        "--graphs", action="store_true",
        help="with --variants: time each shape replayed from a CUDA graph (the kernels alone, as decode runs them)",
    )  # fmt: skip
    p.add_argument("--quick", action="store_true", help="a smoke run: small sizes")
    args = p.parse_args()
    if args.graphs and not (args.variants and args.device == "cuda"):
        p.error("--graphs times the --variants shapes on a CUDA device: add --variants, with --device cuda")
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    if args.quick:
        args.keys, args.rows, args.k, args.repeats = [4096], [1, 16], 256, 1
        args.prompt_len, args.decode_tokens = 128, 8
    console = Console(width=400)  # the device-time table is wide: never cut its figures
    sel = selection_rows(args, args.device)
    table = Table(title=f"Key selection on {args.device}: best of {args.repeats} (ms)", title_justify="left")
    cols = ["keys", "rows", "k", "torch.topk", "deterministic", "vs topk", "arrival (bf16)", "ties f32", "ties bf16"]
    if args.device == "cuda":
        cols.insert(5, "triton")
    for c in cols:
        table.add_column(c, justify="right")
    for r in sel:
        cells = [r["keys"], r["rows"], r["k"], f"{r['torch_topk_ms']:.2f}", f"{r['deterministic_ms']:.2f}"]
        if args.device == "cuda":
            cells.append(f"{r['triton_ms']:.2f}")
        fastest = min(r["deterministic_ms"], r.get("triton_ms", float("inf")))
        cells += [f"{r['torch_topk_ms'] / fastest:.2f}x", f"{r['arrival_ms']:.2f}"]
        cells += [f"{r['ties_f32']:.1%}", f"{r['ties_bf16']:.1%}"]
        table.add_row(*[str(c) for c in cells])
    console.print(table)
    if args.variants and args.device == "cuda":
        how = "replayed from CUDA graphs" if args.graphs else "eager calls"
        vt = Table(title=f"Device time (median, ms, {how}): torch.topk and the kernel's shapes", title_justify="left")
        names = ["torch.topk", "default", *(["torch.topk eager", "default eager"] if args.graphs else []), *VARIANTS]
        for c in ["keys", "rows", *names]:
            vt.add_column(c, justify="right")
        for r in sel:
            vt.add_row(str(r["keys"]), str(r["rows"]), *[f"{r['gpu_ms'][m]:.3f}" for m in names])
        console.print(vt)
    if args.device == "cuda":  # the selection rows' buffers back to the driver before engines size their pools
        torch.cuda.empty_cache()
    models = [] if args.no_models else model_rows(args, args.device)
    if models:
        title = f"Prefill ({args.prompt_len} tokens) and batch-1 decode after it, {args.dtype}, canonical numerics"
        mt = Table(title=title, title_justify="left")
        for c in ("model", "prefill tok/s", "decode tok/s"):
            mt.add_column(c, justify="right")
        for r in models:
            mt.add_row(r["model"], f"{r['prefill_tok_s']:.0f}", f"{r['decode_tok_s']:.1f}")
        console.print(mt)
    print(
        json.dumps(
            {
                "bench": "topk",
                "device": args.device,
                "sink": args.sink,
                "graphs": args.graphs,
                "selection": sel,
                "models": models,
            }
        )
    )


if __name__ == "__main__":
    main()
