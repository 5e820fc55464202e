"""Shared fixtures: models are made once per session with kvwarden's own tooling."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from filelock import FileLock

from kvwarden.models.make_model import make_model

# Tests are CPU-only and must not fight over the 2 cores of a CI machine: `make test` runs two
# pytest-xdist workers, one thread each (two threads each would oversubscribe the cores).
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else min(2, torch.get_num_threads()))
# Without a GPU, Triton kernels run under Triton's interpreter (read when a kernel module is imported).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def models_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the session's models are made: under pytest-xdist, one folder all workers share (the
    run's base folder), each model made once under a file lock (:func:`_made`)."""
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "models"
    root.mkdir(exist_ok=True)
    return root


def _made(root: Path, arch: str, preset: str, seed: int = 0) -> Path:
    out = root / f"{arch}-{preset}-s{seed}"
    with FileLock(str(out) + ".lock"):  # another worker may be writing it
        if not (out / "model.safetensors").is_file():
            make_model(arch, preset, seed, out)
    return out


@pytest.fixture(scope="session")
def llama_tiny(models_root: Path) -> Path:
    return _made(models_root, "llama", "tiny")


@pytest.fixture(scope="session")
def qwen3_tiny(models_root: Path) -> Path:
    return _made(models_root, "qwen3", "tiny")


@pytest.fixture(scope="session")
def llama_small(models_root: Path) -> Path:
    return _made(models_root, "llama", "small")


@pytest.fixture(scope="session")
def qwen3_next_tiny(models_root: Path) -> Path:
    return _made(models_root, "qwen3_next", "tiny")


@pytest.fixture(scope="session", params=["qwen3_next", "granite_hybrid"])
def hybrid_tiny(request: pytest.FixtureRequest, models_root: Path) -> Path:
    return _made(models_root, request.param, "tiny")


@pytest.fixture(scope="session", params=["llama", "qwen3"])
def dense_tiny(request: pytest.FixtureRequest, llama_tiny: Path, qwen3_tiny: Path) -> Path:
    return llama_tiny if request.param == "llama" else qwen3_tiny


# Measurements of engines nobody here wrote (stability, block sizes, cached tokens on this machine):
# recorded and printed at the end of the run, never asserted - they differ between machines.
MEASUREMENTS_FILE = Path(__file__).resolve().parent.parent / "runs" / "real-engines" / "measurements.json"


class _Measurements:
    """Collects ``measure(...)`` entries from test reports (under pytest-xdist the workers send their
    reports to the controller, which alone collects and prints them) and writes them to a file."""

    def __init__(self) -> None:
        self.entries: list[dict[str, Any]] = []

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when != "teardown":  # the properties ride on every phase's report: take them once
            return
        got = [value for name, value in report.user_properties if name == "measurement"]
        if got:
            self.entries.extend(got)
            MEASUREMENTS_FILE.parent.mkdir(parents=True, exist_ok=True)
            MEASUREMENTS_FILE.write_text(json.dumps(self.entries, indent=1, default=str))

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if not self.entries:
            return
        crashes = [e for e in self.entries if e.get("crashed_before_first_answer")]
        terminalreporter.section("measured on this machine (recorded, not asserted)")
        for e in self.entries:
            if e in crashes:
                continue
            facts = ", ".join(f"{k}={v}" for k, v in e.items() if k not in ("test", "what"))
            terminalreporter.write_line(f"{e['what']}: {facts}")
        terminalreporter.write_line(f"(also in {MEASUREMENTS_FILE})")
        if crashes:  # an engine that never answered measured nothing: say so where nobody can miss it
            title = f"{len(crashes)} ENGINE SERVER(S) DIED BEFORE THEIR FIRST ANSWER: NOTHING MEASURED THERE"
            terminalreporter.section(title, sep="!", red=True, bold=True)
            for e in crashes:
                terminalreporter.write_line(f"{e['what']}: {e['error']}", red=True, bold=True)
                for line in e["log_tail"]:
                    terminalreporter.write_line(f"    | {line}")


# The unit-level tier, `make test-fast` (lint and these modules, -m fast, under 5 minutes on 2 cores): each
# subsystem's own tests that build no real server or engine of other projects and need no Triton interpreter
# run over a whole model. `make test` runs everything, these included.
FAST_MODULES = frozenset(
    {
        "test_block_pool", "test_scheduler", "test_predict", "test_detokenizer", "test_numerics",
        "test_sampling", "test_guard_parts", "test_bench_toolkit", "test_readme", "test_api_fixes",
        "test_tools", "test_cpu_kernels", "test_dsa", "test_dsa_kernels", "test_kernels", "test_fp8",
        "test_tensor_parallel", "test_make_model", "test_bad_input", "test_bench_results",
    }
)  # fmt: skip


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark the fast tier; then the real-engine tests first: under pytest-xdist they run one after another on
    one worker (their ``xdist_group``), ~20 minutes, so starting them last would leave that worker alone at
    the end."""
    for item in items:
        if item.module is not None and item.module.__name__.rsplit(".", 1)[-1] in FAST_MODULES:
            item.add_marker(pytest.mark.fast)
    first = [item for item in items if item.get_closest_marker("xdist_group") is not None]
    if first:
        items[:] = first + [item for item in items if item.get_closest_marker("xdist_group") is None]


def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):  # the controller (or a run without workers)
        config.pluginmanager.register(_Measurements(), "kvwarden-measurements")


@pytest.fixture
def measure(request: pytest.FixtureRequest) -> Callable[..., None]:
    """``measure(what, **facts)``: record a measurement of a third-party engine for the run's summary.

    It travels on the test's report (``user_properties``), so under pytest-xdist it reaches the
    controller, which prints the summary, from the worker that ran the test."""

    def record(what: str, **facts: Any) -> None:
        entry = {"test": request.node.name, "what": what, **facts}
        request.node.user_properties.append(("measurement", json.loads(json.dumps(entry, default=str))))

    return record
