"""Shared fixtures: models are made once per session with kvwarden's own tooling."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvwarden.models.make_model import make_model

# Tests are CPU-only and must not fight over the 2 cores of a CI machine.
torch.set_num_threads(min(2, torch.get_num_threads()))


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
