"""The sweep over published model configurations (bench/configs/): load, agreement, invariance subset.

Each configuration, cut to its first layers (a hybrid keeps both layer kinds),
becomes a random checkpoint of its exact shapes; kvwarden loads it, agrees with
transformers on greedy continuations (tokens and top-20 logprobs) and keeps a
few invariance properties bitwise - or refuses it at load, naming the field.
Prints the table of docs/models.md and ends with one JSON line.

    kvwarden bench sweep                                   # CPU, float32 (the CI test runs the same checks)
    kvwarden bench sweep --device cuda --dtype bfloat16 --tol 0.25   # on a GPU (scripts/gpu_check.sh sweep)
    kvwarden bench sweep --only qwen3-14b --only mistral-7b-v0.1
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any


def summarize(figures: dict[str, Any]) -> list[tuple[str, str]]:
    """One (label, value) pair per line of the GPU script's summary: rows agreeing or refused, per dtype."""
    rows = figures["rows"]
    dtypes = [d for d, _ in figures.get("dtypes", [])] or list(dict.fromkeys(r["dtype"] for r in rows))
    counts = [
        f"{d}: {sum(r['status'] in ('agrees', 'refused') for r in rows if r['dtype'] == d)} of "
        f"{sum(r['dtype'] == d for r in rows)}"
        for d in dtypes
    ]
    return [("rows agreeing or refused", ", ".join(counts))]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--configs", type=Path, default=Path("bench/configs"), help="folder of config.json files")
    p.add_argument(
        "--dtype",
        action="append",
        help="compute dtype of both engines, optionally with its bound as DTYPE:TOL (repeatable: each "
        "checkpoint is written once and checked in every dtype; default float32 at --tol)",
    )
    p.add_argument("--weights-dtype", default="bfloat16", help="dtype of the written checkpoints")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--large-prompts", type=int, default=2, help="prompts for hidden sizes of 3072 and up")
    p.add_argument("--max-experts", type=int, default=0, help="cap a MoE's expert count (0: none)")
    p.add_argument("--tol", type=float, default=1e-3, help="max |Δ logprob| over likely tokens")
    p.add_argument("--only", action="append", help="config name (repeatable)")
    args = p.parse_args()
    dtypes = []
    for spec in args.dtype or ["float32"]:
        dt, _, tol = spec.partition(":")
        if dt not in ("float32", "bfloat16", "float16"):
            p.error(f"--dtype: {dt!r} is not float32, bfloat16 or float16")
        try:
            dtypes.append((dt, float(tol) if tol else args.tol))
        except ValueError:
            p.error(f"--dtype {spec}: the bound after ':' must be a number")
    import torch

    from kvwarden.bench.real_configs import sweep_config_dtypes

    torch.set_num_threads(torch.get_num_threads())
    names = args.only or sorted(f.stem for f in args.configs.glob("*.json"))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            config = json.loads((args.configs / f"{name}.json").read_text())
            large = int(config.get("hidden_size", 0)) >= 3072
            got = sweep_config_dtypes(
                name, config, Path(tmp), dtypes=dtypes, layers=args.layers,
                prompts=args.large_prompts if large else args.prompts, tokens=args.tokens, device=args.device,
                weights_dtype=args.weights_dtype, max_experts=args.max_experts or None,
            )  # fmt: skip
            for row in got:
                print(
                    f"[sweep] {name} {row.dtype}: {row.status} ({row.seconds:.0f} s) {row.detail}",
                    file=sys.stderr,
                    flush=True,
                )
            rows.extend(got)
    shown = ", ".join(f"{dt} (bound {tol:g})" for dt, tol in dtypes)
    print(f"\nSweep ({args.device}, {shown}, first {args.layers} layers, {args.tokens} greedy tokens):")
    print(
        "| configuration | dtype | architecture | shape | result | greedy equal | max \\|Δ\\| likely / top-20 "
        "| invariance | s |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        inv = " ".join(f"{k}:{'same' if v else 'DIFF'}" for k, v in r.invariance.items()) or "-"
        result = r.status if r.status != "refused" else f"refused: {r.detail}"
        eq = f"{r.greedy_equal}/{r.prompts}" if r.prompts else "-"
        print(
            f"| {r.name} | {r.dtype} | {r.architecture} | {r.shape} | {result} | {eq} "
            f"| {r.max_dlogprob_likely:.1e} / {r.max_dlogprob_top20:.1e} | {inv} "
            f"| {r.seconds:.0f} |"
        )
    print(json.dumps({"bench": "sweep", "device": args.device, "dtypes": dtypes, "rows": [asdict(r) for r in rows]}))
    return 0 if all(r.status in ("agrees", "refused") for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
