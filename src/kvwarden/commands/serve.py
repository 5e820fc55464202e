"""``kvwarden serve``: the OpenAI-compatible HTTP server.

The listening socket is bound before the model loads, so a busy port is
reported at once, in one line naming ``--port`` (exit status 1), instead of
after a long load with a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket
import sys
from typing import TYPE_CHECKING

from kvwarden.commands.engine_args import add_engine_args

if TYPE_CHECKING:
    import uvicorn

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1", help="bind address (loopback only unless you change it)")
    p.add_argument("--port", type=int, default=8000, help="port (0 picks a free one)")
    p.add_argument("--served-model-name", default=None, help="model name clients use (default: MODEL)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    p.add_argument("--max-waiting", type=int, default=256, help="pending requests before answering 503")
    p.add_argument("--max-body-bytes", type=int, default=8 * 1024 * 1024, help="larger request bodies get 413")
    p.add_argument(
        "--disable-log-requests", action="store_true", help="no access-log line per request (logged by default)"
    )
    p.add_argument(
        "--request-timeout", type=float, default=None, help="seconds before a request is aborted and answered 408"
    )
    p.add_argument(
        "--shutdown-timeout", type=float, default=30.0, help="on SIGTERM, seconds to let in-flight requests finish"
    )
    p.add_argument(
        "--inject-fault",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help=(
            "TESTING ONLY, breaks the engine on purpose: kv-corruption=RATE (share of requests whose KV is "
            "overwritten with noise after prefill), repetition=RATE (share forced into a loop), fault-seed=N, "
            "engine-crash-after-steps=N; repeatable; shown in /health"
        ),
    )
    p.add_argument(
        "--log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug"],
        help="kvwarden's log level (access log at info); the HTTP library logs warnings and above",
    )
    p.set_defaults(func=run)


def bind(host: str, port: int) -> socket.socket:
    """A listening socket, or ``OSError`` (port in use, address not available)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # NOTE: proto must say TCP: asyncio sets TCP_NODELAY on accepted connections only when it does, and
    # without it every response written in two parts waits ~40 ms for the client's delayed ACK.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def run(args: argparse.Namespace) -> int:
    from kvwarden.engine.faults import Faults

    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    if args.request_timeout is not None and args.request_timeout <= 0:
        raise ValueError(f"--request-timeout must be > 0 seconds, got {args.request_timeout}")
    if args.shutdown_timeout < 0:
        raise ValueError(f"--shutdown-timeout must be >= 0 seconds, got {args.shutdown_timeout}")
    args.faults = Faults.parse(args.inject_fault)
    try:
        sock = bind(args.host, args.port)
    except OSError as exc:
        reason = exc.strerror or str(exc)
        where = f"{args.host}:{args.port}"
        print(f"kvwarden serve: error: cannot listen on {where} (--host/--port): {reason}", file=sys.stderr)
        return 1
    with sock:
        return _serve(args, sock)


def _serve(args: argparse.Namespace, sock: socket.socket) -> int:
    import uvicorn
    from rich.console import Console

    from kvwarden.commands.loading import load_llm
    from kvwarden.server.app import ServerConfig, build_app
    from kvwarden.server.async_engine import AsyncEngine
    from kvwarden.server.metrics import Metrics

    logging.basicConfig(format=LOG_FORMAT, level=logging.WARNING)
    logging.getLogger("kvwarden").setLevel(args.log_level.upper())
    llm = load_llm(args, Console(stderr=True, highlight=False, soft_wrap=True), "kvwarden serve")
    name = args.served_model_name or args.model
    engine = AsyncEngine(
        llm.engine, Metrics(), max_waiting=args.max_waiting, request_timeout=args.request_timeout, faults=args.faults
    )
    if args.faults.any:
        print(f"kvwarden serve: WARNING: injected faults (testing only): {args.faults.describe()}", flush=True)
    config = ServerConfig(
        model_name=name,
        api_key=args.api_key,
        max_body_bytes=args.max_body_bytes,
        log_requests=not args.disable_log_requests,
    )
    uv_level = "warning" if args.log_level in ("info", "debug") else args.log_level
    server = uvicorn.Server(
        uvicorn.Config(
            build_app(engine, config),
            log_level=uv_level,
            access_log=False,
            # SIGTERM: stop accepting, let in-flight requests (streams included) finish for this long
            timeout_graceful_shutdown=args.shutdown_timeout,
        )
    )
    host, port = sock.getsockname()[:2]
    print(f"kvwarden serve: {name} listening on http://{host}:{port}", flush=True)

    return run_until_stopped(server, sock, "kvwarden serve: ready")


def run_until_stopped(server: uvicorn.Server, sock: socket.socket, ready_line: str) -> int:
    """Serve on ``sock``, print ``ready_line`` once accepting, return 0 after a clean SIGTERM (1 if never up)."""

    async def serve() -> None:
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started and not task.done():
            await asyncio.sleep(0.05)
        if server.started:
            print(ready_line, flush=True)
        await task

    # uvicorn handles SIGTERM while serving (stop accepting, drain, lifespan shutdown) and then re-raises
    # it to the handler that was installed before: make that one a no-op, so a drained server exits 0.
    signal.signal(signal.SIGTERM, lambda *_: None)
    asyncio.run(serve())
    return 0 if server.started else 1
