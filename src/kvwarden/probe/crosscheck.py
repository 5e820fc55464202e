"""The predictor beside the observation: cache hits a contamination run should show.

After a contamination run against an engine whose scheduling rule the
predictor models (kvwarden itself, vLLM), the probe replays the same request
sequence through :mod:`kvwarden.probe.predict` with the block size and step
budget *the server reported* (:mod:`kvwarden.probe.server_info`), and with the
prompt lengths the server counted. The cached-token counts must then agree
exactly: that is the predictor's contract. Whether the engine's numbers were
stable is a separate, measured question; the predicted verdict (which assumes
chunk-shape-dependent kernels for every rule but kvwarden's) is printed beside
the observed one, never asserted.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvwarden.probe.predict import predict_pair
from kvwarden.probe.report import ArmSummary
from kvwarden.probe.scenario import Scenario

# kvwarden's chunking setting -> the predictor's name for the same rule.
_KVWARDEN_RULES = {"kvwarden": "kvwarden", "legacy-align": "vllm-align", "legacy-align-fixed": "vllm-align-fixed"}


@dataclass
class CacheCheck:
    """Predicted vs observed cached tokens per arm of one contamination run."""

    rule: str
    block_size: int
    block_size_source: str
    max_num_batched_tokens: int | None
    num_spec_tokens: int
    hybrid: bool
    a_len: int
    b_len: int
    shared: int
    predicted: dict[str, list[int]]
    observed: dict[str, list[int | None]]
    matches: bool
    predicted_repeats_stable: bool
    predicted_history_dependent: bool
    explanation: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        verdict = "match" if self.matches else "MISMATCH"
        arms = "; ".join(f"{a} predicted {self.predicted[a]} observed {self.observed.get(a)}" for a in self.predicted)
        return (
            f"predictor ({self.rule}, block size {self.block_size} from {self.block_size_source}, "
            f"budget {self.max_num_batched_tokens}): cached tokens {verdict}: {arms}"
        )


def model_is_hybrid(model: str | None) -> bool | None:
    """Whether a local model directory has recurrent layers (``None``: cannot tell)."""
    if model is None or not (Path(model) / "config.json").is_file():
        return None
    from kvwarden.models.config import ModelConfig

    try:
        return bool(ModelConfig.from_dir(model).recurrent_layers)
    except (ValueError, KeyError, json.JSONDecodeError):
        return None


def rule_for(launcher: str | None, server: dict[str, Any], hybrid: bool | None) -> str | None:
    """The predictor rule that models a launcher's server (``None``: no model of its scheduler)."""
    if launcher == "kvwarden":
        return _KVWARDEN_RULES.get(server.get("labels", {}).get("chunking", "kvwarden"))
    if launcher == "vllm" and hybrid is not None:
        # With prefix caching on, vLLM schedules a hybrid in align mode; a dense model by budget alone.
        return "vllm-align" if hybrid else "vllm"
    return None


def check_contamination(
    scenario: Scenario,
    records: list[dict[str, Any]],
    summaries: list[ArmSummary],
    rule: str,
    hybrid: bool,
    num_spec_tokens: int = 0,
) -> CacheCheck | str:
    """Predicted vs observed cached tokens, or the reason no prediction can be made."""
    by = {s.arm: s for s in summaries}
    if scenario.name != "contamination" or not {"clean", "contaminated"} <= by.keys():
        return "only the contamination scenario has a prediction"
    clean, cont = by["clean"], by["contaminated"]
    if clean.error or cont.error:
        return "an arm failed"
    server = clean.server
    block_size = server.get("block_size")
    if not block_size:
        return "the server reported no block size"
    shape = scenario.notes.get("shape") or {}
    if not scenario.notes.get("token_prompts") or "shared" not in shape:
        return "prompts were text: their lengths in tokens are unknown"
    a_prompt = scenario.requests["A"].prompt
    b_prompt = scenario.requests["B"].prompt
    a_len = _prompt_tokens(records, cont.arm, "A") or len(a_prompt)
    b_len = _prompt_tokens(records, clean.arm, "B") or len(b_prompt)
    # A server that adds a BOS token counts it in both prompts: the shared prefix grows by as much.
    shared = int(shape["shared"]) + (b_len - len(b_prompt))
    budget = server.get("max_num_batched_tokens")
    pred = predict_pair(
        rule, int(block_size), a_len, b_len, shared, num_spec_tokens, budget, repeats=clean.runs, hybrid=hybrid
    )
    predicted = {"clean": pred.clean_cached_tokens, "contaminated": pred.b_cached_tokens}
    if "no-cache" in by and not by["no-cache"].error:
        predicted["no-cache"] = [0] * by["no-cache"].runs
    observed = {arm: by[arm].cached_tokens for arm in predicted}
    return CacheCheck(
        rule=rule,
        block_size=int(block_size),
        block_size_source=str(server.get("block_size_source")),
        max_num_batched_tokens=budget,
        num_spec_tokens=num_spec_tokens,
        hybrid=hybrid,
        a_len=a_len,
        b_len=b_len,
        shared=shared,
        predicted=predicted,
        observed=observed,
        matches=all(observed[arm] == predicted[arm] for arm in predicted),
        predicted_repeats_stable=pred.repeats_stable,
        predicted_history_dependent=pred.history_dependent,
        explanation=pred.explanation,
    )


def _prompt_tokens(records: list[dict[str, Any]], arm: str, request: str) -> int | None:
    for r in records:
        if r.get("type") == "response" and r["arm"] == arm and r["request"] == request and r.get("prompt_tokens"):
            return int(r["prompt_tokens"])
    return None
