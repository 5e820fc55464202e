"""One client request through the guard: attempts on backends, monitors, the hold-back window.

The life of a request: :meth:`Relay.start` sends it to the least-loaded
backend (always streaming) and reads chunks, running the monitors on each,
until the hold-back window has passed (streaming clients) or the generation is
complete (non-streaming clients). If a monitor fires or the backend fails
inside that window, the attempt is closed (closing the connection makes the
backend abort the request and free its KV) and the request goes to another
backend, at most ``max_retries`` times; nothing has reached the client, so the
retry is invisible. After the window, :meth:`Relay.events` passes chunks on as
they come; a monitor firing then ends the stream with ``finish_reason:
"guard_abort"`` and an error event: never a silent splice of two generations.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx

from kvwarden.guard.attempt import Attempt, AttemptFailed, AttemptStopped, Guard, Passthrough
from kvwarden.guard.backends import Backend
from kvwarden.guard.chunks import (
    Kind,
    Upstream,
    abort_chunks,
    error_event,
    for_client,
    observe,
    prepare,
    sse_events,
)
from kvwarden.guard.monitors import Verdict, check
from kvwarden.server.protocol import ApiError

log = logging.getLogger("kvwarden.guard")
IN_FLIGHT = "in flight"  # an attempt not finished: the client left during it


class Relay:
    """Runs one request; ``start`` then ``events`` (streaming) or ``result`` (not), then ``aclose``."""

    def __init__(self, guard: Guard, body: dict[str, Any], kind: Kind, path: str, request_id: str = "") -> None:
        self.guard = guard
        self.kind = kind
        self.path = path
        self.request_id = request_id
        self.status = 200  # what the client is answered (set by the app before aclose on errors)
        cfg = guard.config.monitors
        self.upstream: Upstream = prepare(body, kind, want_logprobs=cfg.garbage.enabled or cfg.repetition.enabled)
        n = body.get("n", 1)
        self.num_choices = n if isinstance(n, int) and n > 0 else 1
        self.attempt: Attempt | None = None
        self.closed = False
        self.num_attempts = 0
        self.started = time.perf_counter()
        self.upstream_wait = 0.0  # seconds spent waiting on backends (the rest is the guard's own time)
        self.history: list[str] = []  # "backend: outcome" per attempt, for the log line

    # ---------------------------------------------------------------- attempts
    async def start(self) -> None:
        """Attempt until one passes the hold-back window (or completes).

        Raises:
            ApiError: 502 once every attempt was stopped or failed; 503 when no backend is up.
            Passthrough: the backend refused the request (the client's error).
        """
        tried: set[str] = set()
        last, code = "", "no_attempt"
        # NOTE: a deterministic request (greedy, or seeded) whose answer a monitor stopped on an invariant
        # backend (its /health says so: kvwarden, canonical numerics) gets the same answer there again:
        # retrying there only repeats it. Other backends, and failed or busy ones, are still retried.
        settled: set[str] = set()
        while self.num_attempts <= self.guard.config.max_retries:
            backend = self.guard.pool.pick(tried, frozenset(settled))
            if backend is None and settled and any(b.routable for b in self.guard.pool.backends):
                self.guard.metrics.retries_skipped.inc()
                last += (
                    "; not retried on an invariant backend already tried: a deterministic request (temperature 0 "
                    "or a seed) gets the same answer there"
                )
                break
            if backend is None:
                why = last or self.guard.pool.why_down()  # this request's own last error, else the health checks'
                raise ApiError(503, f"no backend is up ({why})", None, "no_backend_available")
            if self.num_attempts:
                self.guard.metrics.retries.inc()
            self.num_attempts += 1
            tried.add(backend.url)
            self.history.append(f"{backend.url}: {IN_FLIGHT}")  # what the log says if the client leaves now
            try:
                self.attempt = await self._open(backend)
                await self._fill(self.attempt)
                self.history[-1] = f"{backend.url}: ok"
                return
            except AttemptStopped as stop:
                self.guard.metrics.aborts.labels(reason=stop.verdict.reason).inc()
                last = f"last error: {backend.url}: {stop.verdict.reason}: {stop.verdict.detail}"
                code = stop.verdict.reason
                self.history[-1] = f"{backend.url}: {code}"
                if backend.invariant and deterministic(self.upstream.body):
                    settled.add(backend.url)
            except AttemptFailed as failure:
                self.guard.metrics.failures.labels(backend=backend.url).inc()
                if failure.take_out:
                    self.guard.pool.mark_failed(backend, str(failure))
                last = f"last error: {backend.url}: {failure}"
                code = "backend_failed"
                self.history[-1] = f"{backend.url}: failed"
            await self._close()
        raise ApiError(
            502,
            f"kvwarden guard: no acceptable answer after {self.num_attempts} attempt(s); {last}",
            None,
            code,
            "guard_abort",
        )

    async def _open(self, backend: Backend) -> Attempt:
        cfg = self.guard.config
        headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
        request = self.guard.client.build_request(
            "POST", f"{backend.url}{self.path}", json=self.guard.upstream_body(self.upstream.body), headers=headers
        )
        self.guard.metrics.requests.labels(backend=backend.url).inc()
        backend.outstanding += 1
        t0 = time.perf_counter()
        try:
            response = await self.guard.client.send(request, stream=True)
        except BaseException as exc:  # a cancelled client too: the count must not leak
            backend.outstanding -= 1
            if isinstance(exc, httpx.HTTPError):
                raise AttemptFailed(f"{type(exc).__name__}: {exc}") from exc
            raise
        finally:
            self.upstream_wait += time.perf_counter() - t0
        if response.status_code != 200:
            try:
                body = await response.aread()
            finally:
                await response.aclose()
                backend.outstanding -= 1
            if response.status_code in (429, 503):  # busy, not broken: try elsewhere, keep it in
                raise AttemptFailed(f"busy (HTTP {response.status_code})", take_out=False)
            if response.status_code >= 500:
                raise AttemptFailed(f"HTTP {response.status_code}: {body[:200]!r}")
            try:
                payload = response.json()
            except ValueError:
                payload = {"error": {"message": body.decode(errors="replace"), "type": "upstream_error"}}
            self.history[-1] = f"{backend.url}: {response.status_code}, passed through"  # its in-flight entry
            raise Passthrough(response.status_code, payload)
        return Attempt(backend, response, response.aiter_lines())

    async def _next(self, attempt: Attempt) -> dict[str, Any] | None:
        """The next chunk, or ``None`` at the end of the stream."""
        t0 = time.perf_counter()
        try:
            while True:
                try:
                    line = await anext(attempt.lines)
                except StopAsyncIteration:
                    return None
                event = sse_events(line)
                if event == "[DONE]":
                    return None
                if isinstance(event, dict):
                    return event
        except httpx.HTTPError as exc:
            raise AttemptFailed(f"stream broke: {type(exc).__name__}: {exc}") from exc
        finally:
            self.upstream_wait += time.perf_counter() - t0

    def _verdict(self, attempt: Attempt) -> Verdict | None:
        for index in sorted(attempt.watches):
            verdict = check(attempt.watches[index], self.guard.config.monitors)
            if verdict is not None:
                return verdict
        return None

    def _window_passed(self, attempt: Attempt) -> bool:
        if not self.upstream.client_streams:
            return False  # the client waits for the whole answer: the window is all of it
        # NOTE: released on the token *after* the window, the first one the monitors' "more than N" rules judge.
        hold = self.guard.config.hold_back
        watches = attempt.watches.values()
        return len(attempt.watches) >= self.num_choices and all(w.finished or w.num_tokens > hold for w in watches)

    async def _fill(self, attempt: Attempt) -> None:
        """Read and hold chunks until the window passes or the stream ends; monitors run on each."""
        while True:
            chunk = await self._next(attempt)
            if chunk is None:
                attempt.done = True
                return
            if "error" in chunk:
                raise AttemptFailed(f"error event: {str(chunk['error'])[:200]}")
            observe(chunk, attempt.watches, self.kind)
            attempt.held.append(chunk)
            verdict = self._verdict(attempt)
            if verdict is not None:
                raise AttemptStopped(verdict)
            if self._window_passed(attempt):
                return

    async def _close(self) -> None:
        attempt = self.attempt
        if attempt is None or attempt.closed:
            return
        attempt.closed = True
        attempt.backend.outstanding -= 1
        # Closing mid-stream drops the connection: the backend sees the client gone and frees the KV.
        with contextlib.suppress(httpx.HTTPError):
            await attempt.response.aclose()

    def _unfinished(self) -> str:
        """How an attempt that never reached an outcome ended: the client left, or the backend's own answer
        (a refusal passed through) ended it."""
        return "the client left mid-attempt" if self.status == 499 else f"ended with {self.status}"

    def _log_history(self) -> str:
        entries = [h.replace(IN_FLIGHT, self._unfinished()) for h in self.history]
        if self.status == 499 and entries and entries[-1].endswith(": ok"):
            entries[-1] += ", then the client left mid-stream"
        return "; ".join(entries) or "no attempt"

    async def aclose(self) -> None:
        if self.closed:
            return
        self.closed = True
        await self._close()
        elapsed = time.perf_counter() - self.started
        log.info(
            "%s %s %s: %d, %s (%.3f s)",
            self.request_id or "-",
            self.path,
            "stream" if self.upstream.client_streams else "json",
            self.status,
            self._log_history(),
            elapsed,
        )
        self.guard.metrics.latency.observe(elapsed)
        self.guard.metrics.added.observe(max(0.0, elapsed - self.upstream_wait))

    # ---------------------------------------------------------------- answers
    def result(self) -> dict[str, Any]:
        """The non-streaming answer (after :meth:`start`)."""
        from kvwarden.guard.assemble import assemble

        assert self.attempt is not None and self.attempt.done
        body = assemble(self.attempt.held, self.kind)
        if self.upstream.added_logprobs:
            for choice in body["choices"]:
                choice["logprobs"] = None
        return body

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        """The streaming answer's chunks (after :meth:`start`): the held ones, then live ones."""
        attempt = self.attempt
        assert attempt is not None
        for chunk in attempt.held:
            out = for_client(chunk, self.upstream)
            if out is not None:
                yield out
        head = attempt.held[0] if attempt.held else {}
        attempt.held = []
        while not attempt.done:
            try:
                chunk = await self._next(attempt)
            except AttemptFailed as failure:
                self.guard.metrics.failures.labels(backend=attempt.backend.url).inc()
                self.guard.pool.mark_failed(attempt.backend, str(failure))
                self.history.append(f"{attempt.backend.url}: failed after the window")
                yield error_event(f"the backend failed mid-stream: {failure}", "backend_failed")
                return
            if chunk is None:
                attempt.done = True
                return
            if "error" in chunk:
                yield chunk  # the backend's own error event, as it sent it
                return
            observe(chunk, attempt.watches, self.kind)
            out = for_client(chunk, self.upstream)
            if out is not None:
                yield out
            verdict = self._verdict(attempt)
            if verdict is not None:
                self.guard.metrics.aborts.labels(reason=verdict.reason).inc()
                await self._close()
                for chunk in abort_chunks(head, self.kind, attempt.watches):
                    yield chunk
                n = max(w.num_tokens for w in attempt.watches.values())
                message = (
                    f"kvwarden guard stopped this generation after {n} tokens ({verdict.reason}: {verdict.detail}); "
                    "the text streamed so far is incomplete and should not be used"
                )
                self.history.append(f"{attempt.backend.url}: {verdict.reason} after the window")
                yield error_event(message, verdict.reason)
                return


def deterministic(body: dict[str, Any]) -> bool:
    """Whether a backend that answers as a function of the request (kvwarden) answers this one the same way
    every time: greedy (``temperature`` 0), or sampled from a ``seed``."""
    return body.get("temperature") == 0 or body.get("seed") is not None
