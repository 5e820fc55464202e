"""One streaming ``/v1/completions`` client for every online benchmark.

It speaks the OpenAI wire format only (SSE ``data:`` lines, ``usage`` from
``stream_options.include_usage``), so it measures kvwarden, vLLM, SGLang and
llama.cpp alike. Times are taken when a chunk arrives: TTFT is send to the
first chunk carrying text, inter-token gaps are between text-carrying chunks.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import httpx

from kvwarden.bench.workloads import Conversation

T = TypeVar("T")
R = TypeVar("R")


@dataclass
class StreamResult:
    """What one streamed completion took and returned."""

    ok: bool = False
    ttft: float = 0.0  # seconds from send to the first text chunk
    e2e: float = 0.0  # seconds from send to the end of the stream
    chunk_times: list[float] = field(default_factory=list)  # arrival of each text chunk, from send
    text: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    status: int = 0
    error: str = ""

    @property
    def gaps(self) -> list[float]:
        """Seconds between consecutive text chunks (inter-token latency where a chunk is a token)."""
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:], strict=False)]

    @property
    def itl_mean(self) -> float | None:
        """Mean seconds per token after the first: (last - first) / (tokens - 1), whatever the chunking."""
        if self.output_tokens < 2 or len(self.chunk_times) < 2:
            return None
        return (self.chunk_times[-1] - self.chunk_times[0]) / (self.output_tokens - 1)


def completion_body(model: str, prompt: str | list[int], max_tokens: int, **extra: Any) -> dict[str, Any]:
    """A greedy streamed completion of exactly ``max_tokens`` tokens (``ignore_eos``), usage included."""
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        **extra,
    }


async def stream_completion(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> StreamResult:
    """POST ``body`` (``stream: true``) to ``url``/v1/completions and time the chunks.

    Never raises for what a server does: a non-200 answer, an ``error`` event in the
    stream or a transport error is recorded in ``error`` with ``ok`` False.
    """
    out = StreamResult()
    parts: list[str] = []
    start = time.perf_counter()
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
            out.status = resp.status_code
            if resp.status_code != 200:
                out.error = f"HTTP {resp.status_code}: {(await resp.aread())[:400]!r}"
                return out
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                now = time.perf_counter() - start
                if "error" in chunk:
                    out.error = f"stream error: {json.dumps(chunk['error'])[:400]}"
                    return out
                if usage := chunk.get("usage"):
                    out.prompt_tokens = usage.get("prompt_tokens", 0)
                    out.output_tokens = usage.get("completion_tokens", 0)
                    out.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0) or 0
                choices = chunk.get("choices", [])
                texts = [c.get("text") or "" for c in choices]
                # A token whose text is empty still arrives: a choice without a finish reason (an id past the
                # tokenizer's vocabulary, as a random-weight model with a padded embedding samples, or half
                # of a UTF-8 character). Counting text only reported such streams as failed.
                if any(texts) or any(c.get("finish_reason") is None for c in choices):
                    out.chunk_times.append(now)
                    parts.extend(texts)
    except httpx.HTTPError as exc:
        out.error = f"{type(exc).__name__}: {exc} ({url})"
        return out
    out.e2e = time.perf_counter() - start
    if not out.chunk_times:
        out.error = "no token streamed"
        return out
    out.ok = True
    out.ttft = out.chunk_times[0]
    out.text = "".join(parts)
    return out


async def served_model(client: httpx.AsyncClient, url: str) -> str:
    """The first model ``url``/v1/models lists (the name requests must carry)."""
    resp = await client.get(f"{url}/v1/models")
    resp.raise_for_status()
    return str(resp.json()["data"][0]["id"])


async def run_bounded(
    items: Sequence[T],
    call: Callable[[T], Awaitable[R]],
    concurrency: int,
    request_rate: float = float("inf"),
    seed: int = 0,
) -> tuple[list[R], float]:
    """``call`` on every item, at most ``concurrency`` in flight, arriving as a Poisson process.

    Args:
        items: what to send, in order of arrival.
        call: sends one item and returns its result (should not raise).
        concurrency: the most calls in flight.
        request_rate: mean arrivals per second; ``inf`` starts them all at once (bounded by ``concurrency``).
        seed: the arrival gaps' generator, so two runs of a benchmark send on the same schedule.

    Returns:
        The results in the order of ``items`` and the wall seconds from the first send to the last answer.
    """
    gate = asyncio.Semaphore(concurrency)
    rng = random.Random(seed)

    async def guarded(item: T) -> R:
        async with gate:
            return await call(item)

    tasks = []
    start = time.perf_counter()
    for item in items:
        tasks.append(asyncio.create_task(guarded(item)))
        if request_rate != float("inf"):
            await asyncio.sleep(rng.expovariate(request_rate))
    results = await asyncio.gather(*tasks)
    return list(results), time.perf_counter() - start


async def run_conversation(client: httpx.AsyncClient, url: str, model: str, conv: Conversation) -> list[StreamResult]:
    """Send a chat's turns in order, each prompt the history so far plus the new turn; stop at a failure.

    Plain completions with the history as text (no chat template), so it runs on any server
    and each turn's prompt starts with the previous one's text.
    """
    history = ""
    results: list[StreamResult] = []
    for turn in conv.turns:
        history += ("\n\n" if history else "") + turn
        result = await stream_completion(client, url, completion_body(model, history, conv.max_tokens))
        results.append(result)
        if not result.ok:
            break
        history += result.text
    return results
