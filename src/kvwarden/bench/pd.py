"""Disaggregated prefill/decode against one server: TTFT, inter-token latency, transfer time and bytes moved.

Starts three ``kvwarden serve`` processes of one model on 127.0.0.1 (free ports; ``probe.launchers``): a single server
(``--role both``), a prefill instance and a decode instance. One seeded mixed workload (half long prompts
with short outputs, half short prompts with long generations; random token ids, greedy, ``ignore_eos``)
streams ``/v1/completions`` at ``--concurrency`` against the single server, then against the decode
instance with ``kv_transfer_params.prefill_url`` naming the prefill instance. Per request: TTFT (send to
the first streamed token), ITL (the mean gap per token after the first: (last - first) / (tokens - 1)),
end to end. The decode instance's ``/pd/v1/stats`` before and after gives the transfers and KV bytes moved.

An "alone" phase then sends a few long prompts one at a time, each once to the single server and once
disaggregated (prompts not seen before by either, so no prefix-cache hit): the difference of their TTFTs
is the time disaggregation adds per request (the extra HTTP hop and the KV copy), beside its bytes.

Both runs' texts are compared request by request (same prompt, greedy: they should match); the result
is recorded as ``identical_text``, not asserted.

    kvwarden bench pd                     # CPU, builtin:llama-small, about 2 minutes on 2 cores
    kvwarden bench pd --quick             # smoke run, about 30 s
    kvwarden bench pd --device cuda --dtype bfloat16 --model builtin:qwen3-0.6b \\
        --long-prompt 4096,8192 --short-prompt 64,128 --long-output 512 --num-requests 64 --concurrency 16

On a machine of 2 CPU cores the three servers share those cores: the figures show the overhead of
disaggregation, not its benefit (that needs prefill and decode on separate accelerators). Run it on the
GPU machine for the real comparison.

Prints progress on stderr, a markdown table on stdout and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import time
from typing import Any

import httpx
from rich.console import Console

from kvwarden.bench import workloads
from kvwarden.bench.launch import kvwarden_servers
from kvwarden.bench.stats import fmt, ms, pct
from kvwarden.bench.stream_client import StreamResult, completion_body, run_bounded, served_model, stream_completion
from kvwarden.bench.workloads import Request, random_tokens
from kvwarden.probe.launchers import RunningServer, ServerSettings, log_tail

VOCAB = 1000  # random prompt ids are drawn from [3, VOCAB): every built-in model has at least this many
NOTE = (
    "2 CPU cores: these figures show the overhead of disaggregation (an extra HTTP hop, the KV copy over "
    "loopback TCP), not its benefit, which needs prefill and decode on separate accelerators."
)

console = Console(stderr=True, width=120)


# ------------------------------------------------------------------ requests
async def one(client: httpx.AsyncClient, url: str, model: str, req: Request, prefill_url: str | None) -> StreamResult:
    """Stream one completion, to ``url`` alone or with ``prefill_url`` computing its prompt."""
    extra = {"kv_transfer_params": {"prefill_url": prefill_url}} if prefill_url is not None else {}
    return await stream_completion(client, url, completion_body(model, req.prompt, req.max_tokens, **extra))


async def pd_stats(client: httpx.AsyncClient, url: str) -> dict[str, Any]:
    return (await client.get(f"{url}/pd/v1/stats")).json()


async def run_concurrent(
    client: httpx.AsyncClient, url: str, model: str, work: list[Request], concurrency: int, prefill_url: str | None
) -> tuple[list[StreamResult], float]:
    async def send(req: Request) -> StreamResult:
        return await one(client, url, model, req, prefill_url)

    return await run_bounded(work, send, concurrency)


# ------------------------------------------------------------------ figures
def summary(work: list[Request], samples: list[StreamResult], kind: str) -> dict[str, Any]:
    mine = [s for w, s in zip(work, samples, strict=True) if w.kind == kind]
    ok = [s for s in mine if s.ok]
    ttft = [s.ttft for s in ok]
    itl = [x for s in ok if (x := s.itl_mean) is not None]
    e2e = [s.e2e for s in ok]
    return {
        "requests": len(mine),
        "completed": len(ok),
        "ttft_p50_ms": ms(pct(ttft, 50)),
        "ttft_p90_ms": ms(pct(ttft, 90)),
        "itl_p50_ms": ms(pct(itl, 50)),
        "itl_p90_ms": ms(pct(itl, 90)),
        "e2e_p50_ms": ms(pct(e2e, 50)),
        "prompt_tokens": sum(s.prompt_tokens for s in ok),
        "output_tokens": sum(s.output_tokens for s in ok),
        "cached_tokens": sum(s.cached_tokens for s in ok),
    }


def stats_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, int]:
    return {k: int(after.get(k, 0)) - int(before.get(k, 0)) for k in ("orders", "done", "failed", "bytes")}


# ------------------------------------------------------------------ phases
async def warm_up(client: httpx.AsyncClient, srv: dict[str, RunningServer], model: str, rng: random.Random) -> None:
    """One small request each way, so neither side's first request pays one-time costs in the figures."""
    for url, prefill_url in ((srv["single"].url, None), (srv["decode"].url, srv["prefill"].url)):
        s = await one(client, url, model, Request(random_tokens(rng, 128, VOCAB), 4), prefill_url)
        if not s.ok:
            raise RuntimeError(f"warm-up request to {url} failed: {s.error}")


