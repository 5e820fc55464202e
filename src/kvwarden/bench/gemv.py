"""Narrower output tiles for GEMV-shaped launches: how much faster, and are the bits the same.

A decode step's GEMMs have a few rows, so one launch is one tile of M and as many programs as the weight
has output tiles (``N / BLOCK_N``: 32-48 on the 0.6B preset's weights with the H100's tiles of 128).
A narrower ``BLOCK_N`` gives more programs to stream the weight. For each weight shape this times the
table's configuration (*base*) against variants that keep everything that fixes the arithmetic of an
output element (``BLOCK_M``, ``BLOCK_K``, warps, hence the matrix instruction; the split of K, passed
explicitly since :func:`split_blocks` follows ``BLOCK_N``) and change only ``BLOCK_N`` and the pipeline
depth, walked and parallel, at each row count. Every variant's rows are compared bitwise with the base's
rows of a 2,048-row launch: a variant that differs is reported and never counts as a speed-up. Variants
that change ``BLOCK_M`` or warps are timed and checked too, marked ``other``: the argument for their
bits is weaker (another instruction shape), the check is the same. Ends with one JSON line.

    kvwarden bench gemv                           # on a GPU
    kvwarden bench gemv --shape 1024x3072 --rows 1,16
    kvwarden bench gemv --write /tmp/gemm_tuned.json   # record few-rows tiles (KVWARDEN_GEMM_TABLE reads it)

``--write`` records, per weight shape of this GPU's table and of the list below, the narrower tiles with
the smallest summed time over the row counts, where they keep the bits at every row count and in both
forms and save at least ``--min-gain`` of the base's time: ``few_rows`` entries of the GEMM table, which
``gemm_config.launch_config`` gives launches of at most one tile of rows. Speed only: the bits of every
recorded entry are the weight's own (checked here, and again by ``tests/test_gemm_few_rows.py``).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch

# (name, N, K, fused SwiGLU): the 0.6B preset's projections (its gate/up is the fused SwiGLU launch), and
# Qwen3-8B / Llama-3-8B ones (their configurations come from the fixed rule where the table has none).
SHAPES = (
    ("qwen3-0.6b qkv", 4096, 1024, False),
    ("qwen3-0.6b o", 1024, 2048, False),
    ("qwen3-0.6b gate_up", 6144, 1024, True),
    ("qwen3-0.6b down", 1024, 3072, False),
    ("qwen3-8b qkv", 6144, 4096, False),
    ("llama-3-8b o", 4096, 4096, False),
)
ROWS = (1, 4, 16, 64)
BIG = 2048  # the base's rows come from one launch of this many rows (a prefill's tile layout)


def variants(base, glu: bool, other: bool = True) -> list[tuple[str, object]]:
    """(kind, config): ``base``, ``n`` (narrower BLOCK_N, other stages: same instruction, same K chain), and
    with ``other``, ``other`` (BLOCK_M / warps changed)."""
    smallest = 32 if glu else 16  # the fused launch halves BLOCK_N
    out = [("base", base)]
    for bn in (16, 32, 64, 128):
        for st in sorted({base.num_stages, 3, 4, 5}):
            if smallest <= bn <= base.block_n and (bn, st) != (base.block_n, base.num_stages):
                out.append(("n", replace(base, block_n=bn, num_stages=st)))
    for bm, warps in ((64, 4), (128, 8), (64, 8)) if other else ():
        if (bm, warps) != (base.block_m, base.num_warps):
            for bn in sorted({max(smallest, base.block_n // 2), base.block_n}):
                out.append(("other", replace(base, block_m=bm, block_n=bn, num_warps=warps)))
    return out


def run_shape(
    name: str, n: int, k: int, glu: bool, rows: list[int], dtype: torch.dtype, device: str, other: bool = True
) -> dict:
    from triton.testing import do_bench

    from kvwarden.intmath import cdiv
    from kvwarden.layers.kernels import gemm

    gen = torch.Generator(device="cuda").manual_seed(n * 7 + k)
    w = (torch.randn((n, k), device="cuda", generator=gen) * 0.02).to(dtype)
    x = torch.randn((BIG, k), device="cuda", generator=gen).to(dtype)
    base = gemm.gemm_config(n, k, dtype, device)
    blocks = gemm.split_blocks(n, k, base)  # the base's split of K, kept by every variant
    nsplit = cdiv(cdiv(k, base.block_k), blocks)
    counters = gemm.new_counters("cuda")
    want = gemm.launch(x, w, None, base, glu=glu)
    shape = dict(name=name, n=n, k=k, glu=glu, splits=nsplit, base=asdict(base), variants=[])
    for kind, cfg in variants(base, glu, other):
        forms = (False, True) if nsplit > 1 else (False,)
        cell = dict(kind=kind, cfg=asdict(cfg), same=True, us={})
        try:
            for m in rows:
                times = []
                chosen = nsplit > 1 and gemm.splits_in_parallel(m, n, k, cfg, x.element_size(), blocks)
                for par in forms:
                    run = partial(gemm.launch, x[:m], w, None, cfg, par, counters, blocks, glu)
                    cell["same"] &= torch.equal(run(), want[:m])
                    if other or par == chosen:  # tuning times the form linear() runs; exploring, both
                        times.append(do_bench(run, warmup=10, rep=30, return_mode="median") * 1e3)
                cell["us"][m] = min(times)
        except Exception as exc:  # a configuration this GPU cannot compile (shared memory): reported, skipped
            cell.update(same=False, error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:80]}")
        shape["variants"].append(cell)
        label = f"{kind} m{cfg.block_m} n{cfg.block_n} k{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages}"
        times = " | ".join(f"{cell['us'][m]:.1f}" if m in cell["us"] else "-" for m in rows)
        print(f"| {name} | {label} | {cell['same']} | {times} |", flush=True)
    return shape


def best_rows(shape: dict, rows: list[int]) -> list[dict]:
    """Per row count: the base's time and the fastest bitwise-equal variant of the same instruction."""
    base = shape["variants"][0]
    out = []
    for m in rows:
        same = [v for v in shape["variants"] if v["same"] and v["kind"] != "other" and m in v["us"]]
        if m not in base["us"] or not same:  # the base failed to compile here: nothing to compare
            continue
        best = min(same, key=lambda v: v["us"][m])
        out.append(dict(name=shape["name"], rows=m, base_us=base["us"][m], best_us=best["us"][m], best=best["cfg"]))
    return out


