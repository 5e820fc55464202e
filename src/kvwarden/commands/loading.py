"""Loading a model for a command, with a sign of life: a spinner and elapsed time while loading
(SmolLM2's GGUF takes half a minute to dequantize on 2 cores), then one line saying what was loaded."""

from __future__ import annotations

import argparse
import time
from typing import TYPE_CHECKING

from rich.console import Console

if TYPE_CHECKING:
    from kvwarden.llm import LLM


def is_random_builtin(model: str) -> bool:
    """``builtin:`` models are made by ``make-model``: seeded random weights, meaningless text."""
    return model.startswith("builtin:")


def load_llm(args: argparse.Namespace, console: Console, who: str) -> LLM:
    """``LLM(args.model, **engine flags)``, narrated on ``console`` (use a stderr console for JSON output)."""
    from kvwarden.commands.engine_args import engine_kwargs
    from kvwarden.llm import LLM

    console.print(f"{who}: loading {args.model} ({args.dtype}, {args.numerics} numerics) ...", highlight=False)
    start = time.perf_counter()
    with console.status(f"loading {args.model}", spinner="dots"):
        llm = LLM(args.model, **engine_kwargs(args))
    engine = llm.engine
    cfg = engine.model_config
    params = engine.loaded.num_parameters
    console.print(
        f"{who}: loaded {cfg.architecture} ({params / 1e6:.1f}M parameters, {cfg.num_hidden_layers} layers) "
        f"in {time.perf_counter() - start:.1f} s; KV pool {engine.num_blocks} blocks of {args.block_size} tokens; "
        f"{engine.ops.kernels} kernels",
        highlight=False,
    )
    if is_random_builtin(args.model):
        console.print(
            f"{who}: note: {args.model} has seeded random weights (made by make-model): its text is "
            "meaningless; it exercises the engine, not a language model",
            highlight=False,
        )
    return llm
