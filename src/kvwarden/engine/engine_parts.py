"""The parts an engine is built from, once, from its config and model, in this order: the cache (the KV
block pool, the manager the scheduler sees - a hybrid one when the model has recurrent layers, their state
pool beside it), the model runner with its parallel ranks, and the host-memory tier under the pool."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvwarden.cache.block_pool import BlockPool
from kvwarden.cache.host_tier import HostTier, make_host_tier
from kvwarden.cache.hybrid_manager import HybridCacheManager
from kvwarden.cache.kv_cache_manager import KVCacheManager
from kvwarden.cache.state_pool import StatePool
from kvwarden.cache.state_spec import RecurrentLayerSpec
from kvwarden.config import EngineConfig
from kvwarden.engine.context_parallel import ContextParallel
from kvwarden.engine.context_parallel.layer_split import owned_layers
from kvwarden.engine.memory import check_scan_chunk, num_cache_blocks
from kvwarden.engine.model_runner import ModelRunner
from kvwarden.engine.tensor_parallel import TensorParallel
from kvwarden.engine.tensor_parallel.state_journal import StateJournal

if TYPE_CHECKING:
    from kvwarden.layers.numerics import Ops
    from kvwarden.models.loader import LoadedModel


@dataclass(frozen=True)
class EngineCache:
    """What :func:`build_cache` made: the pool's size, the pool, its manager and the recurrent states."""

    num_blocks: int
    pool: BlockPool
    kv: KVCacheManager | HybridCacheManager
    states: StatePool | None
    journal: StateJournal | None = None  # tensor parallelism: the state calls the workers replay

    @property
    def managed_states(self) -> StatePool | None:
        """What the engine's parts that change states (cache manager, speculation) talk to: the journal under
        tensor parallelism (every change replayed on the workers), else the pool itself."""
        return self.journal or self.states  # type: ignore[return-value]  # the journal passes reads through


def build_cache(config: EngineConfig, device: str, ops: Ops, loaded: LoadedModel) -> EngineCache:
    """The block pool sized from what the device has left after the weights, and its manager.

    Raises:
        ValueError: naming the setting when a recurrent model's scan chunk does not fit the block size,
            the step's token budget or the draft length (:func:`check_scan_chunk`).
    """
    cache, model = config.cache, loaded.model
    specs = model.recurrent_specs()
    drafts = config.speculative.num_speculative_tokens if config.speculative is not None else 0
    step_tokens = config.scheduler.max_num_batched_tokens
    check_scan_chunk(specs, ops.scan_mode, cache.block_size, config.numerics.scan_chunk, step_tokens, drafts)
    mtp_bytes = sum(t.numel() for t in loaded.mtp_weights.values()) * model.embed.element_size()
    num_blocks = cache.num_blocks or num_cache_blocks(config, device, loaded.config, model, mtp_bytes)
    pool = BlockPool(num_blocks, cache.enable_prefix_caching)
    kv: KVCacheManager | HybridCacheManager = KVCacheManager(pool, cache.block_size, cache.enable_prefix_caching)
    if not specs:
        return EngineCache(num_blocks, pool, kv, None)
    states = make_states(config, ops, specs, num_blocks)
    journal = StateJournal(states) if config.parallel.tensor_parallel else None
    hybrid = HybridCacheManager(kv, journal or states)  # type: ignore[arg-type]  # the journal passes reads through
    return EngineCache(num_blocks, pool, hybrid, states, journal)


def make_states(config: EngineConfig, ops: Ops, specs: list[RecurrentLayerSpec], num_blocks: int) -> StatePool:
    """The recurrent-state pool: a working slot per running request, a snapshot slot per KV block (a
    tensor-parallel worker makes its own, of its heads, with the same slots)."""
    pending = {"chunked": "chunked", "grid": "ring"}.get(ops.scan_mode, "none")
    seqs, chunk = config.scheduler.max_num_seqs, config.numerics.scan_chunk
    return StatePool(specs, seqs, num_blocks, chunk, ops.device, pending=pending)


def build_runner(
    config: EngineConfig, loaded: LoadedModel, parts: EngineCache, max_model_len: int
) -> tuple[ModelRunner, ContextParallel | TensorParallel | None]:
    """The model runner over the pool, then the context- or tensor-parallel ranks attached to it (after the
    runner: the workers copy its pool's size and slot layout)."""
    cache, par, spec = config.cache, config.parallel, config.speculative
    graph_mode = "off" if par.layer_split else config.cuda_graphs  # the split runs every step on all ranks
    runner = ModelRunner(
        loaded.model,
        parts.num_blocks,
        cache.block_size,
        config.numerics,
        parts.states,
        cache.unsafe_host_load,
        graphs=(graph_mode, max_model_len, config.scheduler.max_num_seqs),
        spec_tokens=spec.num_speculative_tokens if spec is not None else 0,
        owned_layers=owned_layers(0, par.context_parallel_size, loaded.model.num_attention_layers)
        if par.layer_split
        else None,
    )
    parallel: ContextParallel | TensorParallel | None = None
    if par.enabled:
        parallel = ContextParallel(config, runner, parts.num_blocks)
    elif par.tensor_parallel:
        parallel = TensorParallel(config, runner, parts.num_blocks, parts.journal)
    if parallel is not None:
        runner.attach_parallel(parallel)
    return runner, parallel


def attach_host_tier(
    config: EngineConfig, loaded: LoadedModel, runner: ModelRunner, parts: EngineCache
) -> HostTier | None:
    """The host-memory tier under the device pool when ``host_cache_bytes`` asks for one (after the runner:
    it copies the runner's KV tensors).

    Raises:
        ValueError: naming ``unsafe_indexer_load`` on a model without a sparse-attention indexer.
    """
    cache = config.cache
    if not cache.host_cache_bytes:
        return None
    if cache.unsafe_indexer_load and loaded.model.cfg.mla is None:
        raise ValueError("unsafe_indexer_load: the model has no sparse-attention indexer (GLM-5, DeepSeek)")
    host = make_host_tier(cache, runner.kv_caches, runner.device, parts.states)
    parts.kv.attach_host(host)
    return host
