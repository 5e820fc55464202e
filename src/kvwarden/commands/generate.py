"""``kvwarden generate``: one-off generation from the command line.

Plain output prints each completion and, with ``--logprobs K``, a table of the
top-K candidates of every generated token; ``--json`` prints one object per
completion with token ids, token texts and the top-K lists.
"""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table

from kvwarden.commands.engine_args import add_engine_args
from kvwarden.console import wide_console

if TYPE_CHECKING:
    from kvwarden.engine.outputs import RequestOutput
    from kvwarden.models.tokenizer import Tokenizer


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate for prompts given on the command line")
    add_engine_args(p)
    p.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for a batch)")
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens to generate per prompt")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    p.add_argument("--top-k", type=int, default=0, help="sample among the K most likely tokens (0: all)")
    p.add_argument("--sampling-seed", type=int, default=None, help="seed of a sampling request (default: engine's)")
    p.add_argument("--logprobs", type=int, default=None, help="show the top-K logprobs of every token (K <= 20)")
    p.add_argument("--json", action="store_true", help="one JSON object per output on stdout")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvwarden.commands.loading import load_llm
    from kvwarden.engine.sampling_params import SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.sampling_seed,
        logprobs=args.logprobs,
    )
    out_console = wide_console(highlight=False)
    llm = load_llm(args, Console(stderr=True, highlight=False, soft_wrap=True), "kvwarden generate")
    prompts = args.prompt
    if args.chat:
        prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    for i, out in enumerate(llm.generate(prompts, params)):
        if args.json:
            print(json.dumps(to_json(out, llm.tokenizer)))
            continue
        out_console.print(out.text, markup=False)
        if out.logprobs is not None:
            out_console.print(logprob_table(out, llm.tokenizer, f"prompt {i + 1}: top-{args.logprobs} per token"))
    return 0


def _text(tokenizer: Tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def to_json(out: RequestOutput, tokenizer: Tokenizer) -> dict[str, Any]:
    """One completion as JSON: ids and texts of the tokens, and the top-K lists with token text."""
    logprobs = None
    if out.logprobs is not None:
        logprobs = [
            [{"token_id": t, "token": _text(tokenizer, t), "logprob": lp} for t, lp in top] for top in out.logprobs
        ]
    return {
        "text": out.text,
        "token_ids": out.token_ids,
        "tokens": [_text(tokenizer, t) for t in out.token_ids],
        "logprobs": logprobs,
        "num_cached_tokens": out.num_cached_tokens,
        "finish_reason": out.finish_reason,
    }


def logprob_table(out: RequestOutput, tokenizer: Tokenizer, title: str) -> Table:
    """A compact table: position, chosen token and its logprob, then the top candidates."""
    table = Table(title=title, title_justify="left", show_edge=False, pad_edge=False)
    table.add_column("#", justify="right")
    table.add_column("token")
    table.add_column("logprob", justify="right")
    table.add_column("top candidates (logprob)")
    rows = zip(out.token_ids, out.sampled_logprobs, out.logprobs or [], strict=False)
    for pos, (token, logprob, top) in enumerate(rows):
        candidates = "  ".join(f"{_text(tokenizer, t)!r} {lp:.3f}" for t, lp in top)
        table.add_row(str(pos), repr(_text(tokenizer, token)), f"{logprob:.4f}", candidates)
    return table
