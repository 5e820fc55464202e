"""A worker rank: ``python -m kvwarden.engine.context_parallel.worker --port P --rank R``.

Started by rank 0 (:mod:`.coordinator`), never by hand. It loads the same checkpoint through the same
loading code, keeps a full copy of the KV cache in rank 0's slot layout, and runs what rank 0 posts to
the shared store: its share of a split step, or the copy of a step rank 0 ran alone. It exits when told
to stop, or when rank 0's store goes away (rank 0 ended).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import ctypes.util
import datetime
import os
import signal
import traceback

import torch
import torch.distributed as dist

from kvwarden.config import EngineConfig, resolve_device
from kvwarden.engine.context_parallel.exchange import sync_rows
from kvwarden.engine.context_parallel.group import RankGroup, as_bytes
from kvwarden.engine.context_parallel.layer_split import LayerSplitKV, layer_split_kv, owned_layers
from kvwarden.engine.context_parallel.messages import FORWARD, STOP, decode_setup, decode_step
from kvwarden.engine.context_parallel.step import forward_share
from kvwarden.engine.model_runner import ModelRunner
from kvwarden.layers.backends import make_ops
from kvwarden.models.loader import load_for

# Rank 0 may idle for days between requests: a worker's wait for the next message has no useful bound.
IDLE_TIMEOUT_S = 365 * 24 * 3600.0


def build_runner(config: EngineConfig, num_blocks: int, rank: int) -> ModelRunner:
    """The model and a KV cache of rank 0's size, eager (no graphs: split steps run outside them)."""
    ops = make_ops(config.numerics, resolve_device(config.device))
    loaded = load_for(config, ops)
    par, layers = config.parallel, loaded.model.num_attention_layers
    owned = owned_layers(rank, par.context_parallel_size, layers) if par.layer_split else None
    return ModelRunner(loaded.model, num_blocks, config.cache.block_size, config.numerics, owned_layers=owned)


def serve(runner: ModelRunner, group: RankGroup, store: dist.Store, layers: LayerSplitKV | None) -> None:
    """Run rank 0's messages in order: ``("forward", entries, split)``, ``("sync", entries)``, ``("stop",)``."""
    step = 0
    while True:
        key = f"step{step}/{group.rank}"
        kind, entries, split = decode_step(store.get(key))
        store.delete_key(key)
        step += 1
        if kind == STOP:
            return
        with torch.inference_mode():
            if kind == FORWARD:
                hidden, counts = forward_share(runner, entries, group, split, layers)
                group.gather_rows(as_bytes(hidden), counts)
            else:
                sync_rows(runner, entries, group)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvwarden-context-parallel-worker")
    p.add_argument("--port", type=int, required=True, help="rank 0's store on 127.0.0.1")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--timeout", type=float, required=True, help="seconds a collective may wait for a peer")
    args = p.parse_args(argv)
    _die_with_parent()
    store = None
    try:
        store = RankGroup.connect_store(args.port, args.world, args.timeout)
        config, num_blocks, threads = decode_setup(store.get("config"))
        torch.set_num_threads(threads)
        runner = build_runner(config, num_blocks, args.rank)
        store.set(f"ready{args.rank}", b"1")
        group = RankGroup(store, args.rank, args.world, runner.device, args.timeout)
        layers = layer_split_kv(runner, store, args.rank, config) if config.parallel.layer_split else None
        store.set_timeout(_delta(IDLE_TIMEOUT_S))
        serve(runner, group, store, layers)
        group.close()
        return 0
    except Exception:
        text = traceback.format_exc()
        if store is not None:
            with contextlib.suppress(Exception):  # rank 0 is gone: nobody to tell
                store.set(f"error{args.rank}", text.encode())
        print(f"kvwarden context-parallel rank {args.rank} (pid {os.getpid()}): {text}", flush=True)
        return 1


def _die_with_parent() -> None:
    """SIGTERM this worker when rank 0's process ends, however it ends (Linux; elsewhere the store's
    closed connection ends the wait for the next message)."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() == 1:  # rank 0 ended before the line above ran
        raise SystemExit(1)


def _delta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


if __name__ == "__main__":
    raise SystemExit(main())
