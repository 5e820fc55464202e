"""The end of a probe run: from raw records to ``summary.json``, ``report.html`` and an exit status.

Used by ``kvwarden probe`` and ``kvwarden demo`` alike, so every run directory
holds the same files: ``records.jsonl`` (raw), ``scenario.json``, ``logs/``,
``summary.json`` (per-arm verdicts, what each server reported, the
predictor's cached tokens beside the observed ones) and ``report.html``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvwarden.probe.crosscheck import CacheCheck, check_contamination, model_is_hybrid, rule_for
from kvwarden.probe.html_report import write_report
from kvwarden.probe.report import ArmSummary, cross_arm, summarize
from kvwarden.probe.scenario import Scenario


@dataclass
class RunResult:
    run_dir: Path
    title: str
    summaries: list[ArmSummary]
    cross: dict[str, bool]
    check: CacheCheck | str  # the predictor's cached tokens, or why there is no prediction

    @property
    def exit_status(self) -> int:
        """0 every arm stable, 1 some arm unstable, 2 some arm could not run."""
        if any(s.error for s in self.summaries):
            return 2
        return 0 if all(s.stable for s in self.summaries) else 1

    def to_dict(self) -> dict[str, Any]:
        return {
            "run_dir": str(self.run_dir),
            "arms": [s.to_dict() for s in self.summaries],
            "cross_arm": self.cross,
            "prediction": self.check.to_dict() if isinstance(self.check, CacheCheck) else {"skipped": self.check},
        }

    def arm(self, name: str) -> ArmSummary:
        return next(s for s in self.summaries if s.arm == name)


def predict_run(
    launcher: str | None, model: str | None, scenario: Scenario, records: list[dict], summaries: list[ArmSummary]
) -> CacheCheck | str:
    """The predictor's cached tokens for this run, with the block size the server reported."""
    hybrid = model_is_hybrid(model)
    server = next((s.server for s in summaries if s.server), {})
    rule = rule_for(launcher, server, hybrid)
    if rule is None or hybrid is None:
        return f"no scheduling model for {launcher or 'a server at --url'} serving this model"
    labels = server.get("labels", {})
    spec = int(labels.get("num_speculative_tokens", 0)) if launcher == "kvwarden" else 0
    return check_contamination(scenario, records, summaries, rule, hybrid, spec)


def finish_run(
    run_dir: Path,
    scenario: Scenario,
    records: list[dict[str, Any]],
    title: str,
    launcher: str | None,
    model: str | None,
    intro_html: str = "",
    plotly_js: Path | None = None,
) -> RunResult:
    """Summarise, cross-check with the predictor, write ``summary.json`` and ``report.html``."""
    summaries = summarize(records, [a.name for a in scenario.arms])
    cross = cross_arm(summaries, scenario.compare_arms)
    check = predict_run(launcher, model, scenario, records, summaries)
    result = RunResult(run_dir, title, summaries, cross, check)
    (run_dir / "summary.json").write_text(json.dumps(result.to_dict(), indent=2))
    extra = f"<h2>Predictor</h2><p>{_html(check)}</p>"
    reference = scenario.compare_arms[0] if scenario.compare_arms else None
    context = _context(scenario, records, launcher, model)
    write_report(
        run_dir / "report.html", title, summaries, cross, reference, intro_html, extra, plotly_js, context,
        url_mode=launcher is None,
    )  # fmt: skip
    return result


def _context(
    scenario: Scenario, records: list[dict[str, Any]], launcher: str | None, model: str | None
) -> list[tuple[str, str]]:
    """The report's "what was measured" rows, from the scenario and what the server said it runs."""
    import time

    info = next((r["info"] for r in records if r.get("type") == "server_info"), {})
    runs = max((a.steps[a.measured_step].repeat for a in scenario.arms if a.steps), default=0)
    rows = [
        ("date", time.strftime("%Y-%m-%d %H:%M %Z")),
        ("model", model or info.get("model") or "as served"),
        ("server", f"started fresh per arm by the {launcher} launcher" if launcher else "a running server (--url)"),
        ("block size", f"{info.get('block_size', '?')} ({info.get('block_size_source', '?')})"),
        ("step budget", f"{info.get('max_num_batched_tokens', '?')} ({info.get('budget_source', '?')})"),
        ("runs per arm", str(runs)),
        ("max_tokens", str(scenario.max_tokens)),
    ]
    shape = scenario.notes.get("shape")
    if shape:
        unit = "tokens" if scenario.notes.get("token_prompts") else "words"
        rows.append(("prompts", f"A {shape['a_len']}, B {shape['b_len']}, shared {shape['shared']} {unit}"))
    return rows


def _html(check: CacheCheck | str) -> str:
    import html

    if isinstance(check, str):
        return f"No prediction: {html.escape(check)}."
    return html.escape(check.describe()) + f"<br><span class='note'>{html.escape(check.explanation)}</span>"
