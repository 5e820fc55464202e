"""The host tier: time to first token from each tier, the overlap of its loads, and a multi-turn workload.

1. TTFT of a request whose long prefix is served by recomputation (prefix
   caching off), from the device tier (the prefix is still in the device pool)
   and from the host tier (a filler as long as the prefix pushed it out of a
   device pool sized for one such prompt). The load alone (every layer's copy
   of those blocks, nothing computing) is timed too; ``hidden`` is the share of
   it the layer-wise loading hid behind compute:
   ``1 - (TTFT host - TTFT device) / load``.
2. A multi-turn workload: conversations whose histories add up to 4x the
   device pool, served turn by turn round-robin, host tier off and on.

    kvwarden bench host_tier                                   # CPU: llama-small, 1K-4K prefixes
    kvwarden bench host_tier --device cuda --dtype bfloat16 --model builtin:qwen3-0.6b --prefixes 4096,16384,32768

Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from typing import Any


@functools.cache
def corpus_ids(tokenizer: Any) -> tuple[int, ...]:
    """The bundled documents as token ids (encoded once per tokenizer)."""
    from kvwarden.models.bundled import documents

    return tuple(t for d in documents() for t in tokenizer.encode(d.text))


def token_stream(tokenizer: Any, n: int, offset: int) -> list[int]:
    """``n`` token ids of bundled text starting ``offset`` tokens in (wrapping around)."""
    ids = corpus_ids(tokenizer)
    out = []
    while len(out) < n:
        start = (offset + len(out)) % len(ids)
        out.extend(ids[start : start + n - len(out)])
    return out


def ttft(llm: Any, prompt: list[int]) -> float:
    from kvwarden import SamplingParams

    t0 = time.perf_counter()
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1))
    return time.perf_counter() - t0


def timed_load(llm: Any, num_blocks: int) -> float:
    """Seconds to copy ``num_blocks`` host blocks into device blocks for every layer, nothing else running."""
    host = llm.engine.host
    blocks = list(range(num_blocks))
    t0 = time.perf_counter()
    tickets = [host.copies.load(host.host.layers[i], blocks, host.kv.raw(i), blocks) for i in range(len(host.kv))]
    for t in tickets:
        t.synchronize()
    return time.perf_counter() - t0


def prefix_row(args: argparse.Namespace, length: int) -> dict[str, Any]:
    from kvwarden import LLM, SamplingParams

    bs = args.block_size
    common = {"device": args.device, "dtype": args.dtype, "block_size": bs, "max_num_batched_tokens": args.budget}
    llm_cold = LLM(args.model, enable_prefix_caching=False, **common)
    tok = llm_cold.tokenizer
    prefix = token_stream(tok, length, 0)
    filler = token_stream(tok, length + 64, 7919)
    prompt = prefix + token_stream(tok, 32, 4000)
    ttft(llm_cold, prompt)  # warm-up
    cold = min(ttft(llm_cold, prompt) for _ in range(args.repeats))
    block_bytes = per_block_bytes(llm_cold)
    del llm_cold
    # A device pool for one prompt of this length: the filler (64 tokens longer) evicts the whole prefix.
    num_blocks = (length + 64) // bs + 2
    host_bytes = 4 * num_blocks * block_bytes
    llm = LLM(args.model, num_blocks=num_blocks, host_cache_bytes=host_bytes, **common)
    device_times, host_times = [], []
    one = SamplingParams(temperature=0.0, max_tokens=1)
    for r in range(args.repeats):
        suffix = token_stream(tok, 32, 5000 + 97 * r)
        llm.generate([prefix + token_stream(tok, 32, 9000 + r)], one)  # cache the prefix on the device
        device_times.append(ttft(llm, prefix + suffix))
        llm.generate([filler], one)  # push it to the host tier
        before = llm.engine.stats()["prefix_cache_hits_host"]
        host_times.append(ttft(llm, prefix + token_stream(tok, 32, 6000 + 97 * r)))
        served = llm.engine.stats()["prefix_cache_hits_host"] - before
        assert served >= length - 4 * bs, f"only {served} of {length} prefix tokens came from the host tier"
    load = min(timed_load(llm, length // bs) for _ in range(args.repeats))
    device, host = min(device_times), min(host_times)
    hidden = max(0.0, min(1.0, 1.0 - (host - device) / load)) if load > 0 else 0.0
    return {"prefix": length, "recompute_s": cold, "device_s": device, "host_s": host, "load_s": load, "hidden": hidden}


def per_block_bytes(llm: Any) -> int:
    """Host bytes one KV block takes (every attention layer's K and V) for this engine."""
    from kvwarden.cache.host_pool import HostPool

    kv = llm.engine.runner.kv_caches
    return HostPool.bytes_per_block([kv.raw(i) for i in range(len(kv))], llm.engine.config.cache.block_size)


def multi_turn(args: argparse.Namespace, host_tier: bool) -> dict[str, Any]:
    from kvwarden import LLM, SamplingParams

    bs = args.block_size
    common = {"device": args.device, "dtype": args.dtype, "block_size": bs, "max_num_batched_tokens": args.budget}
    pool_tokens = args.turn_pool_tokens
    num_blocks = pool_tokens // bs
    llm = LLM(args.model, num_blocks=num_blocks, **common)
    if host_tier:  # the same engine settings, plus a host tier 8x the device pool
        host_bytes = 8 * num_blocks * per_block_bytes(llm)
        del llm
        llm = LLM(args.model, num_blocks=num_blocks, host_cache_bytes=host_bytes, **common)
    tok = llm.tokenizer
    turns, per_turn = args.turns, args.turn_tokens
    # Histories grow to per_turn * turns tokens; 4x the pool in all.
    convs = max(1, 4 * pool_tokens // (per_turn * turns))
    history = [token_stream(tok, per_turn, 1000 * c) for c in range(convs)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    t0 = time.perf_counter()
    computed = 0
    for turn in range(turns):
        for c in range(convs):
            out = llm.generate([history[c]], params)[0]
            computed += len(history[c]) - out.num_cached_tokens
            history[c] = history[c] + out.token_ids + token_stream(tok, per_turn, 50_000 + 1000 * c + 37 * turn)
    seconds = time.perf_counter() - t0
    stats = llm.engine.stats()
    return {
        "host_tier": host_tier,
        "conversations": convs,
        "turns": turns,
        "seconds": seconds,
        "turns_per_s": convs * turns / seconds,
        "prompt_tokens_recomputed": computed,
        "host_hit_tokens": stats.get("prefix_cache_hits_host", 0),
    }


def summarize(figures: dict[str, Any]) -> list[tuple[str, str]]:
    """One (label, value) pair per line of the GPU script's summary: TTFT by tier, multi-turn turns/s."""
    out = []
    if figures.get("ttft"):
        tiers = ("recompute_s", "device_s", "host_s")
        ttft = {r["prefix"]: tuple(round(r[k], 3) for k in tiers) for r in figures["ttft"]}
        out.append(("TTFT s (prefix: recompute/device/host)", str(ttft)))
    if figures.get("multi_turn"):
        turns = [round(r["turns_per_s"], 2) for r in figures["multi_turn"]]
        out.append(("multi-turn turns/s (off, on)", str(turns)))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="builtin:llama-small")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--budget", type=int, default=2048, help="max_num_batched_tokens")
    p.add_argument("--prefixes", default="1024,2048,3584", help="prefix lengths in tokens ('' skips the TTFT part)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--turn-tokens", type=int, default=128, help="user tokens added per turn")
    p.add_argument("--turn-pool-tokens", type=int, default=2048, help="device pool of the multi-turn run, in tokens")
    p.add_argument("--skip-turns", action="store_true")
    args = p.parse_args()

    from rich.console import Console
    from rich.table import Table

    console = Console(stderr=True)
    rows = []
    for length in (int(x) for x in args.prefixes.split(",") if x):
        console.print(f"[host tier bench] prefix {length} tokens ...")
        rows.append(prefix_row(args, length))
    table = Table(title=f"TTFT by tier ({args.model}, {args.device}, {args.dtype})")
    for col in ("prefix", "recompute s", "device tier s", "host tier s", "load alone s", "load hidden"):
        table.add_column(col, justify="right")
    for r in rows:
        cells = [f"{r[k]:.3f}" for k in ("recompute_s", "device_s", "host_s", "load_s")]
        table.add_row(str(r["prefix"]), *cells, f"{r['hidden']:.0%}")
    console.print(table)
    turns = []
    if not args.skip_turns:
        for on in (False, True):
            console.print(f"[host tier bench] multi-turn, host tier {'on' if on else 'off'} ...")
            turns.append(multi_turn(args, on))
        t = Table(title="multi-turn, working set 4x the device pool")
        for col in ("host tier", "conversations x turns", "seconds", "turns/s", "prompt tokens recomputed"):
            t.add_column(col, justify="right")
        for r in turns:
            t.add_row(
                "on" if r["host_tier"] else "off",
                f"{r['conversations']} x {r['turns']}",
                f"{r['seconds']:.2f}",
                f"{r['turns_per_s']:.2f}",
                str(r["prompt_tokens_recomputed"]),
            )
        console.print(t)
    print(
        json.dumps(
            {"bench": "host_tier", "model": args.model, "device": args.device, "ttft": rows, "multi_turn": turns}
        )
    )


if __name__ == "__main__":
    sys.exit(main())