def table_shapes(device: str, dtype: torch.dtype) -> list[tuple[str, int, int, bool]]:
    """The list above and this GPU's tuned shapes of ``dtype`` (not the LM head: its tiles fill the GPU)."""
    from kvwarden.layers.kernels.gemm_config import parse_tuned_key, tuned_key, tuned_table

    listed = {tuned_key(n, k, dtype): (name, n, k, glu) for name, n, k, glu in SHAPES}
    for key in tuned_table(device):
        n, k, key_dtype = parse_tuned_key(key)
        if key_dtype == dtype and n < 65536:
            listed.setdefault(key, (key, n, k, False))
    return list(listed.values())


def record(shape: dict, rows: list[int], min_gain: float) -> dict | None:
    """The few-rows entry for one shape: the same-bits ``n`` variant of the smallest summed time, if it
    saves at least ``min_gain`` of the base's."""
    rows = [m for m in rows if m <= shape["base"]["block_m"]]  # launch_config narrows only these launches
    base = shape["variants"][0]
    same = [v for v in shape["variants"][1:] if v["kind"] == "n" and v["same"] and set(rows) <= set(v["us"])]
    if not rows or not same or not set(rows) <= set(base["us"]):
        return None
    best = min(same, key=lambda v: sum(v["us"][m] for m in rows))
    if sum(best["us"][m] for m in rows) > (1 - min_gain) * sum(base["us"][m] for m in rows):
        return None
    us = {str(m): round(best["us"][m], 2) for m in rows}
    return dict(block_n=best["cfg"]["block_n"], num_stages=best["cfg"]["num_stages"], us=us,
                base_us={str(m): round(base["us"][m], 2) for m in rows})  # fmt: skip


