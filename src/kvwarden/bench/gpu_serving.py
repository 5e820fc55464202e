"""kvwarden bench gpu's serving rows: ``kvwarden serve`` under load, and a workload whose prompts share prefixes.

* online (``--online``): one real ``kvwarden serve`` per engine (canonical, fast path) on loopback,
  driven by ``kvwarden bench online``'s client at concurrency 1, 16 and 64 on nano-vllm's workload shape
  (random ids, inputs and outputs uniform in [100, 1024]; ``2 x concurrency`` requests, at least 8):
  TTFT, TPOT (per request: the seconds after its first token over the tokens after it) and output tok/s;
* shared prefixes (``--shared-prefix``): offline ``generate`` over groups of requests sharing a long
  system prompt, against the same lengths with every prompt its own, prefix caching on in both: output
  tok/s and the share of prompt tokens served from the cache. Prefix caching should make the shared
  workload the faster one.

Each part runs in its own process (``kvwarden bench gpu`` starts it), so a server or an engine dies with it.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from typing import Any

from kvwarden.bench import workloads
from kvwarden.bench.floor import block_size_for, vocab_of
from kvwarden.bench.gpu_rows import NUMERICS, llm

CONCURRENCY = (1, 16, 64)


def online_rows(model: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """One server of ``args.engine``'s numerics; the client at each concurrency in turn."""
    import online  # kvwarden bench online: the client every online figure in the repository comes from

    from kvwarden.bench.launch import kvwarden_servers
    from kvwarden.probe.launchers import ServerSettings

    numerics = NUMERICS.get(args.engine, "canonical")
    settings = ServerSettings(numerics=numerics, device=args.device, dtype=args.dtype, block_size=block_size_for(model))
    lo, hi = (16, 48) if args.quick else (100, 1024)
    rows = []
    with kvwarden_servers(model, {args.engine: settings}) as servers:
        url = servers[args.engine].url
        for concurrency in CONCURRENCY[:2] if args.quick else CONCURRENCY:
            n = max(8, 2 * concurrency)
            reqs = workloads.uniform(n, (lo, hi), (lo, hi), min(vocab_of(model), 8192), seed=concurrency)
            ns = argparse.Namespace(
                url=url, model=None, api_key=None, workload="nano-vllm", max_concurrency=concurrency,
                request_rate=float("inf"), timeout=600.0, seed=0,
            )  # fmt: skip
            samples, wall = asyncio.run(online.run(ns, reqs))
            ok = [s for s in samples if s.ok]
            tpot = [s.itl_mean for s in ok if s.itl_mean is not None]
            rows.append(
                {
                    "model": model,
                    "engine": args.engine,
                    "concurrency": concurrency,
                    "requests": len(samples),
                    "failed": len(samples) - len(ok),
                    "output_tok_s": sum(s.output_tokens for s in ok) / wall,
                    "ttft_ms_mean": 1e3 * statistics.fmean(s.ttft for s in ok) if ok else None,
                    "ttft_ms_p90": 1e3 * _p90([s.ttft for s in ok]) if ok else None,
                    "tpot_ms_mean": 1e3 * statistics.fmean(tpot) if tpot else None,
                    "errors": sorted({s.error for s in samples if not s.ok})[:3],  # what failed, not only how many
                }
            )
    return rows


def _p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]


def shared_rows(model: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Offline: groups sharing a system prompt, then the same lengths unshared, in one engine."""
    from kvwarden import SamplingParams

    vocab = min(vocab_of(model), 8192)
    groups, per_group, prefix, suffix, out = (2, 4, 64, 16, 8) if args.quick else (4, 64, 2048, 64, 128)
    shared = workloads.shared_prefix(groups, per_group, prefix, suffix, out, vocab, seed=1)
    rng = random.Random(2)
    unshared = [workloads.Request([rng.randrange(vocab) for _ in r.prompt], out, "own") for r in shared]
    engine = llm(model, args, NUMERICS.get(args.engine, "canonical"), max_num_seqs=256)
    params = SamplingParams(temperature=0.0, max_tokens=out, ignore_eos=True)
    engine.generate([[1, 2, 3]], params)  # compiles every kernel first
    rows = []
    for name, reqs in (("unshared", unshared), ("shared", shared)):
        t = time.perf_counter()
        outs = engine.generate([list(r.prompt) for r in reqs], params)
        seconds = time.perf_counter() - t
        prompt_tokens = sum(len(r.prompt) for r in reqs)
        rows.append(
            {
                "model": model,
                "engine": args.engine,
                "workload": name,
                "requests": len(reqs),
                "output_tok_s": sum(len(o.token_ids) for o in outs) / seconds,
                "total_tok_s": (prompt_tokens + sum(len(o.token_ids) for o in outs)) / seconds,
                "cached_share": sum(o.num_cached_tokens for o in outs) / prompt_tokens,
                "seconds": seconds,
            }
        )
    return rows


def run_serving_part(args: argparse.Namespace) -> dict[str, Any]:
    if args.part == "online":
        return {"rows": online_rows(args.model, args)}
    return {"rows": shared_rows(args.model, args)}


def print_rows(result: dict[str, Any], console: Any) -> None:
    for r in result.get("online", []):
        console.print(
            f"  online {r['engine']:10s} c{r['concurrency']:<3d} {r['output_tok_s']:9.1f} tok/s, TTFT "
            f"{r['ttft_ms_mean'] or float('nan'):.1f} ms (p90 {r['ttft_ms_p90'] or float('nan'):.1f}), TPOT "
            f"{r['tpot_ms_mean'] or float('nan'):.2f} ms, {r['failed']} failed"
        )
        for error in r.get("errors", []):
            console.print(f"    failed: {error}", highlight=False)
    for r in result.get("shared", []):
        console.print(
            f"  shared-prefix {r['engine']:10s} {r['workload']:8s} {r['output_tok_s']:9.1f} output tok/s, "
            f"{r['total_tok_s']:9.0f} total tok/s, {r['cached_share']:.0%} of prompt tokens cached"
        )
