"""A tensor-parallel rank: ``python -m kvwarden.engine.tensor_parallel.worker --port P --rank R ...``.

Started by rank 0 (:mod:`.coordinator`), never by hand. It loads its slices of the same checkpoint through
the same loading code, keeps the KV cache of its heads in rank 0's slot layout, and runs each step rank 0
posts. It exits when told to stop, or when rank 0 ends (rank 0's store goes away; on Linux its death signal).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import traceback

import torch

from kvwarden.config import EngineConfig, resolve_device
from kvwarden.engine.context_parallel.group import RankGroup
from kvwarden.engine.context_parallel.messages import decode_setup
from kvwarden.engine.context_parallel.worker import IDLE_TIMEOUT_S, _delta, _die_with_parent
from kvwarden.engine.engine_parts import make_states
from kvwarden.engine.model_runner import ModelRunner
from kvwarden.engine.tensor_parallel.comm import GlooColumns
from kvwarden.engine.tensor_parallel.coordinator import run_step
from kvwarden.engine.tensor_parallel.messages import STOP, decode_step
from kvwarden.engine.tensor_parallel.state_journal import replay
from kvwarden.layers.backends import make_ops
from kvwarden.models.loader import load_for
from kvwarden.models.tensor_shard import TensorShard


def build_runner(config: EngineConfig, num_blocks: int, rank: int) -> ModelRunner:
    """This rank's slices of the model and a KV cache of rank 0's block count for its heads (eager)."""
    ops = make_ops(config.numerics, resolve_device(config.device))
    par = config.parallel
    shard = TensorShard(rank, par.tensor_parallel_size, par.enable_expert_parallel)
    loaded = load_for(config, ops, shard)
    specs = loaded.model.recurrent_specs()  # this rank's heads' states, in rank 0's slots (state_journal.py)
    states = make_states(config, ops, specs, num_blocks) if specs else None
    return ModelRunner(loaded.model, num_blocks, config.cache.block_size, config.numerics, states)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvwarden-tensor-parallel-worker")
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
        runner.model.shard.comm = GlooColumns(group)
        store.set_timeout(_delta(IDLE_TIMEOUT_S))
        step = 0
        while True:
            key = f"step{step}/{args.rank}"
            kind, entries, want, calls = decode_step(store.get(key))
            store.delete_key(key)
            step += 1
            if kind == STOP:
                break
            if runner.states is not None:
                replay(runner.states, calls)
            with torch.inference_mode():
                run_step(runner, entries, want)
        group.close()
        return 0
    except Exception:
        text = traceback.format_exc()
        if store is not None:
            with contextlib.suppress(Exception):  # rank 0 is gone: nobody to tell
                store.set(f"error{args.rank}", text.encode())
        print(f"kvwarden tensor-parallel rank {args.rank} (pid {os.getpid()}): {text}", flush=True)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
