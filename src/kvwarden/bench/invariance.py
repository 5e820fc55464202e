"""The invariance matrix: properties (a)-(i) per model and numerics, bitwise, on one device.

For each model, numerics mode (canonical, shape-dependent) and sampling mode
(greedy, seeded), runs ``kvwarden.bench.properties.check_properties`` and
prints which properties held bit for bit. For the shape-dependent fast path it
also counts, over ``--repeats`` runs, how many runs of the contamination
scenario (A once, then B) and of the batch scenario (B among partners) differ
from B's cold run: the seeds' failure measured on the device's own kernels.

Prints a table and ends with one JSON line.

    kvwarden bench invariance --device cuda --dtype bfloat16 \\
        --model builtin:qwen3-0.6b --model builtin:qwen3_next-0.6b --model builtin:granite_hybrid-small
    kvwarden bench invariance --quick          # tiny models on this machine
"""

from __future__ import annotations

import argparse
import json
import random
import time
from functools import partial
from typing import Any

from kvwarden.bench.properties import PROPERTIES, check_properties, compare


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", action="append", help="model (repeatable); default: the tiny presets")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--dtype", default="float32", help="float32 or bfloat16")
    p.add_argument("--block-size", type=int, default=16, help="KV block size")
    p.add_argument("--prompt-len", type=int, default=300, help="tokens of the measured prompt")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens generated per run")
    p.add_argument("--repeats", type=int, default=5, help="runs per fast-path scenario")
    p.add_argument("--numerics", action="append", help="canonical and/or shape-dependent (default both)")
    p.add_argument("--quick", action="store_true", help="tiny models, short prompt (smoke run)")
    p.add_argument("--all-modes", action="store_true", help="also seeded sampling on the shape-dependent path")
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument(
        "--spec",
        action="append",
        default=[],
        metavar="METHOD:K",
        help="property (j): also run (a)-(i) with speculation on (ngram:K, mtp:K where the model has a head) "
        "against speculation off, canonical numerics (repeatable)",
    )
    return p.parse_args()


def fast_path_differing(make, prompt, params, partners, block_size: int, repeats: int) -> dict[str, str]:
    """How many runs of B differ from its cold run after A (contamination) and among partners (batch)."""
    from kvwarden import SamplingParams

    ref = make(enable_prefix_caching=False).generate([prompt], params)[0]
    llm = make()
    llm.generate([prompt[: 2 * block_size - 2]], SamplingParams(max_tokens=2, temperature=0.0))
    contaminated = sum(not compare(ref, llm.generate([prompt], params)[0]).identical for _ in range(repeats))
    batched = 0
    for r in range(repeats):
        group = partners[: 1 + r % len(partners)]
        others = [SamplingParams(max_tokens=4, temperature=0.0)] * len(group)
        outs = make().generate([*group, prompt], [*others, params])
        batched += not compare(ref, outs[-1]).identical
    return {"contamination": f"{contaminated}/{repeats}", "batch": f"{batched}/{repeats}"}


def summarize(figures: dict[str, Any]) -> list[tuple[str, str]]:
    """One (label, value) pair per line of the GPU script's summary: canonical all identical, fast path runs."""
    out = [("canonical all identical", str(figures["canonical_all_identical"]))]
    if figures.get("fast_path_differing"):
        out.append(("fast path runs differing", str(figures["fast_path_differing"])))
    return out