async def alone(
    client: httpx.AsyncClient, srv: dict[str, RunningServer], model: str, args: argparse.Namespace, rng: random.Random
) -> dict[str, Any]:
    """Long prompts one at a time, each to the single server and disaggregated: TTFT difference and bytes."""
    length = workloads.span(args.long_prompt)[1]
    pairs: list[dict[str, Any]] = []
    moved = 0
    for i in range(args.alone):
        # One prompt for both: they are different servers, and it is in neither's cache.
        work = Request(random_tokens(rng, length, VOCAB), 1, "alone")
        before = await pd_stats(client, srv["decode"].url)
        if i % 2 == 0:  # alternate which goes first, so drift does not favour one side
            single = await one(client, srv["single"].url, model, work, None)
            disagg = await one(client, srv["decode"].url, model, work, srv["prefill"].url)
        else:
            disagg = await one(client, srv["decode"].url, model, work, srv["prefill"].url)
            single = await one(client, srv["single"].url, model, work, None)
        delta = stats_delta(before, await pd_stats(client, srv["decode"].url))
        for name, s in (("single", single), ("disaggregated", disagg)):
            if not s.ok:
                raise RuntimeError(f"alone phase, request {i} ({name}) failed: {s.error}")
        moved += delta["bytes"]
        pairs.append(
            {
                "single_ttft_ms": ms(single.ttft),
                "disagg_ttft_ms": ms(disagg.ttft),
                "overhead_ms": ms(disagg.ttft - single.ttft),
                "bytes": delta["bytes"],
                "cached_tokens": single.cached_tokens + disagg.cached_tokens,
            }
        )
    overheads = [p["overhead_ms"] / 1000 for p in pairs]
    singles = [p["single_ttft_ms"] / 1000 for p in pairs]
    disaggs = [p["disagg_ttft_ms"] / 1000 for p in pairs]
    mean_overhead = statistics.fmean(overheads) if overheads else None
    per_request = moved / len(pairs) if pairs else 0
    rate = per_request / mean_overhead if mean_overhead and mean_overhead > 0 else None
    return {
        "prompt_tokens": length,
        "requests": len(pairs),
        "overhead_mean_ms": ms(mean_overhead),
        "overhead_p50_ms": ms(pct(overheads, 50)),
        "overhead_min_ms": ms(min(disaggs) - min(singles)) if pairs else None,  # fastest vs fastest
        "single_ttft_p50_ms": ms(pct(singles, 50)),
        "disagg_ttft_p50_ms": ms(pct(disaggs, 50)),
        "bytes_per_request": round(per_request),
        "bytes_per_overhead_s": None if rate is None else round(rate),
        "pairs": pairs,
    }


