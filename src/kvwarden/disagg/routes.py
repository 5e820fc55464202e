"""HTTP routes of a disaggregated instance (``--role prefill|decode``): the control protocol and its stats."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI

from kvwarden.disagg.decode import DecodeService
from kvwarden.disagg.prefill import PrefillService
from kvwarden.disagg.protocol import AbortOrder, AbortReport, PrefillOrder, PrefillReport
from kvwarden.server.async_engine import AsyncEngine


@dataclass(frozen=True)
class PDRoles:
    """The service of this instance's role (exactly one is set)."""

    prefill: PrefillService | None = None
    decode: DecodeService | None = None

    @property
    def name(self) -> str:
        return "prefill" if self.prefill is not None else "decode"

    async def start(self) -> None:
        if self.decode is not None:
            await self.decode.start()

    async def close(self) -> None:
        if self.decode is not None:
            await self.decode.close()

    def add_routes(self, app: FastAPI, engine: AsyncEngine) -> None:
        add_pd_routes(app, self, engine)


def add_pd_routes(app: FastAPI, roles: PDRoles, engine: AsyncEngine) -> None:
    """``/pd/v1/prefill`` and ``/pd/v1/abort`` on a prefill instance; ``/pd/v1/stats`` on both."""
    if roles.prefill is not None:
        prefill = roles.prefill

        @app.post("/pd/v1/prefill")
        async def order(body: PrefillOrder) -> PrefillReport:
            return await prefill.prefill(body)

        @app.post("/pd/v1/abort")
        async def abort(body: AbortOrder) -> AbortReport:
            return await prefill.abort(body)

    @app.get("/pd/v1/stats")
    async def stats() -> dict[str, Any]:
        service = roles.prefill or roles.decode
        assert service is not None
        pool = await engine.call(lambda e: e.stats())
        keys = ("num_blocks", "free_blocks", "cached_blocks", "running", "waiting", "remote_waiting", "detached_blocks")
        return {"role": roles.name, **service.counters, **{k: pool[k] for k in keys}}
