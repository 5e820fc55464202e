"""Measure the canonical GEMM's tile configurations per weight shape and record the best (GPU only).

For every weight shape of a model (fused q/k/v, o, fused gate/up, down, LM
head) each candidate configuration is timed at several row counts - a decode
batch and a prefill chunk run the same configuration, so the choice must be
good for both - and the one with the smallest summed slowdown over the best at
each row count is written to ``src/kvwarden/layers/kernels/gemm_tuned.json``
under the GPU's name. Every candidate is also checked row-invariant on the spot
(a row computed alone equals the same row inside a larger launch).

    kvwarden bench tune_gemm --model builtin:qwen3-0.6b --model builtin:qwen3_next-0.6b
    kvwarden bench tune_gemm --out /tmp/gemm_tuned.json   # write elsewhere (KVWARDEN_GEMM_TABLE reads it)

Tuning changes speed only; the configuration of a weight is still one fixed
function of its shape. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

TABLE = Path(__file__).resolve().parents[1] / "layers/kernels/gemm_tuned.json"
ROWS = (1, 16, 64, 256, 1024, 4096)
HEAD_ROWS = (1, 16, 64, 256)  # the LM head only sees sampled rows


def candidates() -> list[dict[str, int]]:
    out = []
    for bm in (16, 64, 128):
        for bn in (32, 64, 128):
            for bk in (64, 128):
                for stages in (3, 4):
                    out.append({"block_m": bm, "block_n": bn, "block_k": bk, "num_warps": 4, "num_stages": stages})
    out += [{"block_m": 128, "block_n": 128, "block_k": 64, "num_warps": 8, "num_stages": s} for s in (3, 4)]
    return out


def weight_shapes(model: str, dtype: str) -> list[tuple[int, int, bool]]:
    """``(n, k, is_head)`` of every distinct GEMM weight of the model, read from the loaded model."""
    from kvwarden import LLM

    llm = LLM(model, device="cuda", dtype=dtype, num_blocks=64, cuda_graphs="off")
    m = llm.engine.loaded.model
    found: set[tuple[int, int, bool]] = {(*m.lm_head.shape, True)}
    for layer in m.layers:
        experts = [*getattr(layer.ffn, "experts", [])[:1], getattr(layer.ffn, "shared", None)]
        for obj in [layer.mixer, layer.ffn, *(e for e in experts if e is not None)]:
            for name, value in vars(obj).items():
                if name.startswith("w") and isinstance(value, torch.Tensor) and value.dim() == 2:
                    found.add((*value.shape, False))
    del llm
    torch.cuda.empty_cache()
    return sorted(found)


def run(x: torch.Tensor, w: torch.Tensor, cfg: dict[str, int], counters: torch.Tensor) -> torch.Tensor:
    """One GEMM with ``cfg``, its splits of K in parallel where ``linear`` would run them so."""
    from kvwarden.layers.kernels import gemm

    config = gemm.GemmConfig(**cfg)
    m, k = x.shape
    parallel = gemm.splits_in_parallel(m, w.shape[0], k, config, x.element_size())
    return gemm.launch(x, w, None, config, parallel, counters)


def tune_shape(n: int, k: int, is_head: bool, dtype: torch.dtype) -> dict[str, Any]:
    from triton.testing import do_bench

    gen = torch.Generator(device="cuda").manual_seed(n * 31 + k)
    w = (torch.randn((n, k), device="cuda", generator=gen) * 0.02).to(dtype)
    rows = HEAD_ROWS if is_head else ROWS
    xs = {m: torch.randn((m, k), device="cuda", generator=gen).to(dtype) for m in rows}
    from kvwarden.layers.kernels.gemm import new_counters

    counters = new_counters("cuda")
    times: dict[int, dict[int, float]] = {}
    invariant: dict[int, bool] = {}
    for i, cfg in enumerate(candidates()):
        try:
            big = run(xs[rows[-1]], w, cfg, counters)
            invariant[i] = torch.equal(run(xs[rows[-1]][:1], w, cfg, counters), big[:1])
            times[i] = {m: do_bench(lambda m=m, cfg=cfg: run(xs[m], w, cfg, counters), warmup=5, rep=15) for m in rows}
        except Exception as exc:  # a configuration that does not fit the GPU (shared memory) is skipped
            print(f"  {n}x{k} {cfg}: {type(exc).__name__}", file=sys.stderr)
    best_at = {m: min(t[m] for t in times.values()) for m in rows}
    score = {i: sum(t[m] / best_at[m] for m in rows) for i, t in times.items() if invariant[i]}
    chosen = min(score, key=score.__getitem__)
    return {
        "config": candidates()[chosen],
        "us": {str(m): round(times[chosen][m] * 1000, 2) for m in rows},
        "best_us": {str(m): round(best_at[m] * 1000, 2) for m in rows},
        "slowdown": round(score[chosen] / len(rows), 3),
        "all_invariant": all(invariant.values()),
    }


def summarize(figures: dict[str, Any]) -> list[tuple[str, str]]:
    """One (label, value) pair per line of the GPU script's summary: shapes, all candidates invariant."""
    shapes = figures["shapes"]
    return [("shapes, all candidates invariant", f"{len(shapes)} {all(v['all_invariant'] for v in shapes.values())}")]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", action="append", default=None)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--out", default=str(TABLE))
    args = p.parse_args()
    from kvwarden.layers.kernels.gemm import tuned_key

    models = args.model or ["builtin:qwen3-0.6b"]
    dtype = getattr(torch, args.dtype)
    device = torch.cuda.get_device_name()
    shapes = sorted({s for model in models for s in weight_shapes(model, args.dtype)})
    out = Path(args.out)
    table = json.loads(out.read_text()) if out.is_file() else {}
    entry = table.setdefault(device, {"shapes": {}, "measured": {}})
    entry["versions"] = {"torch": torch.__version__, "triton": __import__("triton").__version__}
    print(f"| weight | config (m, n, k, warps, stages) | us at rows {ROWS} | slowdown vs best |")
    print("|---|---|---|---|")
    for n, k, is_head in shapes:
        got = tune_shape(n, k, is_head, dtype)
        key = tuned_key(n, k, dtype)
        entry["shapes"][key] = got["config"]
        entry["measured"][key] = {kk: got[kk] for kk in ("us", "best_us", "slowdown", "all_invariant")}
        c = got["config"]
        cfg = f"{c['block_m']}, {c['block_n']}, {c['block_k']}, {c['num_warps']}, {c['num_stages']}"
        us = " / ".join(str(v) for v in got["us"].values())
        print(f"| {key} | {cfg} | {us} | {got['slowdown']:.2f}x |", flush=True)
        out.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")  # after every shape: a timeout keeps them
    print(json.dumps({"bench": "tune_gemm", "device": device, "table": str(out), "shapes": entry["measured"]}))


if __name__ == "__main__":
    main()
