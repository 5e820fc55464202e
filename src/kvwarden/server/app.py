"""The FastAPI application: routes, auth, body limits and OpenAI-style errors.

Every failure a client can cause is answered as
``{"error": {"message", "type", "param", "code"}}`` with a fitting status:
400 bad values or malformed JSON, 401 missing/wrong API key, 404 unknown model
or path, 413 oversized body, 422 wrong types or missing fields, 503 when the
queue is full. None of them touches the engine's state.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvwarden.server.access_log import AccessLog
from kvwarden.server.async_engine import AsyncEngine
from kvwarden.server.chat import ChatCompletions
from kvwarden.server.chat_tools import ToolSettings
from kvwarden.server.completions import Completions
from kvwarden.server.protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    api_key_error,
    error_response,
    refuse_unknown,
)
from kvwarden.server.tokenize import Tokenization


@dataclass(frozen=True)
class ServerConfig:
    """HTTP-side settings (the engine has its own :class:`kvwarden.config.EngineConfig`)."""

    model_name: str
    api_key: str | None = None
    max_body_bytes: int = 8 * 1024 * 1024
    log_requests: bool = True  # one access-log line per API request (server/access_log.py)
    tools: ToolSettings = field(default_factory=ToolSettings)  # tool-call and reasoning parsers


class BodyLimit:
    """Reject request bodies above ``limit`` bytes with 413 before anyone parses them."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        too_big = ApiError(413, f"request body exceeds {self.limit} bytes", None, "request_too_large")
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            await error_response(too_big)(scope, receive, send)
            return
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise _BodyTooLarge
            return message

        try:
            await self.app(scope, limited, send)
        except _BodyTooLarge:
            await error_response(too_big)(scope, receive, send)


class _BodyTooLarge(Exception):
    pass


class ApiKeyGate:
    """Require ``Authorization: Bearer KEY`` on ``/v1/*``, ``/tokenize`` and ``/detokenize`` (401 in OpenAI's
    error format otherwise): they spend the server's time on the caller's input. ``/health`` and ``/metrics``
    stay open (probes and scrapers).

    NOTE: plain ASGI on purpose: Starlette's ``BaseHTTPMiddleware`` (``@app.middleware``) hides the
    client's disconnect from ``Request.is_disconnected``, so a non-streaming request whose client left
    would run to the end instead of being aborted (and, disaggregated, keep its transfer going).
    """

    def __init__(self, app: ASGIApp, key: str) -> None:
        self.app = app
        self.key = key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if path.startswith("/v1/") or path in ("/tokenize", "/detokenize"):
            header = dict(scope.get("headers") or []).get(b"authorization")
            refused = api_key_error(header.decode("latin-1") if header is not None else None, self.key)
            if refused is not None:
                await error_response(refused)(scope, receive, send)
                return
        await self.app(scope, receive, send)


# Pydantic error types that mean "right type, value out of range": answered 400 like
# other invalid values; everything else (wrong type, missing field) is 422.
_RANGE_ERRORS = {"greater_than", "greater_than_equal", "less_than", "less_than_equal", "multiple_of"}


def _validation_error(exc: RequestValidationError, content_type: str) -> ApiError:
    errors = exc.errors()
    first = errors[0] if errors else {}
    loc = [p for p in first.get("loc", ()) if p != "body"]
    raw = first.get("input")
    if content_type and "json" not in content_type.lower():  # FastAPI read it as a form: say what it wanted
        return ApiError(
            415, f"the body must be JSON, sent with 'Content-Type: application/json' (not {content_type!r})",
            None, "unsupported_media_type",
        )  # fmt: skip
    if first.get("type") == "json_invalid" or (not loc and isinstance(raw, (bytes, str)) and not _is_json(raw)):
        detail = first.get("ctx", {}).get("error", "the body is not valid JSON")
        return ApiError(400, f"malformed JSON body: {detail}", None, "invalid_json")
    param = _param_path(loc) or None
    message = f"{param or 'body'}: {first.get('msg', 'invalid value')}"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more)"
    if first.get("type") in _RANGE_ERRORS:
        return ApiError(400, message, param, "invalid_value")
    return ApiError(422, message, param, "invalid_type")


