"""``kvwarden trace-divergence``: where two runs of the same tokens first differ, bit for bit."""

from __future__ import annotations

import argparse
import json

from kvwarden.config import CHUNKING_RULES, NUMERICS_MODES


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "trace-divergence",
        help="trace activations of the contamination scenario and report the first bitwise difference",
        description=(
            "Runs request A once and request B twice on one engine (the contamination scenario of "
            "docs/production-story.md §1, at a chosen scale), traces every activation, and reports where B's "
            "two runs first differ and which operation makes A's prefill of the shared tokens differ from B's own."
        ),
    )
    p.add_argument("model", help="model dir, 'builtin:<arch>-<preset>' (a hybrid shows the production bug)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--a-len", type=int, default=28, help="tokens of request A (just below 2 blocks)")
    p.add_argument("--b-len", type=int, default=44, help="tokens of request B (longer than A)")
    p.add_argument("--shared", type=int, default=24, help="tokens A and B share at the start (>= 1 block)")
    p.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=1,
        help="draft tokens of n-gram speculation (0: off); speculation on is what makes the legacy rule pull back",
    )
    p.add_argument("--chunking", choices=CHUNKING_RULES, default="legacy-align", help="prefill chunking rule")
    p.add_argument(
        "--numerics", choices=NUMERICS_MODES, default="shape-dependent", help="kernels: vendor-style or canonical"
    )
    p.add_argument("--max-tokens", type=int, default=4, help="tokens each request generates")
    p.add_argument("--seed", type=int, default=0, help="engine seed")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvwarden.models.sources import resolve_model
    from kvwarden.probe.divergence import contamination_study, describe

    for flag in ("block_size", "a_len", "b_len", "max_tokens"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1")
    report = contamination_study(
        resolve_model(args.model),
        block_size=args.block_size,
        a_len=args.a_len,
        b_len=args.b_len,
        shared=args.shared,
        num_speculative_tokens=args.num_speculative_tokens,
        chunking=args.chunking,
        numerics=args.numerics,
        max_tokens=args.max_tokens,
        seed=args.seed,
    )
    if args.json:
        print(json.dumps(report))
    else:
        print("\n".join(describe(report)))
    return 0
