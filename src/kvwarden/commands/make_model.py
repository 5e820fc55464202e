"""``kvwarden make-model``: write a seeded random checkpoint in Hugging Face format."""

from __future__ import annotations

import argparse

from kvwarden.models.presets import ARCHS, PRESETS


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "make-model",
        help="write a seeded random model (HF format) to a directory",
        description=(
            "Writes config.json, model.safetensors (seeded random weights), tokenizer.json (byte-level BPE "
            "trained on text shipped with kvwarden) and tokenizer_config.json with a chat template. The same "
            "seed gives byte-identical files; transformers loads them."
        ),
    )
    p.add_argument("--arch", choices=ARCHS, required=True, help="model family")
    p.add_argument(
        "--preset", choices=PRESETS, default="tiny", help="size: tiny (tests), small (CPU benchmarks), compat (vLLM)"
    )
    p.add_argument("--seed", type=int, default=0, help="weights seed")
    p.add_argument("--out", required=True, help="output directory (created if missing)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvwarden.models.make_model import make_model

    out = make_model(args.arch, args.preset, args.seed, args.out)
    print(f"wrote {args.arch}/{args.preset} (seed {args.seed}) to {out}")
    return 0