def main() -> int:
    args = parse()
    from kvwarden import LLM, SamplingParams
    from kvwarden.config import resolve_device

    device = resolve_device(args.device)
    models = args.model or ["builtin:llama-tiny", "builtin:qwen3_next-tiny", "builtin:granite_hybrid-tiny"]
    prompt_len = 40 if args.quick else args.prompt_len
    rng = random.Random(args.seed)
    vocab = 1000
    prompt = [rng.randrange(3, vocab) for _ in range(prompt_len)]
    partners = [[rng.randrange(3, vocab) for _ in range(rng.randint(8, prompt_len))] for _ in range(4)]
    modes = {
        "greedy": SamplingParams(temperature=0.0, max_tokens=args.max_tokens, logprobs=20, ignore_eos=True),
        "seeded": SamplingParams(temperature=0.8, top_p=0.95, seed=3, max_tokens=args.max_tokens, logprobs=20),
    }
    rows, fast = [], {}
    for model in models:
        for numerics in args.numerics or ["canonical", "shape-dependent"]:
            make = partial(
                LLM, model, dtype=args.dtype, device=device, numerics=numerics, block_size=args.block_size,
                max_num_batched_tokens=max(64, 3 * args.block_size + 1), max_model_len=prompt_len + 256,
                num_blocks=512,  # state snapshots of a 0.6b hybrid are ~19 MB per block
            )  # fmt: skip
            for mode, params in modes.items():
                if numerics == "shape-dependent" and mode == "seeded" and not args.all_modes:
                    continue  # the fast path's failures show with greedy decoding already
                start = time.perf_counter()
                report = check_properties(make, prompt, params, args.block_size, partners)
                rows.append((model, numerics, mode, report, time.perf_counter() - start))
                print(_row(rows[-1]), flush=True)
                if numerics == "canonical":
                    for spec in _specs(args.spec, model):
                        start = time.perf_counter()
                        reference = make(enable_prefix_caching=False).generate([prompt], params)[0]
                        report = check_properties(
                            partial(make, speculative_config=spec), prompt, params, args.block_size, partners,
                            reference=reference,
                        )  # fmt: skip
                        label = f"canonical + {spec['method']} k={spec['num_speculative_tokens']} (j)"
                        rows.append((model, label, mode, report, time.perf_counter() - start))
                        print(_row(rows[-1]), flush=True)
            if numerics == "shape-dependent":
                greedy = modes["greedy"]
                fast[model] = fast_path_differing(make, prompt, greedy, partners, args.block_size, args.repeats)
                print(f"  fast path, runs differing from cold: {fast[model]}", flush=True)
    print()
    print(f"Invariance matrix ({device}, {args.dtype}, block {args.block_size}, prompt {prompt_len} tokens):")
    print("| model | numerics | sampling | " + " | ".join(PROPERTIES) + " | seconds |")
    print("|---|---|---|" + "---|" * len(PROPERTIES) + "---|")
    for row in rows:
        print(_row(row))
    for model, counts in fast.items():
        print(f"| {model} | shape-dependent | runs differing | contamination {counts['contamination']} | "
              f"batch {counts['batch']} |")  # fmt: skip
    summary = {
        "device": device,
        "dtype": args.dtype,
        "matrix": {f"{m}|{n}|{s}": r.to_dict() for m, n, s, r, _ in rows},
        "canonical_all_identical": all(r.all_identical for _, n, _, r, _ in rows if n.startswith("canonical")),
        "fast_path_differing": fast,
    }
    print(json.dumps(summary))
    return 0 if summary["canonical_all_identical"] else 1


def _specs(specs: list[str], model: str) -> list[dict]:
    """``METHOD:K`` flags as speculative configs (``mtp`` only where the checkpoint has a head)."""
    from kvwarden.models.mtp import checkpoint_has_mtp
    from kvwarden.models.sources import resolve_model

    out = []
    for text in specs:
        method, _, k = text.partition(":")
        if method == "mtp" and not checkpoint_has_mtp(resolve_model(model)):
            continue
        out.append({"method": method, "num_speculative_tokens": int(k or 2)})
    return out


def _row(row) -> str:
    model, numerics, mode, report, seconds = row
    outcomes = [report.outcomes[p] for p in PROPERTIES]
    cells = ["same" if o.identical else f"DIFF@{o.first_divergent_token}" for o in outcomes]
    return f"| {model} | {numerics} | {mode} | " + " | ".join(cells) + f" | {seconds:.0f} |"


if __name__ == "__main__":
    raise SystemExit(main())