def _param_path(loc: list[Any]) -> str:
    """A field's path as OpenAI and kvwarden's own refusals spell it: ``messages[0].content``. Pydantic's
    union branch names (``str``, ``list[ContentPart]``) are not fields and are left out."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool", "list", "dict")):
            continue
        else:
            out += f".{part}" if out else str(part)
    return out


def _is_json(raw: bytes | str) -> bool:
    try:
        json.loads(raw)
    except ValueError:
        return False
    return True


class AppExtension(Protocol):
    """More routes and a lifetime beside the OpenAI API: a disaggregated instance's role
    (:class:`kvwarden.disagg.routes.PDRoles`); the server does not know what they are."""

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    def add_routes(self, app: FastAPI, engine: AsyncEngine) -> None: ...


def build_app(engine: AsyncEngine, config: ServerConfig, roles: AppExtension | None = None) -> ASGIApp:
    """The ASGI app for one engine (``roles``: e.g. the prefill or decode service of a disaggregated
    instance, with its routes)."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        engine.metrics.observe_engine(engine.engine)
        if roles is not None:
            await roles.start()
        try:
            yield
        finally:
            if roles is not None:
                await roles.close()
            engine.shutdown()

    app = FastAPI(title="kvwarden", version="0.1.0", lifespan=lifespan)
    if roles is not None:
        roles.add_routes(app, engine)
    completions = Completions(engine, config.model_name)
    chat = ChatCompletions(engine, config.model_name, config.tools)
    tokenization = Tokenization(engine)
    created = int(time.time())

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(_validation_error(exc, request.headers.get("content-type", "")))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 400 and exc.detail == "There was an error parsing the body":  # FastAPI's own words
            return error_response(ApiError(400, "malformed body: not UTF-8 JSON", None, "invalid_json"))
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return error_response(ApiError(exc.status_code, str(exc.detail), None, code))

    @app.exception_handler(Exception)
    async def _crash(_: Request, exc: Exception) -> JSONResponse:
        return error_response(ApiError(500, f"internal error: {type(exc).__name__}: {exc}", None, "internal_error"))

    def check_model(name: str) -> None:
        if name != config.model_name:
            raise ApiError(
                404,
                f"The model `{name}` does not exist (this server serves `{config.model_name}`).",
                "model",
                "model_not_found",
            )

    @app.get("/health")
    async def health() -> Response:
        if not engine.alive:
            cause = f"{type(engine.error).__name__}: {engine.error}" if engine.error else "not running"
            return error_response(ApiError(503, f"the engine is down: {cause}", None, "engine_dead"))
        # invariant: every answer a function of the request alone (canonical numerics), so the guard knows a
        # deterministic request retried here gets the same answer (docs/guard.md)
        invariant = engine.engine.config.numerics.mode == "canonical"
        body: dict[str, Any] = {"status": "ok", "invariant": invariant}
        if engine.faults.any:
            body["injected_faults"] = engine.faults.describe()  # testing only: never a healthy production server
            injector = engine.engine.faults
            if injector is not None:  # read without the engine lock: two ints, a snapshot is all /health needs
                body["faulted_requests"] = {"kv-corruption": injector.num_corrupted, "repetition": injector.num_looped}
        return JSONResponse(body)

    @app.get("/metrics")
    async def metrics() -> Response:
        return PlainTextResponse(engine.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": config.model_name,
                    "object": "model",
                    "created": created,
                    "owned_by": "kvwarden",
                    "max_model_len": engine.engine.max_model_len,
                }
            ],
        }

    @app.post("/v1/completions", response_model=None)
    async def create_completion(req: CompletionRequest, request: Request) -> Response:
        check_model(req.model)
        return await completions.create(req, request)

    @app.post("/v1/chat/completions", response_model=None)
    async def create_chat_completion(req: ChatCompletionRequest, request: Request) -> Response:
        check_model(req.model)
        return await chat.create(req, request)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> dict[str, Any]:
        refuse_unknown(req)
        if req.model is not None:
            check_model(req.model)
        return tokenization.tokenize(req)

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> dict[str, Any]:
        refuse_unknown(req)
        if req.model is not None:
            check_model(req.model)
        return tokenization.detokenize(req)

    gated: ASGIApp = ApiKeyGate(app, config.api_key) if config.api_key else app
    return AccessLog(BodyLimit(gated, config.max_body_bytes), enabled=config.log_requests)
