"""Server-sent events and client disconnects, shared by the server and the guard (no engine imports)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import StreamingResponse

from kvwarden.server.protocol import ApiError

T = TypeVar("T")


async def until_disconnected(request: Request, work: Awaitable[T], poll: float = 0.1) -> T:
    """Await ``work``; cancel it (aborting its requests) if the client goes away."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=poll)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                raise ApiError(499, "client disconnected", None, "client_closed_request")
    finally:
        if not task.done():
            task.cancel()


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"


async def sse_stream(chunks: AsyncGenerator[dict[str, Any], None]) -> AsyncIterator[str]:
    """Server-sent events of ``chunks`` then ``[DONE]``; errors become an error event."""
    async with contextlib.aclosing(chunks):
        try:
            async for chunk in chunks:
                yield sse(chunk)
        except ApiError as err:
            yield sse(err.body())
    yield "data: [DONE]\n\n"


class EventStream(StreamingResponse):
    """SSE response that always closes its generator chain when the response ends.

    Starlette stops iterating when the client goes away but leaves the
    generator suspended; closing it explicitly runs every ``finally`` down to
    the engine, which aborts the requests and frees their KV blocks at once.
    """

    def __init__(self, chunks: AsyncGenerator[dict[str, Any], None]) -> None:
        super().__init__(sse_stream(chunks), media_type="text/event-stream")

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[union-attr]
