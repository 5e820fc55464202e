"""Starting the servers a benchmark measures, and always stopping them.

Built on ``kvwarden.probe.launchers`` (free loopback ports, readiness polling,
process-group stops): the benchmarks add only the context managers.
"""

from __future__ import annotations

import subprocess
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from kvwarden.probe.launchers import KvwardenLauncher, RunningServer, ServerSettings


@contextmanager
def kvwarden_servers(
    model: str, settings: Mapping[str, ServerSettings], run_dir: Path | None = None, ready_timeout: float | None = None
) -> Iterator[dict[str, RunningServer]]:
    """One ``kvwarden serve`` of ``model`` per named settings, each ready before the next starts.

    Every server started is stopped on exit, also when a later one fails to start. Logs go to
    ``run_dir`` (a fresh temporary folder by default, kept for reading after a failure).
    """
    run_dir = run_dir or Path(tempfile.mkdtemp(prefix="kvwarden-bench-"))
    started: dict[str, RunningServer] = {}
    try:
        for name, s in settings.items():
            launcher = KvwardenLauncher()
            if ready_timeout is not None:
                launcher.ready_timeout = ready_timeout
            started[name] = launcher.start(model, s, run_dir, name)
        yield started
    finally:
        for server in started.values():
            server.stop()


@contextmanager
def process(cmd: list[str], url: str, log: Path, timeout: float = 180.0) -> Iterator[str]:
    """Run ``cmd`` (output to ``log``) until ``url``/health answers 200, yield ``url``; stop it on exit."""
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    server = RunningServer(url, proc, log)
    try:
        server.wait_ready(timeout)
        yield url
    finally:
        server.stop()
