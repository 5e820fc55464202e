"""``kvwarden serve``: the OpenAI-compatible HTTP server."""

from __future__ import annotations

import argparse
import asyncio
import sys

from kvwarden.cli import add_engine_args, engine_kwargs


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    p.add_argument("--port", type=int, default=8000, help="port (0 picks a free one)")
    p.add_argument("--served-model-name", default=None, help="model name clients use (default: MODEL)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    p.add_argument("--max-waiting", type=int, default=256, help="pending requests before 503")
    p.add_argument("--max-body-bytes", type=int, default=8 * 1024 * 1024)
    p.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from kvwarden.llm import LLM
    from kvwarden.server.app import ServerConfig, build_app
    from kvwarden.server.async_engine import AsyncEngine
    from kvwarden.server.metrics import Metrics

    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    print(f"kvwarden serve: loading {args.model} ...", flush=True)
    llm = LLM(args.model, **engine_kwargs(args))
    name = args.served_model_name or args.model
    engine = AsyncEngine(llm.engine, Metrics(), max_waiting=args.max_waiting)
    app = build_app(engine, ServerConfig(model_name=name, api_key=args.api_key, max_body_bytes=args.max_body_bytes))
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False)
    server = uvicorn.Server(config)

    async def serve() -> None:
        task = asyncio.create_task(server.serve())
        while not server.started:
            if task.done():
                task.result()
                return
            await asyncio.sleep(0.05)
        for s in server.servers:
            for sock in s.sockets:
                host, port = sock.getsockname()[:2]
                print(f"kvwarden serve: {name} listening on http://{host}:{port}", flush=True)
        print("kvwarden serve: ready", flush=True)
        await task

    asyncio.run(serve())
    if not server.started:
        print("kvwarden serve: error: the server could not start (is the port in use?)", file=sys.stderr)
        return 2
    return 0
