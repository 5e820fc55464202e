"""Fitted drafters agree with the target far more than random ones, and speculation with them is exact.

The fits are scaled down (fewer continuations and steps than ``make-model``
uses) so the module runs in about a minute on 2 cores; held-out accuracy is
correspondingly lower than a full fit gives.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from kvwarden import LLM, SamplingParams
from kvwarden.cli import main as cli_main
from kvwarden.models.bundled import questions
from kvwarden.models.fit_draft import distillation_data, fit_draft_model, fit_mtp
from kvwarden.models.make_model import make_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def fitted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("fit")
    target = make_model("qwen3_next", "tiny", 0, root / "target")
    before = load_file(str(target / "model.safetensors"))
    data = distillation_data(target, seed=0, num_prompts=128)  # shared by both fits, as make-model does
    mtp = fit_mtp(target, seed=0, steps=150, data=data)
    draft = fit_draft_model(target, root / "draft", seed=0, steps=100, data=data)
    return {"target": target, "draft_dir": root / "draft", "before": before, "mtp": mtp, "draft": draft}


def test_fitted_mtp_head_predicts_the_target(fitted: dict[str, Any]) -> None:
    r = fitted["mtp"]
    # The random head almost never agrees (~1/vocab); a fitted one clearly does.
    assert r["initial_heldout_accuracy"] < 0.02, r
    assert r["heldout_accuracy"] >= r["initial_heldout_accuracy"] + 0.03, r
    assert r["train_accuracy"] >= r["heldout_accuracy"], r


def test_fit_mtp_changes_only_the_mtp_tensors(fitted: dict[str, Any]) -> None:
    before, after = fitted["before"], load_file(str(fitted["target"] / "model.safetensors"))
    assert after.keys() == before.keys()
    for name, t in before.items():
        assert after[name].dtype == t.dtype, name
        if not name.startswith("mtp."):
            assert torch.equal(after[name], t), name
    assert not torch.equal(after["mtp.fc.weight"], before["mtp.fc.weight"])


def test_fitted_draft_model_predicts_the_target(fitted: dict[str, Any]) -> None:
    r = fitted["draft"]
    # The untrained draft already shares the target's (frozen) embedding and LM head, hence its head start.
    assert r["heldout_accuracy"] >= r["initial_heldout_accuracy"] + 0.02, r
    assert r["heldout_accuracy"] >= 0.08, r
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (fitted["draft_dir"] / name).read_bytes() == (fitted["target"] / name).read_bytes()


@pytest.mark.parametrize("method", ["mtp", "draft"])
def test_speculation_with_fitted_drafters_is_exact_and_accepts(fitted: dict[str, Any], method: str) -> None:
    target = str(fitted["target"])
    prompts = list(questions()[:2])
    params = SamplingParams(temperature=0.0, max_tokens=16)
    spec: dict[str, Any] = {"method": method, "num_speculative_tokens": 2}
    if method == "draft":
        spec["model"] = str(fitted["draft_dir"])
    plain = LLM(target).generate(prompts, params)
    outs = LLM(target, speculative_config=spec).generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert sum(o.spec_stats.num_accepted_tokens for o in outs) > 0


def test_fit_mtp_refuses_a_checkpoint_without_mtp_head(tmp_path: Path) -> None:
    llama = make_model("llama", "tiny", 0, tmp_path / "llama")
    with pytest.raises(ValueError, match=r"--fit-mtp: .* has no MTP head"):
        fit_mtp(llama)
    with pytest.raises(SystemExit):  # argparse error, before anything is written
        cli_main(["make-model", "--arch", "llama", "--fit-mtp", "--out", str(tmp_path / "x")])
    assert not (tmp_path / "x").exists()
