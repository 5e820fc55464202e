"""The divergence tracer: finds the first bitwise difference, and finds none where there is none."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from kvwarden.probe.divergence import contamination_study, describe


def test_legacy_reproduction_is_traced_to_the_attention_context(qwen3_next_tiny: Path) -> None:
    report = contamination_study(qwen3_next_tiny)
    assert report["cached_tokens"] == {"A": 0, "B run 1": 0, "B run 2": 16}
    assert report["chunks"]["A"] == [(0, 28)] and report["chunks"]["B run 1"] == [(0, 16), (16, 44)]
    where = report["b1_vs_b2"]
    assert not where["identical"]
    # B's second run restores B's own state at 16 (identical), so the first difference is the
    # first full-attention layer reading K that request A wrote at position 0.
    assert where["first_op"] == "L1.attn.k_ctx" and where["first_position"] == 0
    assert where["per_layer"][0]["layer"] == 1 and where["max_abs_delta"] > 0
    writer = report["writer_a_vs_b1_on_shared_tokens"]
    assert writer["first_op"] == "L0.rec.in_proj" and writer["first_position"] == 0
    assert any("first difference at L1.attn.k_ctx" in line for line in describe(report))


def test_canonical_numerics_trace_identical(qwen3_next_tiny: Path) -> None:
    report = contamination_study(qwen3_next_tiny, numerics="canonical")
    assert report["b1_vs_b2"]["identical"] and report["b1_vs_b2"]["common_positions"] > 0
    assert report["writer_a_vs_b1_on_shared_tokens"]["identical"]
    assert report["b_runs_identical"]


def test_cli_json_and_flag_errors(qwen3_next_tiny: Path) -> None:
    cmd = [sys.executable, "-m", "kvwarden.cli", "trace-divergence", str(qwen3_next_tiny), "--json"]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["b1_vs_b2"]["first_op"] == "L1.attn.k_ctx"
    bad = subprocess.run([*cmd[:-1], "--shared", "99"], capture_output=True, text=True, check=False)
    assert bad.returncode == 2 and "--shared" in bad.stderr