def write_table(path: Path, device: str, dtype: torch.dtype, shapes: list[dict], rows: list[int], gain: float) -> int:
    """Merge this GPU's few-rows entries into the table at ``path`` (if absent, a copy of the one the engine
    reads: ``KVWARDEN_GEMM_TABLE`` or the packaged one)."""
    from kvwarden.layers.kernels.gemm_config import table_path, tuned_key

    table = json.loads((path if path.is_file() else table_path()).read_text())
    entry = table.setdefault(device, {"shapes": {}, "measured": {}})
    few = entry.setdefault("few_rows", {})
    for shape in shapes:
        key = tuned_key(shape["n"], shape["k"], dtype)
        got = record(shape, rows, gain)
        if got is None:
            few.pop(key, None)
        else:
            few[key] = got
    path.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    return len(few)


def summarize(figures: dict[str, Any]) -> list[tuple[str, str]]:
    """One (label, value) pair per line of the GPU script's summary: b1 base -> best same-bits us."""
    b1 = [(r["name"], round(r["base_us"], 1), round(r["best_us"], 1)) for r in figures["best"] if r["rows"] == 1]
    return [("b1 base -> best same-bits us", str(b1))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default=",".join(map(str, ROWS)))
    p.add_argument("--shape", action="append", default=None, help="NxK (repeatable); default: the table's")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--write", default="", help="record few-rows entries into this table (see the docstring)")
    p.add_argument("--min-gain", type=float, default=0.05, help="--write: the least saving worth an entry")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("kvwarden bench gemv times compiled kernels: it needs a CUDA GPU")
    dtype = getattr(torch, args.dtype)
    rows = [int(r) for r in args.rows.split(",")]
    device = torch.cuda.get_device_name()
    shapes = [(s, *map(int, s.split("x")), False) for s in args.shape] if args.shape else SHAPES
    if args.write and not args.shape:
        shapes = table_shapes(device, dtype)
    print(f"{device}, {args.dtype}; us per launch (best of walked / parallel), bitwise = rows of a {BIG}-row base")
    print("| weight | config | bitwise | " + " | ".join(f"{m} rows us" for m in rows) + " |")
    print("|---|---|---|" + "---|" * len(rows))
    other = not args.write  # tuning tries only what keeps the instruction
    shapes_out, written = [], None
    for name, n, k, glu in shapes:
        shapes_out.append(run_shape(name, n, k, glu, rows, dtype, device, other))
        if args.write:  # after every shape: a timeout keeps what was measured
            written = write_table(Path(args.write), device, dtype, shapes_out, rows, args.min_gain)
    print("\n| weight | rows | base us | best same-bits us | speed-up | best config |")
    print("|---|---|---|---|---|---|")
    summary = []
    for shape in shapes_out:
        for r in best_rows(shape, rows):
            c = r["best"]
            gain = r["base_us"] / r["best_us"]
            print(
                f"| {r['name']} | {r['rows']} | {r['base_us']:.1f} | {r['best_us']:.1f} | {gain:.2f}x | "
                f"n{c['block_n']} s{c['num_stages']} |"
            )
            summary.append(r)
    differs = [(s["name"], v["cfg"]) for s in shapes_out for v in s["variants"] if not v["same"]]
    print(f"variants whose bits differ (or failed): {len(differs)}")
    if args.write:
        print(f"few-rows entries for {device} in {args.write}: {written}")
    out = {"bench": "gemv", "device": device, "dtype": args.dtype, "best": summary, "shapes": shapes_out}
    print(json.dumps({**out, "few_rows_written": written}))


if __name__ == "__main__":
    main()
