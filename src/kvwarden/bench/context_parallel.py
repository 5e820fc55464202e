"""Context parallelism: TTFT of long prompts at a 90 % prefix-cache hit rate, per-rank cache memory and
prefix-cache capacity, on one rank, two ranks holding full copies, and two ranks with the layer split.

The workload: one long shared prefix (``--hit`` of the prompt) warmed by a first request, then requests
whose prompts continue it with their own suffix (the rest), one at a time; TTFT is the time to the first
token of each. Every setting must answer bitwise as one rank (checked, printed).

    kvwarden bench context_parallel                                  # CPU: llama-small, 32K prompts, 2 ranks
    kvwarden bench context_parallel --model builtin:glm_moe_dsa-small --prompt-len 16384
    kvwarden bench context_parallel --device cuda --dtype bfloat16 --model builtin:qwen3-0.6b   # 2 GPUs

The presets stop at 4,096 positions; a copy with ``--max-positions`` (default 40,960) is made once under
``~/.cache/kvwarden/bench-models``, the weights seeded as the preset's. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any


def long_context_copy(model: str, max_positions: int) -> str:
    """``model`` (a ``builtin:`` name or a directory) with ``max_position_embeddings`` raised, made once."""
    from kvwarden.models.make_model import make_model_from_config
    from kvwarden.models.sources import resolve_model

    src = Path(resolve_model(model))
    cfg = json.loads((src / "config.json").read_text())
    if cfg.get("max_position_embeddings", 0) >= max_positions:
        return str(src)
    out = Path.home() / ".cache" / "kvwarden" / "bench-models" / f"{src.name}-{max_positions}"
    if not (out / "model.safetensors").is_file():
        make_model_from_config(cfg | {"max_position_embeddings": max_positions}, out, dtype=cfg.get("dtype", "float32"))
    return str(out)


def prompts(n: int, hit: float, requests: int, seed: int = 0) -> tuple[list[int], list[list[int]]]:
    """The shared prefix (``hit`` of ``n`` tokens) and ``requests`` prompts continuing it."""
    import random

    rng = random.Random(seed)
    shared = [rng.randrange(3, 1000) for _ in range(int(n * hit))]
    return shared, [shared + [rng.randrange(3, 1000) for _ in range(n - len(shared))] for _ in range(requests)]


def run_setting(model: str, args: argparse.Namespace, **parallel: Any) -> dict[str, Any]:
    from kvwarden import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)
    shared, asks = prompts(args.prompt_len, args.hit, args.requests)
    kw = {"device": args.device, "dtype": args.dtype, "max_num_batched_tokens": args.max_num_batched_tokens}
    with LLM(model, kv_cache_memory=args.kv_cache_mib << 20, **kw, **parallel) as llm:
        t0 = time.perf_counter()
        llm.generate([shared], params)
        cold = time.perf_counter() - t0
        ttfts, outs = [], []
        for p in asks:
            t0 = time.perf_counter()
            outs.append(llm.generate([p], params)[0])
            ttfts.append(time.perf_counter() - t0)
        stats = llm.engine.stats()
    return {
        "cold_prefix_s": cold,
        "ttft_warm_s": statistics.median(ttfts),
        "cached_share": statistics.mean(o.num_cached_tokens / len(o.prompt_token_ids) for o in outs),
        "kv_cache_bytes_per_rank": stats["kv_cache_bytes_per_rank"],
        "buffer_bytes": stats.get("layer_split_buffer_bytes", 0),
        "capacity_tokens": stats["prefix_cache_capacity_tokens"],
        "answers": [(o.token_ids, o.logprobs) for o in outs],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="builtin:llama-small")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=32768)
    p.add_argument("--hit", type=float, default=0.9, help="share of each prompt served from the prefix cache")
    p.add_argument("--requests", type=int, default=3, help="warm requests per setting (TTFT: their median)")
    p.add_argument("--max-positions", type=int, default=40960)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--kv-cache-mib", type=int, default=1024, help="KV memory per rank (same in every setting)")
    args = p.parse_args(argv)
    if args.prompt_len >= args.max_positions:
        p.error(f"--prompt-len {args.prompt_len} must be below --max-positions {args.max_positions}")
    model = long_context_copy(args.model, args.max_positions)
    n = args.ranks
    cp = {"context_parallel_size": n, "context_parallel_min_tokens": 256}
    settings = {"1 rank": {}, f"{n} ranks, full copies": cp, f"{n} ranks, layer split": cp | {"layer_split": True}}
    rows: dict[str, dict[str, Any]] = {}
    for name, parallel in settings.items():
        print(f" {name} ...", file=sys.stderr, flush=True)
        rows[name] = run_setting(model, args, **parallel)
    base = rows["1 rank"]
    print(f"\n{args.model}, {args.prompt_len} tokens, {args.hit:.0%} cached, {args.device} {args.dtype}\n")
    print("| setting | cold prefix s | warm TTFT s | vs 1 rank | KV MiB per rank | buffers MiB | capacity | bitwise |")
    print("|---|---|---|---|---|---|---|---|")
    out_rows = []
    for name, r in rows.items():
        same = r["answers"] == base["answers"]
        mib = "/".join(f"{b / 2**20:.0f}" for b in r["kv_cache_bytes_per_rank"])
        ratio = r["ttft_warm_s"] / base["ttft_warm_s"]
        print(
            f"| {name} | {r['cold_prefix_s']:.2f} | {r['ttft_warm_s']:.3f} | {ratio:.2f}x | {mib} | "
            f"{r['buffer_bytes'] / 2**20:.1f} | {r['capacity_tokens']} | {same} |"
        )
        out_rows.append({k: v for k, v in r.items() if k != "answers"} | {"setting": name, "bitwise_equal": same})
    split = rows[f"{n} ranks, layer split"]
    result = {
        "model": args.model,
        "prompt_len": args.prompt_len,
        "hit": args.hit,
        "rows": out_rows,
        "capacity_ratio_split": split["capacity_tokens"] / base["capacity_tokens"],
        "split_ttft_overhead": split["ttft_warm_s"] / rows[f"{n} ranks, full copies"]["ttft_warm_s"] - 1,
    }
    print(json.dumps(result))
    return 0 if all(r["bitwise_equal"] for r in out_rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
