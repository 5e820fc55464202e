"""What rank 0 tells the workers through the store, as JSON (never pickle: see group.py's NOTE)."""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any

from kvwarden.config import CacheConfig, EngineConfig, NumericsConfig, ParallelConfig
from kvwarden.engine.model_runner import BatchEntry

FORWARD, SYNC, STOP = "forward", "sync", "stop"


def encode_step(kind: str, entries: list[BatchEntry] | None = None, split: bool = False) -> bytes:
    rows = [[e.request_id, e.token_ids, e.start, e.block_ids] for e in entries or []]
    return json.dumps({"kind": kind, "entries": rows, "split": split}).encode()


def decode_step(data: bytes) -> tuple[str, list[BatchEntry], bool]:
    msg = json.loads(data)
    entries = [
        BatchEntry(str(r), [int(t) for t in ids], int(s), [int(b) for b in blocks])
        for r, ids, s, blocks in msg["entries"]
    ]
    return msg["kind"], entries, bool(msg["split"])


def encode_setup(config: EngineConfig, num_blocks: int, threads: int) -> bytes:
    """The part of the engine's configuration a worker's runner is built from."""
    setup: dict[str, Any] = {
        "model": config.model,
        "dtype": config.dtype,
        "load_format": config.load_format,
        "seed": config.seed,
        "max_model_len": config.max_model_len,
        "device": config.device,
        "block_size": config.cache.block_size,
        "numerics": asdict(config.numerics),
        "parallel": asdict(config.parallel),
        "num_blocks": num_blocks,
        "threads": threads,
    }
    return json.dumps(setup).encode()


def decode_setup(data: bytes) -> tuple[EngineConfig, int, int]:
    """``(config, num_blocks, threads)`` as the worker needs them (the frozen configs re-validate)."""
    s = json.loads(data)
    config = EngineConfig(
        model=s["model"],
        dtype=s["dtype"],
        load_format=s["load_format"],
        seed=s["seed"],
        max_model_len=s["max_model_len"],
        device=s["device"],
        cache=CacheConfig(block_size=s["block_size"]),
        numerics=NumericsConfig(**s["numerics"]),
        parallel=ParallelConfig(**s["parallel"]),
    )
    return config, int(s["num_blocks"]), int(s["threads"])
