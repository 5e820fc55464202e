"""The guard's HTTP app: the OpenAI routes, ``/health``, ``/metrics``, and its background loops.

One pooled ``httpx.AsyncClient`` for every upstream call (no client per
request); the health loop and the canary run as tasks of the app's lifespan.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from kvwarden.guard.attempt import Guard, Passthrough
from kvwarden.guard.backends import BackendPool
from kvwarden.guard.config import GuardConfig
from kvwarden.guard.metrics import GuardMetrics
from kvwarden.guard.monitors import REASONS
from kvwarden.guard.relay import Relay
from kvwarden.server.protocol import ApiError, api_key_error, error_response, unknown_field, unrecognized
from kvwarden.server.sse import EventStream, until_disconnected

ROUTES = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}

log = logging.getLogger("kvwarden.guard")


def make_guard(config: GuardConfig) -> Guard:
    pool = BackendPool(config.backends)
    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256)
    timeout = httpx.Timeout(config.request_timeout, connect=min(5.0, config.request_timeout))
    # NOTE: TCP_NODELAY: httpx writes a request's headers and body separately; with Nagle's algorithm the
    # body waits for the backend's delayed ACK (40 ms on Linux) on every kept-alive connection.
    transport = httpx.AsyncHTTPTransport(limits=limits, socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)])
    client = httpx.AsyncClient(transport=transport, timeout=timeout)
    metrics = GuardMetrics(pool)
    metrics.export_zeros([b.url for b in pool.backends], REASONS)
    return Guard(config, client, pool, metrics)


def build_app(guard: Guard) -> Starlette:
    """The guard as an ASGI app (the caller runs it, e.g. with uvicorn)."""

    def gatekeep(request: Request) -> ApiError | None:
        """401 without the client key (when one is set); 413 for a body over the limit."""
        key = guard.config.client_api_key
        if key is not None:
            refused = api_key_error(request.headers.get("authorization"), key)
            if refused is not None:
                return refused
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > guard.config.max_body_bytes:
            return too_large
        return None

    too_large = ApiError(413, f"request body over {guard.config.max_body_bytes} bytes", None, "body_too_large")

    async def generate(request: Request) -> Response:
        kind = ROUTES[request.url.path]
        request_id = f"guard-{uuid.uuid4().hex[:12]}"

        def refuse(err: ApiError) -> Response:  # answered before any backend: logged here, in the same words
            log.info("%s %s: %d, refused: %s", request_id, request.url.path, err.status, err.message)
            return error_response(err)

        err = gatekeep(request)
        if err is not None:
            return refuse(err)
        raw = await request.body()
        if len(raw) > guard.config.max_body_bytes:  # chunked uploads carry no Content-Length
            return refuse(too_large)
        try:
            body = json.loads(raw)
        except ValueError:  # the server's words for the same mistake
            return refuse(ApiError(400, "malformed JSON body: the body is not valid JSON", None, "invalid_json"))
        if not isinstance(body, dict):
            return refuse(ApiError(400, "the request body must be a JSON object", None, "invalid_json"))
        name = unknown_field(body, kind == "chat")
        if name is not None:  # a misspelt field would reach the backend and be ignored there
            return refuse(unrecognized(name))
        relay = Relay(guard, body, kind, request.url.path, request_id)
        try:
            await until_disconnected(request, relay.start())
        except ApiError as err:
            relay.status = err.status
            await relay.aclose()
            guard.metrics.answers.labels(outcome="error" if err.status != 499 else "client_gone").inc()
            return error_response(err)
        except Passthrough as refused:
            relay.status = refused.status
            await relay.aclose()
            guard.metrics.answers.labels(outcome="passthrough").inc()
            return JSONResponse(refused.body, status_code=refused.status)
        except BaseException:
            relay.status = 500
            await relay.aclose()
            raise
        if not relay.upstream.client_streams:
            await relay.aclose()
            guard.metrics.answers.labels(outcome="ok").inc()
            return JSONResponse(relay.result())
        guard.metrics.answers.labels(outcome="ok").inc()
        return EventStream(_stream(relay))

    async def health(_: Request) -> Response:
        backends = [b.describe() for b in guard.pool.backends]
        usable = any(b.routable for b in guard.pool.backends)
        body = {"status": "ok" if usable else "no backend available", "backends": backends}
        return JSONResponse(body, status_code=200 if usable else 503)

    async def metrics(_: Request) -> Response:
        return PlainTextResponse(guard.metrics.render(), media_type="text/plain; version=0.0.4")

    async def models(request: Request) -> Response:
        err = gatekeep(request)
        if err is not None:
            return error_response(err)
        for backend in guard.pool.backends:
            if not backend.routable:
                continue
            with contextlib.suppress(httpx.HTTPError, ValueError):
                resp = await guard.client.get(f"{backend.url}/v1/models", timeout=10.0)
                if resp.status_code == 200:
                    return JSONResponse(resp.json())
        return error_response(ApiError(503, "no backend answered /v1/models", None, "no_backend_available"))

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        from kvwarden.guard.canary import canary_loop

        tasks = [asyncio.create_task(guard.pool.health_loop(guard.client, guard.config.health_interval))]
        if guard.config.canary.interval > 0:
            tasks.append(asyncio.create_task(canary_loop(guard)))
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await guard.client.aclose()

    routes = [Route(path, generate, methods=["POST"]) for path in ROUTES]
    routes += [
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
    ]
    return Starlette(routes=routes, lifespan=lifespan)


async def _stream(relay: Relay) -> AsyncIterator[dict[str, Any]]:
    try:
        async for chunk in relay.events():
            yield chunk
    except (GeneratorExit, asyncio.CancelledError):
        relay.status = 499  # the client left mid-stream: logged as a non-streamed request it leaves is
        raise
    finally:
        await relay.aclose()
