"""Online serving benchmark against any OpenAI-compatible URL (kvwarden, vLLM, llama.cpp).

Clients arrive as a Poisson process at --request-rate (``inf``: all at once),
at most --max-concurrency in flight, each streaming a completion. Measures time
to first token (TTFT), inter-token latency (ITL, gaps between streamed chunks
that carry tokens), end-to-end latency and throughput. Prompts are slices of the
bundled documents (text, so any tokenizer works); token counts come from each
response's ``usage``.

    kvwarden serve builtin:llama-small --port 8000 &
    python bench/online.py --url http://127.0.0.1:8000 --num-requests 32 --request-rate 4

Prints a table and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass, field

import httpx


@dataclass
class Sample:
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    error: str = ""


def prompts(args: argparse.Namespace) -> list[tuple[str, int]]:
    from kvwarden.models.bundled import documents

    rng = random.Random(args.seed)
    words = " ".join(d.text for d in documents()).split()
    out = []
    for _ in range(args.num_requests):
        n_words = rng.randint(args.min_input_words, args.max_input_words)
        start = rng.randrange(0, max(1, len(words) - n_words))
        out.append((" ".join(words[start : start + n_words]), rng.randint(args.min_output, args.max_output)))
    return out


async def one(client: httpx.AsyncClient, args: argparse.Namespace, model: str, prompt: str, max_tokens: int) -> Sample:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    start = time.perf_counter()
    sample = Sample(ok=False)
    last = None
    try:
        async with client.stream("POST", f"{args.url}/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                sample.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return sample
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                now = time.perf_counter()
                if chunk.get("usage"):
                    u = chunk["usage"]
                    sample.prompt_tokens = u.get("prompt_tokens", 0)
                    sample.output_tokens = u.get("completion_tokens", 0)
                    sample.cached_tokens = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0) or 0
                if any(c.get("text") for c in chunk.get("choices", [])):
                    if last is None:
                        sample.ttft = now - start
                    else:
                        sample.itl.append(now - last)
                    last = now
        sample.e2e = time.perf_counter() - start
        sample.ok = last is not None
    except httpx.HTTPError as exc:
        sample.error = f"{type(exc).__name__}: {exc}"
    return sample


async def run(args: argparse.Namespace) -> tuple[list[Sample], float]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.max_concurrency)
    async with httpx.AsyncClient(timeout=args.timeout, headers=headers, limits=limits) as client:
        model = args.model or (await client.get(f"{args.url}/v1/models")).json()["data"][0]["id"]
        work = prompts(args)
        rng = random.Random(args.seed + 1)
        gate = asyncio.Semaphore(args.max_concurrency)

        async def guarded(prompt: str, n: int) -> Sample:
            async with gate:
                return await one(client, args, model, prompt, n)

        tasks = []
        start = time.perf_counter()
        for prompt, n in work:
            tasks.append(asyncio.create_task(guarded(prompt, n)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        samples = await asyncio.gather(*tasks)
        return list(samples), time.perf_counter() - start


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q / 100 * len(values)))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="model name (default: the first of /v1/models)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (inf = all at once)")
    p.add_argument("--max-concurrency", type=int, default=16)
    p.add_argument("--min-input-words", type=int, default=50)
    p.add_argument("--max-input-words", type=int, default=300)
    p.add_argument("--min-output", type=int, default=16)
    p.add_argument("--max-output", type=int, default=64)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.request_rate <= 0:
        p.error("--request-rate must be > 0")
    samples, wall = asyncio.run(run(args))
    ok = [s for s in samples if s.ok]
    failed = [s for s in samples if not s.ok]
    ttft = [s.ttft for s in ok]
    itl = [x for s in ok for x in s.itl]
    e2e = [s.e2e for s in ok]
    out_tokens = sum(s.output_tokens for s in ok)

    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"online benchmark: {args.url} ({len(ok)}/{len(samples)} ok, {wall:.1f}s)")
    for col in ("metric", "mean ms", "p50 ms", "p90 ms", "p99 ms"):
        table.add_column(col)
    for name, values in (("TTFT", ttft), ("ITL", itl), ("E2E", e2e)):
        mean = statistics.fmean(values) if values else float("nan")
        table.add_row(name, *(f"{v * 1000:.1f}" for v in (mean, pct(values, 50), pct(values, 90), pct(values, 99))))
    console = Console(file=sys.stderr, width=120)
    console.print(table)
    console.print(
        f"throughput: {len(ok) / wall:.2f} req/s, {out_tokens / wall:.1f} output tok/s; "
        f"prompt tokens {sum(s.prompt_tokens for s in ok)}, cached {sum(s.cached_tokens for s in ok)}"
    )
    for s in failed[:5]:
        console.print(f"[red]failed:[/red] {s.error}")

    def stats(values: list[float]) -> dict[str, float]:
        if not values:
            return {}
        return {
            k: round(v * 1000, 2)
            for k, v in (
                ("mean_ms", statistics.fmean(values)),
                ("p50_ms", pct(values, 50)),
                ("p90_ms", pct(values, 90)),
                ("p99_ms", pct(values, 99)),
            )
        }

    print(
        json.dumps(
            {
                "benchmark": "online",
                "url": args.url,
                "requests": len(samples),
                "completed": len(ok),
                "failed": len(failed),
                "request_rate": args.request_rate,
                "max_concurrency": args.max_concurrency,
                "duration_s": round(wall, 3),
                "request_throughput": round(len(ok) / wall, 3),
                "output_tok_s": round(out_tokens / wall, 2),
                "ttft": stats(ttft),
                "itl": stats(itl),
                "e2e": stats(e2e),
            }
        )
    )


if __name__ == "__main__":
    main()
