"""``kvwarden make-model``: write a seeded random checkpoint in Hugging Face format."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

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
    p.add_argument("--arch", choices=ARCHS, help="model family (a preset of kvwarden's)")
    p.add_argument(
        "--preset", choices=PRESETS, default="tiny", help="size: tiny (tests), small (CPU benchmarks), compat (vLLM)"
    )
    p.add_argument(
        "--config",
        metavar="FILE",
        help="instead of --arch: a published model's config.json (any supported family); random weights of its "
        "exact shapes",
    )
    p.add_argument("--num-layers", type=int, help="with --config: keep the first N layers (a hybrid keeps both kinds)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="with --config: weight dtype")
    p.add_argument(
        "--fp8",
        nargs="?",
        const="128,128",
        metavar="BN,BK",
        help="write an FP8 block-quantized checkpoint (float8_e4m3fn weights, a float32 weight_scale_inv per "
        "BN x BK block, quantization_config as Qwen3-*-FP8 and DeepSeek-V3 ship it; default blocks 128,128)",
    )
    p.add_argument("--seed", type=int, default=0, help="weights seed")
    p.add_argument("--out", required=True, help="output directory (created if missing)")
    p.add_argument(
        "--train-steps",
        type=int,
        metavar="N",
        help="then train the weights for N steps on the bundled text (2K tokens a step), so the model's "
        "continuations are learnable and a fitted drafter accepts like a real model's (a few hundred steps; "
        "a tiny preset takes about 0.5 s a step on 2 CPU cores, qwen3_next-small 400 steps 70 s with --device "
        "cuda on an H200)",
    )
    p.add_argument(
        "--device",
        default="cpu",
        help="torch device for --train-steps and for the target's continuations of --fit-mtp / --fit-draft "
        "(cpu, cuda; the drafters themselves are fitted on the CPU)",
    )
    p.add_argument(
        "--fit-mtp",
        action="store_true",
        help="then fit the model's MTP head (qwen3_next only) to its own greedy continuations of bundled text, "
        "so speculative decoding with method 'mtp' accepts drafts (minutes on CPU)",
    )
    p.add_argument(
        "--fit-draft",
        metavar="DIR",
        help="then distill a small Llama draft model sharing the tokenizer into DIR, for speculative decoding "
        "with method 'draft' (minutes on CPU)",
    )
    p.set_defaults(func=run, parser=p)


def run(args: argparse.Namespace) -> int:
    if args.config is not None:
        return _from_config(args)
    if args.arch is None:
        args.parser.error("--arch: required (or --config FILE for a published model's shapes)")
    if args.num_layers is not None:
        args.parser.error("--num-layers: only with --config")
    if args.fit_mtp and args.arch != "qwen3_next":
        args.parser.error(f"--fit-mtp: only qwen3_next checkpoints carry an MTP head, not --arch {args.arch}")
    from kvwarden.models.make_model import make_model

    if args.train_steps is not None and args.train_steps < 1:
        args.parser.error(f"--train-steps: must be >= 1, got {args.train_steps}")
    if args.device != "cpu" and not (args.train_steps or args.fit_mtp or args.fit_draft):
        args.parser.error("--device: only with --train-steps, --fit-mtp or --fit-draft")
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            args.parser.error(f"--device {args.device}: no CUDA device here")
    out = make_model(args.arch, args.preset, args.seed, args.out, _fp8_block(args))
    fp8 = f", FP8 blocks {args.fp8}" if args.fp8 else ""
    print(f"wrote {args.arch}/{args.preset} (seed {args.seed}{fp8}) to {out}")

    def say(msg: str) -> None:
        print(msg, flush=True)

    if args.train_steps is not None:
        _train(args, out, say)
    if not (args.fit_mtp or args.fit_draft):
        return 0
    from kvwarden.models.fit_draft import distillation_data, fit_draft_model, fit_mtp

    # One set of continuations serves both fits: generating them is much of the cost.
    start = time.perf_counter()
    data = distillation_data(out, args.seed, progress=say, tag="fit", device=args.device)
    say(f"[fit] {len(data.tokens)} continuations in {time.perf_counter() - start:.0f} s")
    results = {}
    if args.fit_mtp:
        results["MTP head"] = fit_mtp(out, args.seed, progress=say, data=data)
    if args.fit_draft:
        results[f"draft model {args.fit_draft}"] = fit_draft_model(
            out, args.fit_draft, args.seed, progress=say, data=data
        )
    for name, r in results.items():
        print(
            f"{name}: greedy agreement with the target on held-out continuations {r['heldout_accuracy']:.3f} "
            f"(before fitting {r['initial_heldout_accuracy']:.3f}, train {r['train_accuracy']:.3f}; "
            f"{r['steps']} steps, {r['seconds']:.0f} s)"
        )
    return 0


def _fp8_block(args: argparse.Namespace) -> tuple[int, int] | None:
    if args.fp8 is None:
        return None
    try:
        bn, bk = (int(v) for v in args.fp8.split(","))
    except ValueError:
        args.parser.error(f"--fp8: expected BN,BK (two block sizes, e.g. 128,128), got {args.fp8!r}")
    if bn < 1 or bk < 1:
        args.parser.error(f"--fp8: block sizes must be >= 1, got {args.fp8!r}")
    return bn, bk


def _train(args: argparse.Namespace, out: Path, say: Callable[[str], None]) -> None:
    from kvwarden.models.train_preset import train_preset

    r = train_preset(out, args.train_steps, args.seed, args.device, progress=say)
    print(
        f"trained {r['steps']} steps ({r['tokens']} tokens, {r['seconds']:.0f} s): held-out loss "
        f"{r['initial_heldout_loss']:.3f} -> {r['heldout_loss']:.3f} nats/token"
    )


def _from_config(args: argparse.Namespace) -> int:
    import json

    from kvwarden.models.make_model import make_model_from_config

    if args.arch is not None:
        args.parser.error("--config: replaces --arch (the family comes from the config's architectures)")
    if args.fit_mtp or args.fit_draft or args.train_steps is not None or args.device != "cpu":
        args.parser.error("--train-steps / --fit-mtp / --fit-draft / --device: only with --arch")
    if args.fp8:
        args.parser.error("--fp8: only with --arch (a --config with an fp8 quantization_config is written in FP8)")
    if args.num_layers is not None and args.num_layers < 1:
        args.parser.error(f"--num-layers: must be >= 1, got {args.num_layers}")
    path = Path(args.config)
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        args.parser.error(f"--config: cannot read {path}: {e}")
    try:
        out = make_model_from_config(config, args.out, args.seed, args.num_layers, args.dtype)
    except (ValueError, KeyError) as e:
        args.parser.error(f"--config: {path}: {e}")
    layers = json.loads((out / "config.json").read_text())["num_hidden_layers"]
    print(f"wrote {config.get('architectures', ['?'])[0]} from {path} ({layers} layers, seed {args.seed}) to {out}")
    return 0
