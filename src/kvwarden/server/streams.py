"""Running the choices of one API request: fan-out, merge, disconnect handling."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass

from kvwarden.engine.outputs import RequestOutput
from kvwarden.engine.prompt_ids import ContextLengthError
from kvwarden.engine.sampling_params import SamplingParams
from kvwarden.server.async_engine import AsyncEngine
from kvwarden.server.engine_errors import (
    EngineDeadError,
    PrefillTimeoutError,
    QueueFullError,
    RemotePrefillError,
    RequestFailedError,
    RequestTimeoutError,
)
from kvwarden.server.formatting import DeltaTracker
from kvwarden.server.protocol import ApiError


@dataclass(frozen=True)
class Job:
    """One choice: a prompt and its sampling parameters."""

    index: int
    token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None
    remote: str | None = None  # the prefill instance computing the prompt (kv_transfer_params.prefill_url)


def invalid_prompt(exc: ValueError, param: str | None) -> ApiError:
    """A 400 for a prompt (or any value) the engine refused; one with no room left to generate within
    ``max_model_len`` (measured only by the engine's tokenizer) is OpenAI's ``context_length_exceeded``."""
    code = "context_length_exceeded" if isinstance(exc, ContextLengthError) else "invalid_value"
    return ApiError(400, str(exc), param, code)


def _engine_error(exc: BaseException) -> ApiError:
    if isinstance(exc, QueueFullError):
        return ApiError(503, f"server overloaded: {exc}; retry later", None, "overloaded")
    if isinstance(exc, RequestTimeoutError):
        return ApiError(408, str(exc), None, "request_timeout")
    if isinstance(exc, PrefillTimeoutError):
        return ApiError(504, str(exc), None, "prefill_timeout")
    if isinstance(exc, RemotePrefillError):
        return ApiError(502, str(exc), None, "prefill_failed")
    if isinstance(exc, RequestFailedError):
        return ApiError(500, str(exc), None, exc.code)
    if isinstance(exc, EngineDeadError):
        return ApiError(500, str(exc), None, "engine_dead")
    if isinstance(exc, ValueError):
        return invalid_prompt(exc, None)
    return ApiError(500, f"engine error: {exc}", None, "internal_error")


async def merged(engine: AsyncEngine, jobs: list[Job], prefix: str) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Yield ``(index, output)`` as any job progresses; cancelling aborts every job."""
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(job: Job) -> None:
        try:
            rid = engine.new_request_id(prefix)
            async for out in engine.generate(rid, job.token_ids, job.params, job.cache_salt, job.remote):
                await queue.put((job.index, out))
            await queue.put((job.index, None))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            await queue.put((job.index, exc))

    tasks = [asyncio.create_task(pump(job)) for job in jobs]
    remaining = len(jobs)
    try:
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise _engine_error(item) from item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def choice_deltas(
    engine: AsyncEngine, jobs: list[Job], prefix: str
) -> AsyncGenerator[tuple[int, str, list[int], RequestOutput], None]:
    """``(choice index, new text, indices of new tokens, output)`` whenever a choice has news.

    Text is held back while a stop string could still claim it (see
    :class:`kvwarden.server.formatting.DeltaTracker`).
    """
    hold = max((len(s) for s in jobs[0].params.stop), default=1) - 1
    trackers = {job.index: DeltaTracker(hold=hold) for job in jobs}
    events = merged(engine, jobs, prefix)
    async with contextlib.aclosing(events):
        async for index, out in events:
            tracker = trackers[index]
            text = tracker.text_delta(out)
            new = list(tracker.new_tokens(out))
            if text or new or out.finished:
                yield index, text, new, out


async def collect(engine: AsyncEngine, jobs: list[Job], prefix: str) -> dict[int, RequestOutput]:
    """Final output of every job."""
    final: dict[int, RequestOutput] = {}
    async for index, out in merged(engine, jobs, prefix):
        if out.finished:
            final[index] = out
    return final
