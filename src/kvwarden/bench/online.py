"""Online serving benchmark against any OpenAI-compatible URL (kvwarden, vLLM, SGLang, llama.cpp).

Clients arrive as a Poisson process at --request-rate (``inf``: all at once),
at most --max-concurrency in flight, each streaming a completion. Measures time
to first token (TTFT), inter-token latency (ITL, gaps between streamed chunks
that carry tokens), end-to-end latency and throughput; token counts come from
each response's ``usage``. The workloads (``kvwarden.bench.workloads``):

  documents      text slices of the bundled documents (any tokenizer; the default)
  nano-vllm      nano-vllm's bench: 256 prompts of 100-1024 random ids, 100-1024 output tokens
  shared-prefix  --groups system prompts of --prefix-len ids, each shared by --per-group requests
  multi-turn     --conversations chats of --turns text turns; each turn resends the history

    kvwarden serve builtin:llama-small --port 8000 &
    kvwarden bench online --url http://127.0.0.1:8000 --num-requests 32 --request-rate 4
    kvwarden bench online --url http://127.0.0.1:8000 --workload shared-prefix --groups 4 --per-group 8

Prints a table and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

import httpx

from kvwarden.bench import workloads
from kvwarden.bench.stats import latency_ms
from kvwarden.bench.stream_client import (
    StreamResult,
    completion_body,
    run_bounded,
    run_conversation,
    served_model,
    stream_completion,
)

WORKLOADS = ("documents", "nano-vllm", "shared-prefix", "multi-turn")


def requests(args: argparse.Namespace) -> list[workloads.Request]:
    if args.workload == "nano-vllm":
        return workloads.nano_vllm(args.num_requests, vocab=args.vocab)
    if args.workload == "shared-prefix":
        return workloads.shared_prefix(
            args.groups, args.per_group, args.prefix_len, args.suffix_len, args.max_output, args.vocab, args.seed
        )
    return workloads.documents(
        args.num_requests,
        (args.min_input_words, args.max_input_words),
        (args.min_output, args.max_output),
        args.seed,
    )


async def run(
    args: argparse.Namespace, given: list[workloads.Request] | None = None
) -> tuple[list[StreamResult], float]:
    """Every request (``given``, or ``--workload``'s) streamed; the results and the wall time."""
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.max_concurrency)
    async with httpx.AsyncClient(timeout=args.timeout, headers=headers, limits=limits) as client:
        model = args.model or await served_model(client, args.url)
        if args.workload == "multi-turn":
            convs = workloads.multi_turn(args.conversations, args.turns, args.turn_words, args.max_output, args.seed)

            async def chat(conv: workloads.Conversation) -> list[StreamResult]:
                return await run_conversation(client, args.url, model, conv)

            per_conv, wall = await run_bounded(convs, chat, args.max_concurrency, args.request_rate, args.seed + 1)
            return [r for conv in per_conv for r in conv], wall

        async def send(req: workloads.Request) -> StreamResult:
            return await stream_completion(client, args.url, completion_body(model, req.prompt, req.max_tokens))

        reqs = given if given is not None else requests(args)
        return await run_bounded(reqs, send, args.max_concurrency, args.request_rate, args.seed + 1)


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="model name (default: the first of /v1/models)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--workload", choices=WORKLOADS, default="documents")
    p.add_argument("--num-requests", type=int, default=32, help="documents and nano-vllm workloads")
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (inf = all at once)")
    p.add_argument("--max-concurrency", type=int, default=16)
    p.add_argument("--min-input-words", type=int, default=50)
    p.add_argument("--max-input-words", type=int, default=300)
    p.add_argument("--min-output", type=int, default=16)
    p.add_argument("--max-output", type=int, default=64, help="also the output of shared-prefix and multi-turn")
    p.add_argument("--vocab", type=int, default=1000, help="random ids are drawn below this (token-id workloads)")
    p.add_argument("--groups", type=int, default=4, help="shared-prefix: distinct prefixes")
    p.add_argument("--per-group", type=int, default=8, help="shared-prefix: requests per prefix")
    p.add_argument("--prefix-len", type=int, default=512, help="shared-prefix: prefix tokens")
    p.add_argument("--suffix-len", type=int, default=64, help="shared-prefix: tokens each request adds")
    p.add_argument("--conversations", type=int, default=8, help="multi-turn: chats")
    p.add_argument("--turns", type=int, default=4, help="multi-turn: user turns per chat")
    p.add_argument("--turn-words", type=int, default=80, help="multi-turn: words per user turn")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.request_rate <= 0:
        p.error("--request-rate must be > 0")
    if args.max_concurrency < 1:
        p.error("--max-concurrency must be >= 1")
    for low, high in (("min_input_words", "max_input_words"), ("min_output", "max_output")):
        if args.workload == "documents" and not 0 < getattr(args, low) <= getattr(args, high):
            flags = f"--{low.replace('_', '-')} {getattr(args, low)}, --{high.replace('_', '-')} {getattr(args, high)}"
            p.error(f"{flags}: need 0 < min <= max")
    args.url = args.url.rstrip("/")
    return args


