"""One access-log line per API request: id, status, token counts, cached tokens, latency.

vLLM logs every request by default; so does kvwarden (``--disable-log-requests``
turns it off). A line is written when the response's last byte has been sent
(for a stream: after ``[DONE]``), or when the client went away first::

    cmpl-3f2a... POST /v1/completions 200 prompt=412 output=32 cached=384 latency=1.284s
    cmpl-9b1c... POST /v1/completions 499 prompt=412 output=7 cached=- latency=0.311s (client disconnected, ...)

Handlers fill the request's :class:`AccessRecord` (``request.state.access``)
with the id and token counts once they know them; ``/health`` and ``/metrics``
are not logged (probes and scrapers poll them).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

LOGGER = "kvwarden.access"
_QUIET_PATHS = ("/health", "/metrics")
CLIENT_CLOSED = 499  # nginx's "client closed request": the status every request the client left is logged with


@dataclass
class AccessRecord:
    """What a handler knows about its request, for the access log."""

    request_id: str = "-"
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    cached_tokens: int | None = None

    _streamed: dict[int, int] | None = None

    def set_usage(self, prompt: int, output: int, cached: int) -> None:
        self.prompt_tokens, self.output_tokens, self.cached_tokens = prompt, output, cached

    def count_output(self, choice: int, tokens: int) -> None:
        """A stream's tokens so far (per choice): a stream the client leaves is logged with what it got."""
        self._streamed = {**(self._streamed or {}), choice: tokens}
        self.output_tokens = sum(self._streamed.values())


def access_record(request: Any) -> AccessRecord:
    """The request's record (a fresh, unlogged one when the middleware is not installed)."""
    record = getattr(request.state, "access", None)
    return record if isinstance(record, AccessRecord) else AccessRecord()


class AccessLog:
    """ASGI middleware writing one line per request to the ``kvwarden.access`` logger."""

    def __init__(self, app: ASGIApp, enabled: bool = True) -> None:
        self.app = app
        self.enabled = enabled
        self.logger = logging.getLogger(LOGGER)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.enabled or scope["path"] in _QUIET_PATHS:
            await self.app(scope, receive, send)
            return
        record = AccessRecord()
        scope.setdefault("state", {})["access"] = record
        start = time.perf_counter()
        status: list[int] = []
        logged = False

        async def logging_send(message: Message) -> None:
            nonlocal logged
            if message["type"] == "http.response.start":
                status.append(int(message["status"]))
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False) and not logged:
                logged = True
                self._log(scope, record, status, start, "")

        try:
            await self.app(scope, receive, logging_send)
        finally:
            if not logged:  # a stream the client left: 499 as for a non-streamed request it left
                sent = f", after {status[0]} was sent" if status else ""
                self._log(scope, record, [CLIENT_CLOSED], start, f" (client disconnected{sent})")

    def _log(self, scope: Scope, record: AccessRecord, status: list[int], start: float, note: str) -> None:
        def count(value: int | None) -> str:
            return "-" if value is None else str(value)

        if status and status[0] == CLIENT_CLOSED and not note:
            note = " (client disconnected)"
        client = scope.get("client")
        peer = f"{client[0]}:{client[1]}" if client else "-"
        self.logger.info(
            "%s %s %s %s %s prompt=%s output=%s cached=%s latency=%.3fs%s",
            record.request_id,
            peer,
            scope["method"],
            scope["path"],
            status[0] if status else "-",
            count(record.prompt_tokens),
            count(record.output_tokens),
            count(record.cached_tokens),
            time.perf_counter() - start,
            note,
        )
