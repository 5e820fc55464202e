"""``kvwarden make-model``: write a seeded random checkpoint in Hugging Face format."""

from __future__ import annotations

import argparse

from kvwarden.models.make_model import ARCHS, PRESETS
from kvwarden.models.make_model import make_model as _make


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("make-model", help="write a seeded random model (HF format) to a directory")
    p.add_argument("--arch", choices=ARCHS, required=True)
    p.add_argument("--preset", choices=PRESETS, default="tiny")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="output directory (created if missing)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    out = _make(args.arch, args.preset, args.seed, args.out)
    print(f"wrote {args.arch}/{args.preset} (seed {args.seed}) to {out}")
    return 0