def summarize(figures: dict[str, Any]) -> list[tuple[str, str]]:
    """One (label, value) pair per headline figure: requests, throughput, latencies, cached prompt tokens."""
    out = [
        ("completed of requests", f"{figures['completed']} of {figures['requests']}"),
        ("output tok/s, requests/s", f"{figures['output_tok_s']} {figures['request_throughput']}"),
    ]
    for key in ("ttft", "itl", "e2e"):
        lat = figures.get(key) or {}  # empty when no request completed
        out.append(
            (f"{key.upper()} ms (mean, p50, p99)", str(tuple(lat.get(k) for k in ("mean_ms", "p50_ms", "p99_ms"))))
        )
    out.append(("cached of prompt tokens", f"{figures['cached_tokens']} of {figures['prompt_tokens']}"))
    return out


def main() -> None:
    args = parse()
    samples, wall = asyncio.run(run(args))
    ok = [s for s in samples if s.ok]
    failed = [s for s in samples if not s.ok]
    ttft = [s.ttft for s in ok]
    itl = [x for s in ok for x in s.gaps]
    e2e = [s.e2e for s in ok]
    out_tokens = sum(s.output_tokens for s in ok)
    figures = {"ttft": latency_ms(ttft), "itl": latency_ms(itl), "e2e": latency_ms(e2e)}

    from rich.console import Console
    from rich.table import Table

    title = f"online benchmark: {args.url}, {args.workload} ({len(ok)}/{len(samples)} ok, {wall:.1f}s)"
    table = Table(title=title)
    for col in ("metric", "mean ms", "p50 ms", "p90 ms", "p99 ms"):
        table.add_column(col)
    for name, key in (("TTFT", "ttft"), ("ITL", "itl"), ("E2E", "e2e")):
        row = figures[key]
        table.add_row(name, *(f"{row.get(k, float('nan')):.1f}" for k in ("mean_ms", "p50_ms", "p90_ms", "p99_ms")))
    console = Console(file=sys.stderr, width=120)
    console.print(table)
    prompt_tokens, cached = sum(s.prompt_tokens for s in ok), sum(s.cached_tokens for s in ok)
    console.print(
        f"throughput: {len(ok) / wall:.2f} req/s, {out_tokens / wall:.1f} output tok/s; "
        f"prompt tokens {prompt_tokens}, cached {cached}"
    )
    for s in failed[:5]:
        console.print(f"[red]failed:[/red] {s.error}", highlight=False)
    print(
        json.dumps(
            {
                "benchmark": "online",
                "url": args.url,
                "workload": args.workload,
                "requests": len(samples),
                "completed": len(ok),
                "failed": len(failed),
                "request_rate": args.request_rate,
                "max_concurrency": args.max_concurrency,
                "duration_s": round(wall, 3),
                "request_throughput": round(len(ok) / wall, 3),
                "output_tok_s": round(out_tokens / wall, 2),
                "prompt_tokens": prompt_tokens,
                "cached_tokens": cached,
                **figures,
            }
        )
    )


if __name__ == "__main__":
    main()