async def bench(args: argparse.Namespace, srv: dict[str, RunningServer]) -> dict[str, Any]:
    rng = random.Random(args.seed)
    work = workloads.mixed(
        args.num_requests,
        workloads.span(args.long_prompt),
        args.short_output,
        workloads.span(args.short_prompt),
        args.long_output,
        VOCAB,
        rng,
    )
    limits = httpx.Limits(max_connections=max(8, args.concurrency + 2))
    async with httpx.AsyncClient(timeout=args.timeout, limits=limits) as client:
        model = await served_model(client, srv["single"].url)
        await warm_up(client, srv, model, rng)
        console.print(f"[pd bench] single server: {len(work)} requests at concurrency {args.concurrency} ...")
        single, single_wall = await run_concurrent(client, srv["single"].url, model, work, args.concurrency, None)
        console.print(f"  {single_wall:.1f} s")
        console.print("[pd bench] disaggregated (decode instance, prefill instance computes prompts) ...")
        before = await pd_stats(client, srv["decode"].url)
        disagg, disagg_wall = await run_concurrent(
            client, srv["decode"].url, model, work, args.concurrency, srv["prefill"].url
        )
        moved = stats_delta(before, await pd_stats(client, srv["decode"].url))
        console.print(f"  {disagg_wall:.1f} s; transfers {moved['done']} done, {moved['failed']} failed")
        console.print(f"[pd bench] alone: {args.alone} long prompts one at a time, each way ...")
        alone_result = await alone(client, srv, model, args, rng)
    failures = [(i, "single", s.error) for i, s in enumerate(single) if not s.ok]
    failures += [(i, "disaggregated", s.error) for i, s in enumerate(disagg) if not s.ok]
    both_ok = [(a, b) for a, b in zip(single, disagg, strict=True) if a.ok and b.ok]
    differing = [i for i, (a, b) in enumerate(zip(single, disagg, strict=True)) if a.ok and b.ok and a.text != b.text]
    completed = sum(s.ok for s in disagg)
    return {
        "single": {
            "wall_s": round(single_wall, 3),
            **{k: summary(work, single, k) for k in ("long_prompt", "long_gen")},
        },
        "disaggregated": {
            "wall_s": round(disagg_wall, 3),
            **{k: summary(work, disagg, k) for k in ("long_prompt", "long_gen")},
            "transfers": moved["done"],
            "transfers_failed": moved["failed"],
            "orders": moved["orders"],
            "bytes": moved["bytes"],
            "bytes_per_request": round(moved["bytes"] / completed) if completed else None,
        },
        "alone": alone_result,
        "identical_text": bool(both_ok) and not differing and len(both_ok) == len(work),
        "compared": len(both_ok),
        "differing_requests": differing,
        "failures": [{"request": i, "run": run, "error": e} for i, run, e in failures],
    }


# ------------------------------------------------------------------ report
def table(result: dict[str, Any]) -> str:
    lines = [
        "| run | requests | n | TTFT p50 ms | TTFT p90 ms | ITL p50 ms | ITL p90 ms | E2E p50 ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for run in ("single", "disaggregated"):
        for kind, label in (("long_prompt", "long prompt, short output"), ("long_gen", "short prompt, long output")):
            r = result[run][kind]
            cells = [fmt(r[k]) for k in ("ttft_p50_ms", "ttft_p90_ms", "itl_p50_ms", "itl_p90_ms", "e2e_p50_ms")]
            lines.append(f"| {run} | {label} | {r['completed']}/{r['requests']} | " + " | ".join(cells) + " |")
    a, d = result["alone"], result["disaggregated"]
    rate = a["bytes_per_overhead_s"]
    lines += [
        "",
        "| figure | value |",
        "|---|---|",
        f"| wall s (single / disaggregated) | {result['single']['wall_s']:.1f} / {d['wall_s']:.1f} |",
        f"| transfers (done / failed) | {d['transfers']} / {d['transfers_failed']} |",
        f"| KV bytes moved per request (mixed run) | {d['bytes_per_request']} |",
        f"| alone: {a['requests']} prompts of {a['prompt_tokens']} tokens, TTFT p50 single / disaggregated ms "
        f"| {fmt(a['single_ttft_p50_ms'])} / {fmt(a['disagg_ttft_p50_ms'])} |",
        f"| alone: disaggregation overhead per request ms, mean / p50 / fastest-vs-fastest "
        f"| {fmt(a['overhead_mean_ms'])} / {fmt(a['overhead_p50_ms'])} / {fmt(a['overhead_min_ms'])} |",
        f"| alone: KV bytes per request | {a['bytes_per_request']} |",
        f"| alone: bytes / overhead s | {'-' if rate is None else f'{rate / 1e6:.1f} MB/s'} |",
        f"| identical text (single vs disaggregated) | {result['identical_text']} ({result['compared']} compared) |",
    ]
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="builtin:llama-small")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--num-requests", type=int, default=24, help="half long prompts, half long generations")
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight")
    p.add_argument("--long-prompt", default="512,1024", help="MIN,MAX prompt tokens of the long-prompt requests")
    p.add_argument("--short-output", type=int, default=16, help="output tokens of the long-prompt requests")
    p.add_argument("--short-prompt", default="32,64", help="MIN,MAX prompt tokens of the long-generation requests")
    p.add_argument("--long-output", type=int, default=128, help="output tokens of the long-generation requests")
    p.add_argument("--alone", type=int, default=6, help="long prompts (of the MAX length) sent one at a time, each way")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument(
        "--server-arg", action="append", default=[], help="extra argument for every server (repeatable, use =)"
    )
    p.add_argument("--quick", action="store_true", help="smoke run: 8 requests, shorter prompts and outputs")
    args = p.parse_args()
    if args.quick:
        args.num_requests, args.long_prompt, args.long_output, args.alone = 8, "256,512", 32, 2
    if args.num_requests < 2 or args.concurrency < 1 or args.alone < 0:
        p.error("--num-requests must be >= 2, --concurrency >= 1, --alone >= 0")
    for flag in ("long_prompt", "short_prompt"):
        try:
            workloads.span(getattr(args, flag))
        except ValueError as exc:
            p.error(f"--{flag.replace('_', '-')}: {exc}")
    return args


