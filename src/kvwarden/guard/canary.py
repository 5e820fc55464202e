"""The determinism canary: does a backend still give the answer it gave at the start?

Every ``canary.interval`` seconds, per backend, the guard replays the probe's
contamination pattern: request A on a document, then request B sharing A's
prefix (so B meets A's blocks in the prefix cache), greedy, with the top-20
logprobs of every token. B's fingerprint (the probe's: exact float bytes of
every top list) is compared with that backend's first one. An engine whose
caches never change the answer gives the same fingerprint forever; one whose
prefix cache, batch or corrupted blocks leak into the logits drifts, and is
marked ``drifting`` in ``/metrics`` and ``/health`` (and drained, if configured).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from typing import Any

import httpx

from kvwarden.guard.attempt import Guard
from kvwarden.guard.backends import Backend
from kvwarden.probe.builtin import Shape, prompts
from kvwarden.probe.client import TopList, parse_logprobs
from kvwarden.probe.fingerprint import fingerprint

log = logging.getLogger("kvwarden.guard")

# Words, not tokens (the guard knows no tokenizer): a shared prefix long enough to span several KV blocks.
CANARY_SHAPE = Shape(a_len=120, b_len=160, shared=100)


def as_ids(tops: list[TopList]) -> list[list[tuple[int, float]]]:
    """Token keys as ints: ids stay; token strings (servers that give no ids) get a stable 63-bit hash."""

    def key(token: int | str) -> int:
        if isinstance(token, int):
            return token
        return int.from_bytes(hashlib.sha256(token.encode()).digest()[:8], "little") >> 1

    return [[(key(t), v) for t, v in top] for top in tops]


async def _model(guard: Guard, backend: Backend) -> str:
    resp = await guard.client.get(f"{backend.url}/v1/models", timeout=10.0)
    resp.raise_for_status()
    return resp.json()["data"][0]["id"]


async def _complete(guard: Guard, backend: Backend, model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "logprobs": guard.config.canary.top_logprobs,
        "return_tokens_as_token_ids": True,
    }
    headers = {"Authorization": f"Bearer {guard.config.api_key}"} if guard.config.api_key else {}
    resp = await guard.client.post(
        f"{backend.url}/v1/completions", json=body, headers=headers, timeout=guard.config.request_timeout
    )
    resp.raise_for_status()
    return resp.json()["choices"][0]


async def replay(guard: Guard, backend: Backend) -> str:
    """Run the pattern once on ``backend``; B's fingerprint (ordered top lists)."""
    model = await _model(guard, backend)
    a, b = prompts(CANARY_SHAPE, None)
    cfg = guard.config.canary
    await _complete(guard, backend, model, str(a), cfg.max_tokens)
    choice = await _complete(guard, backend, model, str(b), cfg.max_tokens)
    _, tops = parse_logprobs(choice.get("logprobs"))
    if not tops:
        raise ValueError("the backend returned no logprobs")
    return fingerprint(as_ids(tops), choice.get("text", "")).ordered


async def check_backend(guard: Guard, backend: Backend) -> None:
    """One canary run on one backend; updates its ``drifting`` state and the metrics."""
    try:
        fp = await replay(guard, backend)
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as exc:
        guard.metrics.canary_runs.labels(backend=backend.url, result="error").inc()
        log.warning("canary on %s failed: %s: %s", backend.url, type(exc).__name__, exc)
        return
    backend.canary_runs += 1
    if backend.canary_fingerprint is None:
        backend.canary_fingerprint = fp
        guard.metrics.canary_runs.labels(backend=backend.url, result="baseline").inc()
        return
    if fp == backend.canary_fingerprint:
        guard.metrics.canary_runs.labels(backend=backend.url, result="same").inc()
        return
    # NOTE: drifting is sticky: an engine that changed its answer once cannot be trusted to keep it.
    backend.canary_changes += 1
    guard.metrics.canary_runs.labels(backend=backend.url, result="changed").inc()
    if not backend.drifting:
        log.warning(
            "canary: %s changed its answer (fingerprint %s -> %s)",
            backend.url,
            backend.canary_fingerprint[:12],
            fp[:12],
        )
    backend.drifting = True
    if guard.config.canary.drain_on_drift:
        backend.drained = True


async def canary_loop(guard: Guard) -> None:
    """Replay on every backend that is up, now and every ``canary.interval`` seconds, until cancelled."""
    while True:
        await asyncio.gather(*(check_backend(guard, b) for b in guard.pool.backends if b.up))
        await asyncio.sleep(guard.config.canary.interval)
