"""An engine's counters and gauges in one dict (``LLMEngine.stats``: ``/metrics``, the probe, disaggregation).

Read-only over the engine's parts; the names follow vLLM's metrics where one exists.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from kvwarden.engine.context_parallel import ContextParallel
from kvwarden.engine.spec_stats import SpecStats

if TYPE_CHECKING:
    from kvwarden.cache.block_pool import BlockPool
    from kvwarden.cache.host_tier import HostTier
    from kvwarden.cache.hybrid_manager import HybridCacheManager
    from kvwarden.cache.kv_cache_manager import KVCacheManager
    from kvwarden.cache.state_pool import StatePool
    from kvwarden.config import EngineConfig
    from kvwarden.engine.model_runner import ModelRunner
    from kvwarden.engine.overlap import Overlap
    from kvwarden.engine.remote_kv import RemoteKV
    from kvwarden.engine.scheduler import Scheduler
    from kvwarden.engine.spec.speculator import Speculator


class EngineParts(Protocol):
    """What the figures are read from (an ``LLMEngine``)."""

    config: EngineConfig
    num_blocks: int
    pool: BlockPool
    kv: KVCacheManager | HybridCacheManager
    states: StatePool | None
    scheduler: Scheduler
    runner: ModelRunner
    remote: RemoteKV
    speculator: Speculator | None
    overlap: Overlap | None
    parallel: ContextParallel | None
    host: HostTier | None
    num_steps: int
    prompt_tokens_total: int
    generation_tokens_total: int


def engine_stats(engine: EngineParts) -> dict[str, Any]:
    """Pool, cache, scheduler, speculation, async-scheduling and parallelism figures of ``engine`` now."""
    states = engine.states
    spec = engine.speculator.totals if engine.speculator is not None else SpecStats()
    overlap = engine.overlap
    parallel = engine.parallel
    return {
        "state_slots_free": states.num_free_working if states else 0,
        "state_snapshots": states.num_snapshots if states else 0,
        "num_blocks": engine.num_blocks,
        "kv_cache_bytes": engine.runner.kv_caches.nbytes,
        "prefix_cache_capacity_tokens": engine.num_blocks * engine.config.cache.block_size,
        "free_blocks": engine.pool.num_free_blocks,
        "cached_blocks": engine.pool.num_cached_blocks,
        "running": len(engine.scheduler.running),
        "waiting": len(engine.scheduler.waiting),
        "remote_waiting": len(engine.scheduler.remote),
        "detached_blocks": engine.remote.detached_blocks(),
        "prefix_cache_queries": engine.kv.query_tokens,
        "prefix_cache_hits": engine.kv.hit_tokens,
        "preemptions": engine.scheduler.num_preemptions,
        "evictions": engine.pool.evictions,
        "steps": engine.num_steps,
        "steps_launched_ahead": overlap.launched if overlap is not None else 0,
        "ahead_rows_dropped": overlap.dropped_rows if overlap is not None else 0,
        "prompt_tokens": engine.prompt_tokens_total,
        "generation_tokens": engine.generation_tokens_total,
        "spec_num_drafts": spec.num_drafts,
        "spec_num_draft_tokens": spec.num_draft_tokens,
        "spec_num_accepted_tokens": spec.num_accepted_tokens,
        "spec_accepted_per_position": list(spec.accepted_per_position),
        **(parallel.stats() if parallel is not None else ContextParallel.single_rank_stats(engine.runner)),
        **(engine.host.stats() if engine.host is not None else {}),
    }
