"""``kvwarden guard``: an OpenAI-compatible proxy that stops corrupted generations before users see them.

Flags override ``--config guard.toml``; see docs/guard.md for every key.
"""

from __future__ import annotations

import argparse
import logging
import socket
import sys
from typing import TYPE_CHECKING

from kvwarden.commands.serve import LOG_FORMAT, bind, run_until_stopped

if TYPE_CHECKING:
    from kvwarden.guard.config import GuardConfig


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "guard",
        help="proxy and load balancer that stops and retries bad generations (acceptance, loops, garbage)",
        description=(
            "An OpenAI-compatible proxy in front of one or more servers (kvwarden, vLLM, SGLang, llama.cpp): it "
            "watches every generation as it streams (speculative acceptance, repetition, garbage), aborts and "
            "retries the bad ones on another backend before the client sees them, and replays a determinism "
            "canary. Flags override --config guard.toml; docs/guard.md describes every key."
        ),
    )
    p.add_argument(
        "--backend",
        action="append",
        default=None,
        metavar="URL",
        help="an OpenAI-compatible server (repeatable), e.g. http://127.0.0.1:8000",
    )
    p.add_argument(
        "--decode",
        action="append",
        default=None,
        metavar="URL",
        help="a decode instance (kvwarden serve --role decode), repeatable: the same as --backend",
    )
    p.add_argument(
        "--prefill",
        action="append",
        default=None,
        metavar="URL",
        help="disaggregated serving: a prefill instance (kvwarden serve --role prefill), repeatable; the backends "
        "are then decode instances and every request names a prefill instance (round robin)",
    )
    p.add_argument("--config", default=None, metavar="TOML", help="guard.toml with monitors, canary and routing keys")
    p.add_argument("--host", default=None, help="bind address (default 127.0.0.1: loopback only)")
    p.add_argument("--port", type=int, default=None, help="port (default 8100; 0 picks a free one)")
    p.add_argument("--max-retries", type=int, default=None, help="attempts after the first (default 2)")
    p.add_argument(
        "--hold-back-tokens",
        type=int,
        default=None,
        help="tokens held before a streaming client sees the first one (default: the monitors' minimum, 128)",
    )
    p.add_argument(
        "--canary-interval",
        type=float,
        default=None,
        help="seconds between canary replays (0 = off; default: the config's, else 60)",
    )
    p.add_argument("--api-key", default=None, help="sent to the backends as 'Authorization: Bearer KEY'")
    p.add_argument("--client-api-key", default=None, help="require 'Authorization: Bearer KEY' from clients on /v1/*")
    p.add_argument(
        "--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"], help="log level"
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from kvwarden.guard.config import load_config

    config = load_config(
        args.config,
        backends=tuple((args.backend or []) + (args.decode or [])) or None,
        prefill=tuple(args.prefill) if args.prefill else None,
        host=args.host,
        port=args.port,
        max_retries=args.max_retries,
        hold_back_tokens=args.hold_back_tokens,
        api_key=args.api_key,
        client_api_key=args.client_api_key,
    )
    if args.canary_interval is not None:
        config = replace(config, canary=replace(config.canary, interval=args.canary_interval))  # re-validated
    try:
        sock = bind(config.host, config.port)
    except OSError as exc:
        reason = exc.strerror or str(exc)
        print(
            f"kvwarden guard: error: cannot listen on {config.host}:{config.port} (--host/--port): {reason}",
            file=sys.stderr,
        )
        return 1
    with sock:
        return _serve(config, sock, args.log_level)


def _serve(config: GuardConfig, sock: socket.socket, log_level: str) -> int:
    import uvicorn

    from kvwarden.guard.app import build_app, make_guard

    logging.basicConfig(format=LOG_FORMAT, level=logging.WARNING)
    logging.getLogger("kvwarden").setLevel(log_level.upper())
    guard = make_guard(config)
    server = uvicorn.Server(
        uvicorn.Config(build_app(guard), log_level="warning", access_log=False, timeout_graceful_shutdown=30)
    )
    host, port = sock.getsockname()[:2]
    backends = ", ".join(config.backends)
    if config.prefill:
        backends = f"decode {backends} with prefill {', '.join(config.prefill)}"
    print(f"kvwarden guard: listening on http://{host}:{port} in front of {backends}", flush=True)
    canary = f"canary every {config.canary.interval:g} s" if config.canary.interval else "canary off"
    print(
        f"kvwarden guard: hold back {config.hold_back} tokens, at most {config.max_retries} retries, {canary}",
        flush=True,
    )

    return run_until_stopped(server, sock, "kvwarden guard: ready")
