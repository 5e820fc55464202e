"""The one result shape of every benchmark, written by ``kvwarden bench --result FILE NAME ...``, and the
summary that reads those files (``kvwarden bench --summarize PATH...``).

A result file holds one JSON object::

    {"name": "scale",                         # the bench
     "config": {"argv": [...]},               # its flags, as given
     "machine": {"cpu": ..., "gpus": [...], "torch": ..., "python": ...},
     "status": "done",                        # or "running" (killed before it ended), "failed (exit 2)", ...
     "seconds": 123.4,
     "figures": {...}}                        # the bench's last JSON line, unchanged (null if it printed none)

The file is written when the bench starts (status ``running``) and again when it ends, so a run that a
``timeout`` kills leaves a result that says so. pytest's JUnit XML files (``--junitxml``) are read too:
the GPU script's test stages are summarized beside the benches.
"""

from __future__ import annotations

import importlib
import io
import json
import os
import platform
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TextIO

RESULT_KEYS = frozenset({"name", "config", "machine", "status", "figures"})


def machine() -> dict[str, Any]:
    """The machine a result came from. GPUs are read through nvidia-smi, not torch: asking torch would
    initialize CUDA in a process that may fork workers afterwards."""
    gpus: list[str] = []
    if shutil.which("nvidia-smi"):
        query = ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"]
        done = subprocess.run(query, capture_output=True, text=True, timeout=30, check=False)
        gpus = [line.strip() for line in done.stdout.splitlines() if line.strip()] if done.returncode == 0 else []
    torch_version = None
    try:
        import torch

        torch_version = torch.__version__
    except ImportError:  # the summary side runs without torch too
        pass
    return {
        "cpu": _cpu_name(),
        "cores": os.cpu_count(),
        "gpus": gpus,
        "torch": torch_version,
        "python": platform.python_version(),
    }


def _cpu_name() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    return names[0] if names else platform.processor() or platform.machine()


class _Tee(io.TextIOBase):
    """Passes a bench's stdout through and keeps its last non-empty line (the bench's JSON)."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.last = ""
        self._pending = ""

    def write(self, text: str) -> int:
        self.out.write(text)
        lines = (self._pending + text).split("\n")
        self._pending = lines.pop()
        for line in lines:
            if line.strip():
                self.last = line
        return len(text)

    def flush(self) -> None:
        self.out.flush()

    def last_line(self) -> str:
        return self._pending if self._pending.strip() else self.last


def _figures(line: str) -> dict[str, Any] | None:
    try:
        value = json.loads(line)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def write(path: Path, result: dict[str, Any]) -> None:
    """Written whole to a neighbour, then renamed: a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(result) + "\n")
    tmp.replace(path)


def run_recorded(name: str, argv: list[str], path: Path, call: Callable[[], int], stdout: Any) -> int:
    """Runs ``call`` (the bench) with its stdout passed through, and writes the result file around it."""
    started = time.monotonic()
    result: dict[str, Any] = {
        "name": name, "config": {"argv": argv}, "machine": machine(), "status": "running", "seconds": 0.0,
        "figures": None,
    }  # fmt: skip
    write(path, result)
    tee = _Tee(stdout)
    code = 1
    try:
        code = call_with_stdout(call, tee)
    finally:
        figures = _figures(tee.last_line())
        status = "done" if code == 0 else f"failed (exit {code})"
        if code == 0 and figures is None:
            status = "done, but its last line is not a JSON object"
        result.update(status=status, seconds=round(time.monotonic() - started, 1), figures=figures)
        write(path, result)
    return code


def call_with_stdout(call: Callable[[], int], out: Any) -> int:
    saved = sys.stdout
    sys.stdout = out
    try:
        return call()
    finally:
        sys.stdout.flush()
        sys.stdout = saved


def read(path: Path) -> dict[str, Any] | None:
    """A result file, or None for any other JSON (a bench's own partial output, a GEMM table)."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) and value.keys() >= RESULT_KEYS else None


def junit_line(path: Path) -> str:
    """pytest's own counts from its JUnit XML."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError) as err:
        return f"unreadable JUnit file: {err}"
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    if suite is None:
        return "no testsuite in the JUnit file"
    n = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    passed = n["tests"] - n["failures"] - n["errors"] - n["skipped"]
    parts = [f"{passed} passed"] + [f"{n[k]} {k}" for k in ("failures", "errors", "skipped") if n[k]]
    return ", ".join(parts) + f" in {float(suite.get('time', 0)):.0f} s"


def generic_lines(figures: dict[str, Any]) -> list[tuple[str, str]]:
    """For a bench without its own ``summarize``: its top-level numbers and flags."""
    plain = {
        k: v for k, v in figures.items() if isinstance(v, (int, float, bool)) or (isinstance(v, str) and len(v) < 40)
    }
    return [(k, str(v)) for k, v in list(plain.items())[:8]]


def result_lines(result: dict[str, Any]) -> list[tuple[str, str]]:
    """The summary lines of one result: its bench's ``summarize(figures)`` where it has one."""
    if result["status"] != "done":
        return [("status", f"{result['status']} after {result.get('seconds', 0)} s")]
    try:
        module = importlib.import_module(f"kvwarden.bench.{result['name']}")
    except ImportError as err:
        return [("summary", f"bench {result['name']!r} not importable here: {err}")]
    summarize = getattr(module, "summarize", generic_lines)
    try:
        return summarize(result["figures"])
    except (KeyError, IndexError, TypeError, ValueError, ZeroDivisionError) as err:  # a part the run skipped
        return [("summary", f"could not summarize: {type(err).__name__}: {err}")]


def files(paths: Iterable[Path]) -> list[Path]:
    """Result and JUnit files: the paths given, and those inside the folders given, in name order."""
    found: list[Path] = []
    for path in paths:
        found += sorted(p for p in path.iterdir() if p.suffix in (".json", ".xml")) if path.is_dir() else [path]
    return found


def summary(paths: Iterable[Path]) -> list[str]:
    """One line per figure: the file's name (the stage), the label, the value."""
    lines = []
    for path in files(paths):
        if not path.exists():
            lines.append(f"{path.stem:<26} {'status':<46} no result file (the stage did not start; see its log)")
        elif path.suffix == ".xml":
            lines.append(f"{path.stem:<26} {'tests':<46} {junit_line(path)}")
        elif (result := read(path)) is not None:
            lines += [f"{path.stem:<26} {label:<46} {value}" for label, value in result_lines(result)]
    return lines
