"""Shared fixtures: models are made once per session with kvwarden's own tooling."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from kvwarden.models.make_model import make_model

# Tests are CPU-only and must not fight over the 2 cores of a CI machine.
torch.set_num_threads(min(2, torch.get_num_threads()))
# Without a GPU, Triton kernels run under Triton's interpreter (read when a kernel module is imported).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def models_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


def _made(root: Path, arch: str, preset: str, seed: int = 0) -> Path:
    out = root / f"{arch}-{preset}-s{seed}"
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
MEASUREMENTS = pytest.StashKey[list[dict[str, Any]]]()
MEASUREMENTS_FILE = Path(__file__).resolve().parent.parent / "runs" / "real-engines" / "measurements.json"


def pytest_configure(config: pytest.Config) -> None:
    config.stash[MEASUREMENTS] = []


@pytest.fixture
def measure(request: pytest.FixtureRequest) -> Callable[..., None]:
    """``measure(what, **facts)``: record a measurement of a third-party engine for the run's summary."""

    def record(what: str, **facts: Any) -> None:
        entry = {"test": request.node.name, "what": what, **facts}
        request.config.stash[MEASUREMENTS].append(entry)
        MEASUREMENTS_FILE.parent.mkdir(parents=True, exist_ok=True)
        MEASUREMENTS_FILE.write_text(json.dumps(request.config.stash[MEASUREMENTS], indent=1, default=str))

    return record


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    entries = config.stash.get(MEASUREMENTS, [])
    if not entries:
        return
    terminalreporter.section("measured on this machine (recorded, not asserted)")
    for e in entries:
        facts = ", ".join(f"{k}={v}" for k, v in e.items() if k not in ("test", "what"))
        terminalreporter.write_line(f"{e['what']}: {facts}")
    terminalreporter.write_line(f"(also in {MEASUREMENTS_FILE})")
