"""How many bytes the KV pool (and the recurrent-state snapshots that live with its blocks) may take."""

from __future__ import annotations

from kvwarden.cache.state_pool import RecurrentLayerSpec, StatePool
from kvwarden.config import EngineConfig
from kvwarden.models.config import ModelConfig


def cache_budget(config: EngineConfig, device: str, cfg: ModelConfig, specs: list[RecurrentLayerSpec]) -> int:
    """Bytes for the KV pool.

    On the CPU: ``memory_bytes``. On a GPU, as vLLM does: the share
    ``gpu_memory_utilization`` of the device's memory, minus what is in use
    now (weights, other processes), minus the working states of
    ``max_num_seqs`` requests (twice: speculation checkpoints them) and an
    estimate of one step's activations.

    Raises:
        ValueError: naming ``gpu_memory_utilization`` when nothing is left.
    """
    if device != "cuda":
        return config.cache.memory_bytes
    import gc

    import torch

    gc.collect()  # an engine dropped just before this one still holds its pool in the allocator's cache
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    sched = config.scheduler
    working = sched.max_num_seqs * StatePool.snapshot_bytes(specs) * 2 if specs else 0
    width = max(cfg.hidden_size, cfg.intermediate_size, 1)
    # per token of the step: a few hidden-sized float32 buffers plus the widest projection, and the
    # sampled rows' float32 logits; doubled for allocator slack
    activations = 2 * sched.max_num_batched_tokens * 4 * (8 * cfg.hidden_size + 4 * width)
    activations += 2 * sched.max_num_seqs * 4 * cfg.vocab_size
    budget = int(total * config.cache.gpu_memory_utilization) - (total - free) - working - activations
    if budget <= 0:
        raise ValueError(
            f"gpu_memory_utilization: {config.cache.gpu_memory_utilization} leaves no memory for the KV "
            f"cache ({(total - free) / 2**30:.1f} GiB in use of {total / 2**30:.1f} GiB)"
        )
    return budget
