"""Prometheus metrics for ``GET /metrics``.

Engine counters are snapshotted by the engine thread after every step and
exported at scrape time; latency histograms are observed as tokens are
delivered. Names follow vLLM's (``kvwarden:`` instead of ``vllm:``) so
dashboards and the probe read both the same way. One registry per server, no
module-level state.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvwarden.engine.llm_engine import LLMEngine
from kvwarden.engine.outputs import RequestOutput

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)

_COUNTERS = {
    "prefix_cache_queries": ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache"),
    "prompt_tokens": ("prompt_tokens", "Prompt tokens of requests that produced a first token"),
    "generation_tokens": ("generation_tokens", "Generated tokens"),
    "preemptions": ("num_preemptions", "Requests preempted by recompute"),
    "evictions": ("prefix_cache_evictions", "Cached blocks evicted under memory pressure"),
    "spec_num_drafts": ("spec_decode_num_drafts", "Verify steps that scored draft tokens"),
    "spec_num_draft_tokens": ("spec_decode_num_draft_tokens", "Draft tokens proposed and scored"),
    "spec_num_accepted_tokens": ("spec_decode_num_accepted_tokens", "Draft tokens accepted"),
    "context_parallel_split_steps": ("context_parallel_split_steps", "Steps split across the context-parallel ranks"),
    "steps_launched_ahead": ("steps_launched_ahead", "Decode steps launched before the last step's tokens were read"),
    "ahead_rows_dropped": ("ahead_rows_dropped", "Rows of early steps whose request ended before they were read"),
}
_GAUGES = {
    "running": ("num_requests_running", "Requests in the running batch"),
    "waiting": ("num_requests_waiting", "Requests waiting to be scheduled"),
    "used_blocks": ("kv_blocks_used", "KV blocks held by requests"),
    "free_blocks": ("kv_blocks_free", "KV blocks free (including cached, evictable ones)"),
    "cached_blocks": ("kv_blocks_cached", "KV blocks holding a prefix-cache entry"),
    "state_slots_used": ("state_slots_used", "Recurrent working-state slots held by requests (hybrid models)"),
    "host_blocks_cached": ("host_kv_blocks_cached", "KV blocks held by the host tier (--host-cache-bytes)"),
    "kv_cache_bytes": ("kv_cache_bytes", "Bytes of this engine's paged KV tensors, every attention layer"),
    "prefix_cache_capacity_tokens": ("prefix_cache_capacity_tokens", "Tokens the KV pool (the prefix cache) holds"),
    "tensor_parallel_size": ("tensor_parallel_size", "Tensor-parallel ranks of this engine (1 without)"),
    "tensor_parallel_gathered_bytes": (
        "tensor_parallel_gathered_bytes",
        "Bytes rank 0 received in the tensor-parallel all-gathers so far (the rank-count-invariant exchange)",
    ),
}


class _EngineCollector(Collector):
    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Any]:
        snap = self.metrics.snapshot()
        for key, (name, doc) in _COUNTERS.items():
            yield CounterMetricFamily(f"kvwarden:{name}", doc, value=snap.get(key, 0))
        # vLLM's name; the tier label splits device-pool hits from host-tier hits (their sum is the total).
        hits = CounterMetricFamily(
            "kvwarden:prefix_cache_hits", "Prompt tokens served from the prefix cache", labels=["tier"]
        )
        host_hits = snap.get("prefix_cache_hits_host", 0)
        hits.add_metric(["device"], snap.get("prefix_cache_hits", 0) - host_hits)
        hits.add_metric(["host"], host_hits)
        yield hits
        for key, (name, doc) in _GAUGES.items():
            yield GaugeMetricFamily(f"kvwarden:{name}", doc, value=snap.get(key, 0))
        yield _by_index(
            CounterMetricFamily,
            "spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by position in the draft (0 = first)",
            "position",
            snap.get("spec_accepted_per_position", []),
        )
        yield _by_index(
            GaugeMetricFamily,
            "kv_cache_bytes_per_rank",
            "Bytes of paged KV tensors each context-parallel rank holds (rank 0 alone without context parallelism)",
            "rank",
            snap.get("kv_cache_bytes_per_rank", []),
        )
        # Info gauges (always 1) carrying the configuration as labels, as vLLM's
        # vllm:cache_config_info does: the probe reads the block size and budget from here.
        for name, (doc, labels) in self.metrics.config_info().items():
            info = GaugeMetricFamily(f"kvwarden:{name}", doc, labels=list(labels))
            info.add_metric(list(labels.values()), 1.0)
            yield info


def _by_index(kind: type, name: str, doc: str, label: str, values: list[float]) -> Any:
    """A ``kvwarden:<name>`` family with one sample per list entry, labelled by its index."""
    family = kind(f"kvwarden:{name}", doc, labels=[label])
    for index, value in enumerate(values):
        family.add_metric([str(index)], value)
    return family


class Metrics:
    """Everything ``/metrics`` exports for one server."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._lock = threading.Lock()
        self._snapshot: dict[str, Any] = {}
        self._config_info: dict[str, tuple[str, dict[str, str]]] = {}
        self.registry.register(_EngineCollector(self))
        self.ttft = Histogram(
            "kvwarden:time_to_first_token_seconds",
            "Time to first token",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.itl = Histogram(
            "kvwarden:inter_token_latency_seconds",
            "Time between tokens",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            "kvwarden:e2e_request_latency_seconds", "Request latency", buckets=LATENCY_BUCKETS, registry=self.registry
        )
        self.finished = Counter(
            "kvwarden:request_success", "Finished requests", ["finished_reason"], registry=self.registry
        )

    def config_info(self) -> dict[str, tuple[str, dict[str, str]]]:
        with self._lock:
            return dict(self._config_info)

    def observe_engine(self, engine: LLMEngine) -> None:
        if not self._config_info:
            info = _config_info(engine)
            with self._lock:
                self._config_info = info
        stats = engine.stats()
        stats["used_blocks"] = stats["num_blocks"] - stats["free_blocks"]
        states = engine.states
        stats["state_slots_used"] = states.num_working - states.num_free_working if states else 0
        with self._lock:
            self._snapshot = stats

    def observe_finished(self, out: RequestOutput, latency: float | None = None) -> None:
        self.finished.labels(finished_reason=out.finish_reason or "unknown").inc()
        if latency is not None:
            self.e2e.observe(latency)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return dict(self._snapshot)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _config_info(engine: LLMEngine) -> dict[str, tuple[str, dict[str, str]]]:
    config = engine.config
    cache, sched = config.cache, config.scheduler
    return {
        "cache_config_info": (
            "The engine's KV cache configuration",
            {
                "block_size": str(cache.block_size),
                "num_blocks": str(engine.num_blocks),
                "enable_prefix_caching": str(cache.enable_prefix_caching),
                "dtype": config.dtype,
            },
        ),
        "scheduler_config_info": (
            "The engine's scheduler and numerics configuration",
            {
                "max_num_batched_tokens": str(sched.max_num_batched_tokens),
                "max_num_seqs": str(sched.max_num_seqs),
                "chunking": sched.chunking,
                "num_speculative_tokens": str(config.speculative.num_speculative_tokens if config.speculative else 0),
                "speculative_method": config.speculative.method if config.speculative else "",
                "numerics": config.numerics.mode,
                "kernels": engine.ops.kernels,
            },
        ),
    }
