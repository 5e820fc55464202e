"""``kvwarden predict``: which request pairs mix cache provenance under a scheduling rule."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvwarden.probe.predict import RULES, predict_pair, search_a_lengths


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "predict",
        help="simulate a scheduling rule + prefix cache and predict unstable / history-dependent pairs",
        description="Request A once, then request B repeated; A and B share their first SHARED tokens.",
        epilog="exit status: 0 every pair predicted stable, 1 some pair predicted UNSTABLE (as kvwarden probe's "
        "1 for an unstable arm), 2 bad flags",
    )
    p.add_argument(
        "--rule",
        choices=RULES,
        required=True,
        help="vllm-align: vLLM's hybrid align mode; vllm-align-fixed: its one-line fix; vllm: dense chunked prefill; "
        "kvwarden: kvwarden's own rule (states at every boundary, position-fixed numerics: no pair mixes provenance)",
    )
    p.add_argument(
        "--block-size",
        type=int,
        required=True,
        help="the engine's KV block size (vLLM raises it for hybrids: its log says 'Setting attention block size')",
    )
    p.add_argument(
        "--num-speculative-tokens",
        "--num-spec-tokens",  # the earlier spelling, kept
        dest="num_spec_tokens",
        type=int,
        default=0,
        help="draft tokens of the engine's speculation; > 0: the align rule pulls back one block",
    )
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="step budget (default: unlimited)")
    p.add_argument(
        "--pair", action="append", default=[], metavar="A_LEN:B_LEN:SHARED_LEN", help="lengths in tokens (repeatable)"
    )
    p.add_argument("--texts", action="append", default=[], metavar="A.txt:B.txt", help="texts instead of lengths")
    p.add_argument("--tokenizer", default=None, help="model whose tokenizer measures --texts")
    p.add_argument("--dense", action="store_true", help="model without recurrent layers (a hit needs no state)")
    p.add_argument("--repeats", type=int, default=3, help="runs of B after A")
    p.add_argument("--search", action="store_true", help="propose A lengths that flip the outcome")
    p.add_argument("--json", action="store_true", help="one JSON object per pair")
    p.set_defaults(func=run)


def _parse_pair(text: str) -> tuple[int, int, int]:
    try:
        a, b, s = (int(x) for x in text.split(":"))
    except ValueError as exc:
        raise ValueError(f"--pair {text!r}: expected A_LEN:B_LEN:SHARED_LEN (integers)") from exc
    return a, b, s


def _text_pair(spec: str, tokenizer_model: str | None) -> tuple[int, int, int]:
    from kvwarden.models.sources import resolve_model
    from kvwarden.models.tokenizer import Tokenizer

    if tokenizer_model is None:
        raise ValueError("--texts needs --tokenizer MODEL")
    try:
        a_path, b_path = spec.split(":")
    except ValueError as exc:
        raise ValueError(f"--texts {spec!r}: expected A.txt:B.txt") from exc
    path = resolve_model(tokenizer_model)
    if path.suffix == ".gguf":
        from kvwarden.models.loader import gguf_tokenizer

        tok = gguf_tokenizer(path)
    else:
        tok = Tokenizer.from_dir(path)
    a, b = (tok.encode(Path(f).read_text()) for f in (a_path, b_path))
    shared = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    return len(a), len(b), shared


def run(args: argparse.Namespace) -> int:
    if args.block_size < 1:
        raise ValueError("--block-size must be >= 1")
    pairs = [_parse_pair(p) for p in args.pair] + [_text_pair(t, args.tokenizer) for t in args.texts]
    if not pairs:
        raise ValueError("give at least one --pair A_LEN:B_LEN:SHARED_LEN (or --texts A.txt:B.txt)")
    if not args.json:
        print(
            f"assuming block size {args.block_size} (given by --block-size; an engine may use another: "
            "`kvwarden probe` reads the one a server really uses) and step budget "
            f"{args.max_num_batched_tokens or 'unlimited'}"
        )
    unstable = False
    for a_len, b_len, shared in pairs:
        pred = predict_pair(
            args.rule,
            args.block_size,
            a_len,
            b_len,
            shared,
            args.num_spec_tokens,
            args.max_num_batched_tokens,
            args.repeats,
            hybrid=not args.dense,
        )
        out = pred.to_dict()
        unstable = unstable or not pred.repeats_stable
        if args.search:
            flips = _search(args, b_len, shared)
            out["search"] = [
                {"a_from": f, "a_to": t, "repeats_stable": s, "history_dependent": h} for f, t, s, h in flips
            ]
        if args.json:
            out["block_size_source"] = "--block-size"
            print(json.dumps(out))
            continue
        verdict = "stable" if pred.repeats_stable else "UNSTABLE"
        history = "history-dependent" if pred.history_dependent else "history-independent"
        setup = f"{args.rule}, block {args.block_size}, spec {args.num_spec_tokens}"
        print(f"A={a_len} B={b_len} shared={shared} ({setup}): {verdict}, {history}")
        print(f"  A saved state at shared boundaries: {pred.a_saved_state_at or '(none: shared < block)'}")
        print(f"  B cached tokens per run after A: {pred.b_cached_tokens}; alone: {pred.clean_cached_tokens}")
        print(f"  {pred.explanation}")
        for flip in out.get("search", []):
            print(
                f"  A in [{flip['a_from']}, {flip['a_to']}]: "
                f"{'stable' if flip['repeats_stable'] else 'UNSTABLE'}, "
                f"{'history-dependent' if flip['history_dependent'] else 'history-independent'}"
            )
    return 1 if unstable else 0


def _search(args: argparse.Namespace, b_len: int, shared: int) -> list[tuple[int, int, bool, bool]]:
    """The A-length search with a progress bar on stderr (it simulates the scheduler once per A length)."""
    from rich.console import Console
    from rich.progress import Progress

    lo, hi = max(shared, 1), shared + 3 * args.block_size
    with Progress(console=Console(stderr=True), transient=True, disable=args.json) as bar:
        task = bar.add_task(f"searching A lengths {lo}..{hi} (B={b_len}, shared={shared})", total=hi - lo + 1)

        def advance(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        return search_a_lengths(
            args.rule, args.block_size, b_len, shared, args.num_spec_tokens, args.max_num_batched_tokens,
            progress=advance,
        )  # fmt: skip
