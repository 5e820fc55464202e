"""The sweep over published configurations (bench/configs/), on the CPU: every one loads and agrees with
transformers, or is refused at load with a message naming a config field.

Each ``config.json`` becomes a random checkpoint of its exact shapes, cut to its first two layers (a hybrid
keeps both layer kinds); kvwarden's real loader reads it. CI runs a light pass - two prompts of eight greedy
tokens, property (b) on the hidden sizes under 3072, a MoE's experts cut to 64 for memory -; ``python
kvwarden bench sweep`` runs the full one (eight prompts of 32 tokens, properties b, e, f) whose table is in
docs/models.md, and ``scripts/gpu_check.sh full sweep`` the same on a GPU with every expert.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from kvwarden.bench.real_configs import sweep_config
from tolerance import model_tolerance

CONFIGS = Path(__file__).resolve().parent.parent / "bench" / "configs"
NAMES = sorted(f.stem for f in CONFIGS.glob("*.json"))


def test_the_sweep_has_the_published_configurations() -> None:
    assert len(NAMES) >= 14, NAMES
    for name in NAMES:
        cfg = json.loads((CONFIGS / f"{name}.json").read_text())
        assert cfg["num_hidden_layers"] >= 16, name  # real depths: the sweep cuts them, not the files


@pytest.mark.parametrize("name", NAMES)
def test_published_configuration_loads_and_agrees_or_is_refused(name: str, tmp_path: Path) -> None:
    config = json.loads((CONFIGS / f"{name}.json").read_text())
    large = config["hidden_size"] >= 3072
    row = sweep_config(  # tol inf: the bound is derived below, from the logits' magnitude
        name, config, tmp_path, layers=2, prompts=2, tokens=8, max_experts=64, properties=() if large else ("b",),
        tol=math.inf,
    )  # fmt: skip
    print(f"{name}: {row.status} {row.shape} {row.detail} ({row.seconds:.0f} s)")
    if row.status == "refused":
        assert any(key in row.detail for key in config), f"refused without naming a config field: {row.detail}"
        return
    assert row.status == "agrees", row
    assert row.greedy_equal == row.prompts == 2
    # float32 rounding of this shape cut to two layers, prompts of up to 48 + 8 tokens (tests/tolerance.py)
    bound = model_tolerance(dict(config, num_hidden_layers=2), row.max_abs_logit, context=56, log_softmax=True)
    assert row.max_dlogprob_likely <= bound, (row.max_dlogprob_likely, bound)
    assert row.max_dlogprob_top20 <= bound, (row.max_dlogprob_top20, bound)
