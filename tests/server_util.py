"""Start and stop a real ``kvwarden serve`` process on loopback for tests."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import httpx

READY_TIMEOUT = 120.0


@dataclass
class Server:
    url: str
    model: str
    process: subprocess.Popen[str]
    log: list[str] = field(default_factory=list)

    def metrics(self) -> dict[str, float]:
        """``/metrics`` as {sample name with labels: value}."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out


@contextmanager
def running_server(model: str, *args: str, env: dict[str, str] | None = None) -> Iterator[Server]:
    """A ``kvwarden serve`` on 127.0.0.1 with a free port; SIGTERM then SIGKILL on exit."""
    cmd = [sys.executable, "-m", "kvwarden.cli", "serve", model, "--port", "0", *args]
    with running_process(cmd, "kvwarden serve: ready", model, env) as server:
        yield server


@contextmanager
def running_guard(backends: list[str], *args: str) -> Iterator[Server]:
    """A ``kvwarden guard`` on 127.0.0.1 with a free port in front of ``backends``."""
    cmd = [sys.executable, "-m", "kvwarden.cli", "guard", "--port", "0", *args]
    for url in backends:
        cmd += ["--backend", url]
    with running_process(cmd, "kvwarden guard: ready", "guard") as server:
        yield server


@contextmanager
def running_process(cmd: list[str], ready_line: str, model: str, env: dict[str, str] | None = None) -> Iterator[Server]:
    """Run ``cmd`` until it prints ``ready_line`` (its URL from "listening on URL"); stop it on exit."""
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, **(env or {})},
    )
    log: list[str] = []
    url_box: list[str] = []
    ready = threading.Event()

    def reader() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            log.append(line.rstrip())
            match = re.search(r"listening on (http://\S+)", line)
            if match:
                url_box.append(match.group(1))
            if ready_line in line:
                ready.set()

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + READY_TIMEOUT
        while not ready.wait(0.2):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("process did not start:\n" + "\n".join(log[-30:]))
        yield Server(url=url_box[0], model=model, process=proc, log=log)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=15)
        thread.join(timeout=5)