def summarize(figures: dict[str, Any]) -> list[tuple[str, str]]:
    """One (label, value) pair per line of the GPU script's summary: text and transfers; the alone phase."""
    d, alone = figures["disaggregated"], figures["alone"]
    return [
        (
            "identical text, transfers done/failed",
            f"{figures['identical_text']} {d['transfers']} {d['transfers_failed']}",
        ),
        ("alone overhead ms p50, bytes/request", f"{alone['overhead_p50_ms']} {alone['bytes_per_request']}"),
    ]


def main() -> None:
    args = parse_args()
    t0 = time.perf_counter()
    load_start = [round(x, 2) for x in os.getloadavg()]  # other work on the machine skews CPU figures
    roles = {"single": "both", "prefill": "prefill", "decode": "decode"}
    common = ("--disable-log-requests", *args.server_arg)
    settings = {
        name: ServerSettings(device=args.device, dtype=args.dtype, extra_args=("--role", role, *common))
        for name, role in roles.items()
    }
    console.print(f"[pd bench] starting single, prefill and decode servers of {args.model} ({args.device}) ...")
    with kvwarden_servers(args.model, settings) as srv:
        console.print("  " + ", ".join(f"{name} {s.url}" for name, s in srv.items()))
        try:
            result = asyncio.run(bench(args, srv))
        except Exception:
            for name, s in srv.items():
                console.print(f"[dim]--- {name} server log (last 20 lines) ---[/dim]")
                console.print(log_tail(s.log_path, 20), markup=False, highlight=False)
            raise
    for f in result["failures"][:5]:
        console.print(f"[red]failed:[/red] request {f['request']} ({f['run']}): {f['error']}", highlight=False)
    print(
        f"PD benchmark: {args.model} on {args.device} ({args.dtype}), {args.num_requests} requests, "
        f"concurrency {args.concurrency}, seed {args.seed}"
    )
    print(table(result))
    note = NOTE if args.device == "cpu" else None
    if note:
        print(note)
    wall = time.perf_counter() - t0
    keys = "model device dtype num_requests concurrency long_prompt short_output short_prompt long_output seed quick"
    settings = {k: getattr(args, k) for k in keys.split()} | {"alone_requests": args.alone}
    load = {"loadavg_start": load_start, "loadavg_end": [round(x, 2) for x in os.getloadavg()]}
    print(json.dumps({"bench": "pd", **settings, **result, "bench_wall_s": round(wall, 1), **load, "note": note}))


if __name__ == "__main__":
    main()
