"""The backends behind the guard: health, load, and which one takes the next attempt.

Routing is least-outstanding-requests among backends that are up and not
drained; ties go round-robin so an idle pool spreads its load. A backend that
fails (connection error, 5xx, silence past the request timeout) is taken out at
once and put back by the health loop when ``GET /health`` answers 200 again.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from dataclasses import dataclass, field
from typing import Any

import httpx

log = logging.getLogger("kvwarden.guard")


@dataclass
class Backend:
    """One upstream server and what the guard knows of it.

    Attributes:
        url: base URL (no trailing slash).
        up: answering; taken out on a failure, back on a good health check.
        outstanding: requests the guard has in flight there.
        drifting: the determinism canary saw its fingerprint change.
        drained: not given new requests (a drifting backend, when configured).
        last_error: why it was last taken out.
        health: the last ``/health`` body (kvwarden's shows injected faults).
    """

    url: str
    up: bool = True
    outstanding: int = 0
    drifting: bool = False
    drained: bool = False
    last_error: str | None = None
    health: dict[str, Any] = field(default_factory=dict)
    canary_fingerprint: str | None = None
    canary_runs: int = 0
    canary_changes: int = 0

    @property
    def routable(self) -> bool:
        return self.up and not self.drained

    @property
    def invariant(self) -> bool:
        """Its ``/health`` says every answer is a function of the request alone (kvwarden, canonical numerics):
        a deterministic request gets the same answer from it every time."""
        return self.health.get("invariant") is True

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "url": self.url,
            "up": self.up,
            "outstanding": self.outstanding,
            "drifting": self.drifting,
            "drained": self.drained,
            "invariant": self.invariant,
            "canary": {
                "runs": self.canary_runs,
                "changes": self.canary_changes,
                "fingerprint": self.canary_fingerprint,
            },
        }
        if self.last_error:
            out["last_error"] = self.last_error
        if "injected_faults" in self.health:
            out["injected_faults"] = self.health["injected_faults"]
        return out


class BackendPool:
    """All backends; the only place their state changes."""

    def __init__(self, urls: tuple[str, ...]) -> None:
        self.backends = [Backend(url.rstrip("/")) for url in urls]
        self._turn = itertools.count()

    def pick(self, tried: set[str], settled: frozenset[str] = frozenset()) -> Backend | None:
        """The routable backend with the fewest outstanding requests, preferring ones not ``tried`` yet, never
        one in ``settled`` (an invariant backend whose answer to this request is already known)."""
        live = [b for b in self.backends if b.routable and b.url not in settled]
        fresh = [b for b in live if b.url not in tried] or live
        if not fresh:
            return None
        low = min(b.outstanding for b in fresh)
        ties = [b for b in fresh if b.outstanding == low]
        return ties[next(self._turn) % len(ties)]

    def why_down(self) -> str:
        """Why no backend is routable: each one's last known error (a health check's ConnectError, say)."""
        reasons = [f"{b.url}: {b.last_error or 'not up yet'}" for b in self.backends if not b.routable]
        return "; ".join(reasons) or "none is configured"

    def mark_failed(self, backend: Backend, why: str) -> None:
        if backend.up:
            log.warning("backend %s taken out: %s", backend.url, why)
        backend.up = False
        backend.last_error = why

    async def check(self, client: httpx.AsyncClient, backend: Backend, timeout: float) -> None:
        """One health check: up iff ``GET /health`` answers 200 within ``timeout``."""
        try:
            resp = await client.get(f"{backend.url}/health", timeout=timeout)
            ok = resp.status_code == 200
            why = None if ok else f"/health answered {resp.status_code}"
            with contextlib.suppress(ValueError):
                body = resp.json()
                backend.health = body if isinstance(body, dict) else {}
        except httpx.HTTPError as exc:
            ok, why = False, f"/health: {type(exc).__name__}: {exc}"
        if ok and not backend.up:
            log.warning("backend %s is back", backend.url)
        if not ok:
            self.mark_failed(backend, why or "unhealthy")
        backend.up = ok

    async def health_loop(self, client: httpx.AsyncClient, interval: float) -> None:
        """Check every backend every ``interval`` seconds until cancelled."""
        while True:
            # A busy backend may answer /health slowly: never judge it on less than 2 s, nor wait more than 5.
            timeout = min(5.0, max(2.0, interval))
            await asyncio.gather(*(self.check(client, b, timeout) for b in self.backends))
            await asyncio.sleep(interval)
