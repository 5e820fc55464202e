"""What a request's attempts share and how one ends: the guard's shared state (:class:`Guard`), one
try on one backend (:class:`Attempt`), and the three ways an attempt ends early - the backend's own
refusal passed through, the backend failing, a monitor stopping it."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvwarden.guard.backends import Backend, BackendPool
from kvwarden.guard.config import GuardConfig
from kvwarden.guard.metrics import GuardMetrics
from kvwarden.guard.monitors import ChoiceWatch, Verdict


class Passthrough(Exception):
    """The backend refused the request itself (4xx): the client gets that answer unchanged."""

    def __init__(self, status: int, body: Any) -> None:
        super().__init__(f"HTTP {status}")
        self.status = status
        self.body = body


class AttemptFailed(Exception):
    """The backend failed this attempt (connection, 5xx, silence, an error event)."""

    def __init__(self, why: str, take_out: bool = True) -> None:
        super().__init__(why)
        self.take_out = take_out


class AttemptStopped(Exception):
    """A monitor stopped this attempt (its verdict says why)."""

    def __init__(self, verdict: Verdict) -> None:
        super().__init__(verdict.detail)
        self.verdict = verdict


@dataclass
class Guard:
    """What every request shares: configuration, the pooled HTTP client, backends, metrics."""

    config: GuardConfig
    client: httpx.AsyncClient
    pool: BackendPool
    metrics: GuardMetrics
    prefill_turn: Iterator[int] = field(default_factory=itertools.count)  # round robin over config.prefill

    def upstream_body(self, body: dict[str, Any]) -> dict[str, Any]:
        """The body an attempt sends: in disaggregated mode it names the prefill instance (round robin)."""
        if not self.config.prefill:
            return body
        url = self.config.prefill[next(self.prefill_turn) % len(self.config.prefill)]
        return {**body, "kv_transfer_params": {"prefill_url": url}}


@dataclass
class Attempt:
    """One try of a request on one backend: its streamed response, the monitors' state, what is held back."""

    backend: Backend
    response: httpx.Response
    lines: AsyncIterator[str]
    watches: dict[int, ChoiceWatch] = field(default_factory=dict)
    held: list[dict[str, Any]] = field(default_factory=list)
    done: bool = False
    closed: bool = False
