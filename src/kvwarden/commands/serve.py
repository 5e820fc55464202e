"""``kvwarden serve``: the OpenAI-compatible HTTP server.

The listening socket is bound before the model loads, so a busy port is
reported at once, in one line naming ``--port`` (exit status 1), instead of
after a long load with a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys
from typing import TYPE_CHECKING

from kvwarden.commands.engine_args import add_engine_args
from kvwarden.server.reasoning import PARSERS as REASONING_PARSERS
from kvwarden.server.tool_parsers import PARSERS as TOOL_PARSERS

if TYPE_CHECKING:
    import uvicorn

    from kvwarden.disagg.routes import PDRoles
    from kvwarden.server.async_engine import AsyncEngine

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1", help="bind address (loopback only unless you change it)")
    p.add_argument("--port", type=int, default=8000, help="port (0 picks a free one)")
    p.add_argument("--served-model-name", default=None, help="model name clients use (default: MODEL)")
    p.add_argument(
        "--api-key",
        default=os.environ.get("KVWARDEN_API_KEY") or None,
        help="require 'Authorization: Bearer KEY' on /v1/*; default: the KVWARDEN_API_KEY environment variable "
        "(as vLLM reads VLLM_API_KEY), which keeps the key out of the process list",
    )
    p.add_argument("--max-waiting", type=int, default=256, help="pending requests before answering 503")
    p.add_argument("--max-body-bytes", type=int, default=8 * 1024 * 1024, help="larger request bodies get 413")
    p.add_argument(
        "--disable-log-requests", action="store_true", help="no access-log line per request (logged by default)"
    )
    p.add_argument(
        "--request-timeout",
        type=float,
        default=None,
        help="seconds before a request is aborted and answered 408 (default: no limit)",
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
            "engine-crash-after-steps=N, host-load-delay=MS, transfer-delay=MS (prefill role: each KV transfer "
            "spread over MS); repeatable; shown in /health"
        ),
    )
    tc = p.add_argument_group("tool calling and reasoning output (docs/api.md)")
    tc.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='let the model decide whether to call tools (tool_choice "auto"); needs --tool-call-parser',
    )
    tc.add_argument(
        "--tool-call-parser",
        choices=tuple(TOOL_PARSERS),
        default=None,
        help="the format the model writes calls in: hermes (Qwen2.5, Qwen3: <tool_call>{json}</tool_call>; the "
        "call's JSON constrained once opened), glm45 (GLM-4.5, GLM-5), llama3_json (Llama 3.x)",
    )
    tc.add_argument(
        "--reasoning-parser",
        choices=tuple(REASONING_PARSERS),
        default=None,
        help="return <think>...</think> as reasoning_content beside content (qwen3, glm45, deepseek_r1)",
    )
    pd = p.add_argument_group("disaggregated serving (docs/disaggregation.md)")
    pd.add_argument(
        "--role",
        default="both",
        choices=["both", "prefill", "decode"],
        help="prefill: compute prompts for decode instances and write their KV into them; decode: take requests "
        "whose body names a prefill instance (kv_transfer_params.prefill_url); both: an ordinary server",
    )
    pd.add_argument(
        "--pd-transfer-timeout",
        type=float,
        default=60.0,
        help="decode role: seconds a prefill instance may take to compute and write a prompt before the request "
        "fails (its blocks are freed only after the abort handshake)",
    )
    pd.add_argument(
        "--unsafe-pd-abort",
        action="store_true",
        help="TESTING ONLY (decode role): free an aborted request's blocks at once, without waiting for the prefill "
        "instance's 'safe to reclaim': re-creates the race in which a late write corrupts another request",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU only: threads for the model's operators (default: every core this process may use but one, "
        "which the HTTP front end keeps; OMP_NUM_THREADS, when set, wins over the default)",
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
    if args.pd_transfer_timeout <= 0:
        raise ValueError(f"--pd-transfer-timeout must be > 0 seconds, got {args.pd_transfer_timeout}")
    args.faults = Faults.parse(args.inject_fault)
    if args.faults.layer_split_delay is not None and not args.layer_split:
        raise ValueError("--inject-fault layer-split-delay: needs --layer-split")
    if args.faults.transfer_delay is not None and args.role != "prefill":
        raise ValueError("--inject-fault transfer-delay: applies to the prefill role (--role prefill)")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice: needs --tool-call-parser NAME (the format calls are read in)")
    if args.role != "both" and args.speculative_config:
        raise ValueError(f"--speculative-config: not supported with --role {args.role} yet (disaggregated requests)")
    if args.role != "both" and args.context_parallel_size > 1:
        raise ValueError(f"--context-parallel-size: not supported with --role {args.role} yet")
    if args.role != "both" and args.tensor_parallel_size > 1:  # rank 0 holds only its heads' KV and states
        raise ValueError(f"--tensor-parallel-size: not supported with --role {args.role} yet")
    if args.unsafe_pd_abort and args.role != "decode":
        raise ValueError("--unsafe-pd-abort: applies to the decode role (--role decode)")
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
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
    set_cpu_threads(args)
    llm = load_llm(args, Console(stderr=True, highlight=False, soft_wrap=True), "kvwarden serve")
    name = args.served_model_name or args.model
    engine = AsyncEngine(
        llm.engine, Metrics(), max_waiting=args.max_waiting, request_timeout=args.request_timeout, faults=args.faults
    )
    if args.faults.any:
        print(f"kvwarden serve: WARNING: injected faults (testing only): {args.faults.describe()}", flush=True)
    if args.unsafe_pd_abort:
        print("kvwarden serve: WARNING: --unsafe-pd-abort (testing only): aborted transfers may corrupt", flush=True)
    roles = make_roles(args, engine) if args.role != "both" else None
    config = ServerConfig(
        model_name=name,
        api_key=args.api_key,
        max_body_bytes=args.max_body_bytes,
        log_requests=not args.disable_log_requests,
        tools=_tool_settings(
            args.enable_auto_tool_choice,
            args.tool_call_parser,
            REASONING_PARSERS[args.reasoning_parser] if args.reasoning_parser else None,
        ),
    )
    uv_level = "warning" if args.log_level in ("info", "debug") else args.log_level
    server = uvicorn.Server(
        uvicorn.Config(
            build_app(engine, config, roles),
            log_level=uv_level,
            access_log=False,
            # SIGTERM: stop accepting, let in-flight requests (streams included) finish for this long
            timeout_graceful_shutdown=args.shutdown_timeout,
        )
    )
    host, port = sock.getsockname()[:2]
    role = "" if args.role == "both" else f" as a {args.role} instance"
    print(f"kvwarden serve: {name} listening on http://{host}:{port}{role}", flush=True)

    return run_until_stopped(server, sock, "kvwarden serve: ready")


def set_cpu_threads(args: argparse.Namespace) -> None:
    """Operator threads for a CPU model: by default all cores but one.

    NOTE: the engine thread's operators and the HTTP front end (JSON, SSE, sockets) share the
    machine. With one operator thread per core, every parallel region waits for the thread whose
    core the front end (or a client on the same machine) took: on 2 cores, 1 thread served ~20 %
    more tokens/s than 2 (docs/performance.md). vLLM's CPU backend reserves a core the same way.
    Canonical numerics give the same bits at any thread count (GEMMs whose bits would depend on it
    run on one thread: layers/gemm_rows.py), so served answers equal the Python API's.
    """
    import torch

    from kvwarden.config import resolve_device

    if resolve_device(args.device) != "cpu":
        return
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    elif "OMP_NUM_THREADS" not in os.environ:
        # torch's default is the physical cores; the affinity mask (where there is one) may be smaller
        usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        torch.set_num_threads(max(1, min(torch.get_num_threads(), usable) - 1))
    logging.getLogger("kvwarden.serve").info("CPU operator threads: %d", torch.get_num_threads())


def make_roles(args: argparse.Namespace, engine: AsyncEngine) -> PDRoles:
    """The prefill or decode service of a disaggregated instance, with its NIXL agent."""
    from kvwarden.disagg.decode import DecodeService
    from kvwarden.disagg.prefill import PrefillService
    from kvwarden.disagg.routes import PDRoles
    from kvwarden.disagg.transfer import TransferAgent

    core = engine.engine
    kv = [core.runner.kv_caches.raw(i) for i in range(len(core.runner.kv_caches))]
    states = core.states.transfer_tensors() if core.states is not None else []
    snaps = core.states.snapshot_tensors() if core.states is not None else []
    agent = TransferAgent(f"kvwarden-{args.role}-{os.getpid()}", kv, states, snaps, core.config.cache.block_size)
    if args.role == "prefill":
        return PDRoles(prefill=PrefillService(engine, agent, args.faults.transfer_delay or 0.0))
    decode = DecodeService(engine, agent, args.pd_transfer_timeout, args.unsafe_pd_abort)
    engine.remote_kv = decode
    return PDRoles(decode=decode)


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
    if server.started:  # say so: a server that vanishes from a log without a word looks like a crash
        name = ready_line.removesuffix(": ready")
        served = server.server_state.total_requests
        plural = "s" if served != 1 else ""
        print(f"{name}: stopped after {served} request{plural} (in-flight ones drained)", flush=True)
    return 0 if server.started else 1


def _tool_settings(auto: bool, parser: str | None, reasoning: object) -> object:
    from kvwarden.server.chat_tools import ToolSettings

    return ToolSettings(auto, parser, reasoning)  # type: ignore[arg-type]
