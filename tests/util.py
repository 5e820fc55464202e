"""Test helpers: exact comparison of logprob lists (no tolerance anywhere)."""

from __future__ import annotations

import json
import random
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from kvwarden import RequestOutput


def exact(logprobs: list[list[tuple[int, float]]] | None) -> list[list[tuple[int, bytes]]]:
    """Logprob lists with every float replaced by its IEEE-754 bytes."""
    assert logprobs is not None, "request did not return logprobs"
    return [[(int(t), struct.pack("<d", v)) for t, v in step] for step in logprobs]


def assert_same(a: RequestOutput, b: RequestOutput, what: str = "") -> None:
    """Bitwise identity of two outputs: token ids and every top-k (id, logprob) pair."""
    assert a.token_ids == b.token_ids, f"{what}: tokens differ {a.token_ids} vs {b.token_ids}"
    ea, eb = exact(a.logprobs), exact(b.logprobs)
    for i, (x, y) in enumerate(zip(ea, eb, strict=True)):
        assert x == y, f"{what}: top-k list of token {i} differs"


def random_tokens(rng: random.Random, n: int, vocab: int, low: int = 3) -> list[int]:
    """n random token ids, avoiding the special tokens at the start of the vocabulary."""
    return [rng.randrange(low, vocab) for _ in range(n)]


def probe_arms_agree(model: Path | str, scenario: dict[str, Any], workdir: Path) -> bool:
    """``kvwarden probe`` runs ``scenario`` against fresh kvwarden servers of ``model`` (files under
    ``workdir``): whether every pair of arms it compares gave identical fingerprints."""
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / "scenario.yaml"
    path.write_text(yaml.safe_dump(scenario))
    cmd = [sys.executable, "-m", "kvwarden.cli", "probe", "--no-progress", "--json", "--out", str(workdir / "run")]
    cmd += ["--launcher", "kvwarden", "--model", str(model), "--scenario", str(path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode in (0, 1), done.stdout + done.stderr
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    return all(summary["cross_arm"].values())
