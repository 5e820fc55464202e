"""The canonical GEMM with its fixed splits of K, against the same kernel unsplit, per weight shape.

For each weight shape (the 0.6B preset's and real checkpoints' projections) and row count it times
three launches of ``kernels/gemm.py``: *unsplit* (one program walks all of K: the kernel before the
splits), *walked* (the splits in one program per tile) and *chosen* (what ``linear`` runs: the splits
in parallel where the launch has few output tiles). Beside each, the time the weight's bytes take at
the copy bandwidth measured in this run. It checks bitwise, for every shape, that a row is the same
whatever the row count and the form (chosen = walked at every M; row 0 of the largest M = the 1-row
launch). Ends with one JSON line.

    kvwarden bench gemm_split                         # on a GPU
    kvwarden bench gemm_split --rows 1,64 --shape 1024x3072
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch

# (name, N, K): Qwen3-0.6B (q|k|v, o, gate|up, down), Qwen3-8B and Llama-3-8B's projections.
SHAPES = (
    ("qwen3-0.6b qkv", 4096, 1024),
    ("qwen3-0.6b o", 1024, 2048),
    ("qwen3-0.6b gate_up", 6144, 1024),
    ("qwen3-0.6b down", 1024, 3072),
    ("qwen3-8b qkv", 6144, 4096),
    ("qwen3-8b down", 4096, 12288),
    ("llama-3-8b gate_up", 28672, 4096),
    ("llama-3-8b o", 4096, 4096),
)
ROWS = (1, 16, 64, 256, 2048)


def bandwidth(device: str) -> float:
    src = torch.empty(1 << 28, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    from triton.testing import do_bench

    ms = do_bench(lambda: dst.copy_(src), warmup=5, rep=20)
    return 2 * src.numel() / (ms * 1e-3)


def times_us(x: torch.Tensor, w: torch.Tensor, cfg: Any, k_blocks: int, counters: torch.Tensor) -> tuple[float, ...]:
    """Unsplit, walked and chosen launches of one GEMM, in microseconds."""
    from triton.testing import do_bench

    from kvwarden.layers.kernels import gemm

    runs = (
        lambda: gemm.launch(x, w, None, cfg, blocks=k_blocks),
        lambda: gemm.launch(x, w, None, cfg),
        lambda: gemm.linear(x, w, counters=counters),
    )
    return tuple(do_bench(run, warmup=10, rep=40) * 1e3 for run in runs)


def bench_us(x: torch.Tensor, w: torch.Tensor, cfg: Any, parallel: bool, counters: torch.Tensor, blocks: int) -> float:
    from triton.testing import do_bench

    from kvwarden.layers.kernels import gemm

    return do_bench(lambda: gemm.launch(x, w, None, cfg, parallel, counters, blocks), warmup=10, rep=30) * 1e3


def sweep(shapes: list, rows: list[int], dtype: torch.dtype, device: str, counters: torch.Tensor) -> list[dict]:
    """Every split length (blocks of K per split) for each shape: walked and parallel times per row count."""
    from kvwarden.intmath import cdiv
    from kvwarden.layers.kernels import gemm

    gen = torch.Generator(device="cuda").manual_seed(1)
    print("| weight | blocks per split | splits | " + " | ".join(f"{m} rows walked / parallel us" for m in rows) + " |")
    out = []
    for name, n, k in shapes:
        w = (torch.randn((n, k), device="cuda", generator=gen) * 0.02).to(dtype)
        cfg = gemm.gemm_config(n, k, dtype, device)
        k_blocks = cdiv(k, cfg.block_k)
        for blocks in sorted({max(1, k_blocks // d) for d in (1, 2, 4, 8, 16)}, reverse=True):
            nsplit = cdiv(k_blocks, blocks)
            cells, row = [], dict(name=name, n=n, k=k, blocks=blocks, splits=nsplit, us={})
            for m in rows:
                x = torch.randn((m, k), device="cuda", generator=gen).to(dtype)
                forms = [False, True] if nsplit > 1 and m <= 256 else [False]  # parallel: the GEMV shapes
                t = [bench_us(x, w, cfg, f, counters, blocks) for f in forms]
                row["us"][m] = t
                cells.append(" / ".join(f"{v:.1f}" for v in t))
            print(f"| {name} | {blocks} | {nsplit} | " + " | ".join(cells) + " |", flush=True)
            out.append(row)
    return out


def summarize(figures: dict[str, Any]) -> list[tuple[str, str]]:
    """One (label, value) pair per line of the GPU script's summary: bitwise; b1 chosen vs unsplit (0.6b)."""
    ratios = [
        (r["name"].split()[-1], round(r["unsplit_us"] / r["chosen_us"], 2))
        for r in figures["rows"]
        if r["rows"] == 1 and r["name"].startswith("qwen3-0.6b")
    ]
    return [("bitwise; b1 chosen vs unsplit (0.6b)", f"{figures['bitwise']} {ratios}")]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default=",".join(map(str, ROWS)))
    p.add_argument("--shape", action="append", default=None, help="NxK (repeatable); default: the table's")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--sweep", action="store_true", help="time every split length per shape, then the table")
    args = p.parse_args()
    from kvwarden.intmath import cdiv
    from kvwarden.layers.kernels import gemm

    dtype = getattr(torch, args.dtype)
    rows = [int(r) for r in args.rows.split(",")]
    shapes = [(s, *map(int, s.split("x"))) for s in args.shape] if args.shape else SHAPES
    device = torch.cuda.get_device_name()
    bw = bandwidth("cuda")
    counters = gemm.new_counters("cuda")
    swept = sweep(shapes, rows, dtype, device, counters) if args.sweep else []
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"{device}, copy bandwidth {bw / 1e12:.2f} TB/s, {args.dtype}")
    print("| weight | N x K | splits | rows | unsplit us | walked us | chosen us (form) | floor us |", end="")
    print(" chosen vs unsplit |")
    print("|---|---|---|---|---|---|---|---|---|")
    out: list[dict] = []
    all_same = True
    for name, n, k in shapes:
        w = (torch.randn((n, k), device="cuda", generator=gen) * 0.02).to(dtype)
        cfg = gemm.gemm_config(n, k, dtype, device)
        k_blocks = cdiv(k, cfg.block_k)
        nsplit = cdiv(k_blocks, gemm.split_blocks(n, k, cfg))
        xs = {m: torch.randn((m, k), device="cuda", generator=gen).to(dtype) for m in rows}
        one = gemm.linear(xs[rows[-1]][:1], w, counters=counters)
        big = gemm.linear(xs[rows[-1]], w, counters=counters)
        same = torch.equal(one, big[:1])
        for m in rows:
            x = xs[m]
            par = gemm.splits_in_parallel(m, n, k, cfg, x.element_size())
            same &= torch.equal(gemm.linear(x, w, counters=counters), gemm.linear(x, w, parallel=False))
            t_un, t_walk, t_pick = times_us(x, w, cfg, k_blocks, counters)
            floor = (n * k + m * k + m * n) * x.element_size() / bw * 1e6
            form = "parallel" if par and nsplit > 1 else "walked" if nsplit > 1 else "one split"
            print(
                f"| {name} | {n} x {k} | {nsplit} | {m} | {t_un:.1f} | {t_walk:.1f} | {t_pick:.1f} ({form}) "
                f"| {floor:.1f} | {t_un / t_pick:.2f}x |",
                flush=True,
            )
            out.append(dict(name=name, n=n, k=k, splits=nsplit, rows=m, unsplit_us=t_un, walked_us=t_walk,
                            chosen_us=t_pick, form=form, floor_us=floor))  # fmt: skip
        all_same &= same
        print(f"|   bitwise: 1 row = row 0 of {rows[-1]}, chosen = walked at every M | | | | {same} | | | | |")
    print(
        json.dumps(
            {"bench": "gemm_split", "device": device, "bandwidth": bw, "bitwise": all_same, "rows": out, "sweep": swept}
        )
    )


if __name__ == "__main__":
    main()
