"""Hybrid-model benchmark: prefill throughput, warm vs cold TTFT, snapshot memory, chunking rules.

On a small hybrid model (default ``builtin:qwen3_next-small``):

1. cold prefill throughput at six prompt lengths (one request, caching off);
2. time to first token on a long shared prefix, cold vs warm (another request
   with the same prefix ran before);
3. memory per KV block: KV bytes and recurrent-state snapshot bytes;
4. scheduling rules on a multi-block prompt under a token budget: kvwarden's
   (chunks as large as the budget allows, a state captured at every boundary
   inside the chunk) vs vLLM's align rule and its one-line fix (chunks cut at
   block boundaries): scheduler steps and prefill tok/s.

Prints tables and ends with one JSON line.

    kvwarden bench hybrid [--model builtin:granite_hybrid-small] [--quick]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from typing import Any

from rich.console import Console
from rich.table import Table

from kvwarden import LLM, SamplingParams
from kvwarden.bench.workloads import random_tokens
from kvwarden.cache.state_pool import StatePool
from kvwarden.engine.model_runner import kv_bytes_per_block

ONE = SamplingParams(temperature=0.0, max_tokens=1)


def prefill_seconds(llm: LLM, prompt: list[int]) -> tuple[float, int]:
    """Seconds to the first token, and the engine steps it took."""
    steps = llm.engine.num_steps
    start = time.perf_counter()
    llm.generate([prompt], ONE)
    return time.perf_counter() - start, llm.engine.num_steps - steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="builtin:qwen3_next-small")
    p.add_argument("--lengths", type=int, nargs=6, default=[64, 128, 256, 512, 1024, 2048])
    p.add_argument("--prefix", type=int, default=1536, help="shared prefix for the TTFT test")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--budget", type=int, default=512, help="max_num_batched_tokens for the rule comparison")
    p.add_argument("--rule-prompt", type=int, default=1500)
    p.add_argument("--quick", action="store_true", help="small sizes, to check the script runs")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.quick:
        args.lengths, args.prefix, args.rule_prompt, args.budget = [16, 32, 48, 64, 80, 96], 96, 150, 64
    rng = random.Random(args.seed)
    console = Console(file=sys.stderr, width=140)
    result: dict[str, Any] = {"benchmark": "hybrid", "model": args.model, "block_size": args.block_size}

    # 1. cold prefill throughput
    cold = LLM(args.model, enable_prefix_caching=False, block_size=args.block_size, max_num_batched_tokens=4096)
    cold.generate([random_tokens(rng, 32, 1000)], ONE)  # warm-up
    table = Table(title=f"cold prefill, {args.model} (canonical numerics)")
    for col in ("prompt tokens", "seconds", "prefill tok/s"):
        table.add_column(col)
    rows = []
    for n in args.lengths:
        seconds, _ = prefill_seconds(cold, random_tokens(rng, n, 1000))
        rows.append({"tokens": n, "seconds": round(seconds, 4), "tok_s": round(n / seconds, 1)})
        table.add_row(str(n), f"{seconds:.3f}", f"{n / seconds:.1f}")
    console.print(table)
    result["prefill"] = rows

    # 2. warm vs cold TTFT on a shared prefix
    prefix = random_tokens(rng, args.prefix, 1000)
    llm = LLM(args.model, block_size=args.block_size, max_num_batched_tokens=4096)
    t_cold, _ = prefill_seconds(llm, prefix + random_tokens(rng, 24, 1000))
    t_warm, _ = prefill_seconds(llm, prefix + random_tokens(rng, 24, 1000))
    warm_out = llm.generate([prefix + random_tokens(rng, 24, 1000)], ONE)[0]
    table = Table(title=f"time to first token, {args.prefix}-token shared prefix")
    for col in ("run", "TTFT s", "cached tokens"):
        table.add_column(col)
    table.add_row("cold", f"{t_cold:.3f}", "0")
    table.add_row("warm (prefix cached)", f"{t_warm:.3f}", str(warm_out.num_cached_tokens))
    console.print(table)
    result["ttft"] = {"cold_s": round(t_cold, 4), "warm_s": round(t_warm, 4), "speedup": round(t_cold / t_warm, 2)}

    # 3. memory per block
    model = llm.engine.loaded.model
    kv = kv_bytes_per_block(model, args.block_size)
    snap = StatePool.snapshot_bytes(model.recurrent_specs())
    table = Table(title=f"memory per block of {args.block_size} tokens")
    for col in ("KV bytes", "state snapshot bytes", "snapshot share"):
        table.add_column(col)
    table.add_row(str(kv), str(snap), f"{snap / (kv + snap):.1%}")
    console.print(table)
    result["memory_per_block"] = {"kv_bytes": kv, "snapshot_bytes": snap}

    # 4. chunking rules
    prompt = random_tokens(rng, args.rule_prompt, 1000)
    table = Table(title=f"{args.rule_prompt}-token prompt, budget {args.budget}, block {args.block_size}")
    for col in ("rule", "numerics", "scheduler steps", "prefill s", "prefill tok/s", "states captured"):
        table.add_column(col)
    rules = []
    for rule, numerics in (
        ("kvwarden", "canonical"),
        ("legacy-align", "shape-dependent"),
        ("legacy-align-fixed", "shape-dependent"),
        ("legacy-align-fixed", "canonical"),
    ):
        eng = LLM(
            args.model,
            block_size=args.block_size,
            max_num_batched_tokens=args.budget,
            chunking=rule,
            numerics=numerics,
            speculative_config={"method": "ngram", "num_speculative_tokens": 1},
        )
        eng.generate([random_tokens(rng, 16, 1000)], ONE)  # warm-up
        seconds, steps = prefill_seconds(eng, prompt)
        captured = eng.engine.states.num_snapshots if eng.engine.states else 0
        rules.append(
            {"rule": rule, "numerics": numerics, "steps": steps, "seconds": round(seconds, 4), "states": captured}
        )
        table.add_row(rule, numerics, str(steps), f"{seconds:.3f}", f"{len(prompt) / seconds:.1f}", str(captured))
    console.print(table)
    result["rules"] = rules
    print(json.dumps(result))


if __name__ == "__main__":
    main()
