"""The guard's Prometheus metrics (``kvwarden_guard:*``), one registry per guard."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from kvwarden.guard.backends import BackendPool

# The guard's own cost is in milliseconds; whole requests take seconds.
ADDED_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)


class _BackendCollector(Collector):
    def __init__(self, pool: BackendPool) -> None:
        self.pool = pool

    def collect(self) -> Iterator[Any]:
        gauges = {
            "backend_up": ("1 if the backend answers (health checks and requests)", lambda b: b.up),
            "backend_drifting": (
                "1 if the determinism canary saw the backend's fingerprint change",
                lambda b: b.drifting,
            ),
            "backend_drained": ("1 if the backend gets no new requests", lambda b: b.drained),
            "backend_outstanding_requests": ("Requests in flight at the backend", lambda b: b.outstanding),
        }
        for name, (doc, value) in gauges.items():
            family = GaugeMetricFamily(f"kvwarden_guard:{name}", doc, labels=["backend"])
            for backend in self.pool.backends:
                family.add_metric([backend.url], float(value(backend)))
            yield family


class GuardMetrics:
    """Everything the guard's ``/metrics`` exports."""

    def __init__(self, pool: BackendPool) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_BackendCollector(pool))
        self.requests = Counter(
            "kvwarden_guard:requests", "Attempts sent to a backend", ["backend"], registry=self.registry
        )
        self.aborts = Counter(
            "kvwarden_guard:aborts", "Generations stopped by a monitor", ["reason"], registry=self.registry
        )
        self.retries = Counter("kvwarden_guard:retries", "Attempts after the first", registry=self.registry)
        self.retries_skipped = Counter(
            "kvwarden_guard:retries_skipped",
            "Retries not made: a deterministic request (temperature 0 or a seed) would get the same answer from a "
            "backend it already tried",
            registry=self.registry,
        )
        self.failures = Counter(
            "kvwarden_guard:backend_failures", "Attempts lost to a failing backend", ["backend"], registry=self.registry
        )
        self.answers = Counter(
            "kvwarden_guard:answers", "Requests answered, by outcome", ["outcome"], registry=self.registry
        )
        self.canary_runs = Counter(
            "kvwarden_guard:canary_runs", "Determinism canary replays", ["backend", "result"], registry=self.registry
        )
        self.latency = Histogram(
            "kvwarden_guard:request_latency_seconds",
            "Whole request through the guard",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.added = Histogram(
            "kvwarden_guard:added_latency_seconds",
            "Time the guard itself spent on a request (everything but waiting for the backend)",
            buckets=ADDED_BUCKETS,
            registry=self.registry,
        )

    def export_zeros(self, backends: list[str], reasons: tuple[str, ...]) -> None:
        """Every (backend) and (reason) series from the start, at 0, as Prometheus clients expect: a rate over
        a series that appears only with its first event misses that event."""
        for reason in reasons:
            self.aborts.labels(reason=reason)
        for url in backends:
            self.requests.labels(backend=url)
            self.failures.labels(backend=url)
        for outcome in ("ok", "error", "passthrough", "client_gone"):
            self.answers.labels(outcome=outcome)

    def render(self) -> bytes:
        return generate_latest(self.registry)
