"""A suite run's three measures side by side: accuracy, answer agreement, logit stability.

Per task and arm: **accuracy** (runs whose parsed answer has every expected
field right), **answers agree** (every run gave the same parsed JSON, the
quality suite's measure) and **logits stable** (every run's top-20 logprob
fingerprints identical, the probe's measure). A task whose answers agree while
its logits do not is the case the measures disagree on: the text is no evidence
that nothing moved. Per arm the same three, counted over tasks, and how many
tasks' answers differ from the first arm's.
"""

from __future__ import annotations

import html
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kvwarden.probe.fingerprint import first_divergence
from kvwarden.probe.html_report import context_table, page
from kvwarden.probe.report import latest_attempt
from kvwarden.probe.suite import Task, answer_key
from kvwarden.probe.suite_runner import ARM_MEANINGS, Suite


@dataclass
class TaskResult:
    task: str
    runs: int
    correct: int
    answers_agree: bool
    logits_stable: bool
    first_divergent_token: int | None
    answer: str  # the first run's, canonical
    cached_tokens: list[int | None]

    @property
    def hidden_drift(self) -> bool:
        """Same answers, different logits: what an answer-level suite cannot see."""
        return self.answers_agree and not self.logits_stable


@dataclass
class SuiteArmSummary:
    arm: str
    tasks: list[TaskResult] = field(default_factory=list)
    error: str | None = None
    changed_vs_reference: int | None = None  # tasks whose first answer differs from the first arm's

    @property
    def accuracy(self) -> float:
        runs = sum(t.runs for t in self.tasks)
        return sum(t.correct for t in self.tasks) / runs if runs else 0.0

    def count(self, what: str) -> int:
        return sum(1 for t in self.tasks if getattr(t, what))

    def to_dict(self) -> dict[str, Any]:
        return {
            "arm": self.arm,
            "error": self.error,
            "tasks": len(self.tasks),
            "accuracy": round(self.accuracy, 4),
            "answers_agree": self.count("answers_agree"),
            "logits_stable": self.count("logits_stable"),
            "same_answers_different_logits": self.count("hidden_drift"),
            "answers_changed_vs_reference": self.changed_vs_reference,
            "per_task": [{**asdict(t), "hidden_drift": t.hidden_drift} for t in self.tasks],
        }


def summarize_suite(records: list[dict[str, Any]], suite: Suite) -> list[SuiteArmSummary]:
    out: list[SuiteArmSummary] = []
    for arm in suite.arms:
        attempt, error = latest_attempt(records, arm.name)
        runs = [r for r in records if r.get("type") == "response" and r["arm"] == arm.name and r["attempt"] == attempt]
        summary = SuiteArmSummary(arm.name, error=error if attempt is None else None)
        short = []
        for task in suite.tasks:
            mine = [r for r in runs if r.get("task") == task.id]
            if len(mine) != suite.repeats:
                short.append(f"{task.id} ({len(mine)} of {suite.repeats} runs)")
            if mine:
                summary.tasks.append(_task_result(task, mine))
        if attempt is None and summary.error is None:
            summary.error = "no completed runs"
        elif summary.error is None and short:  # a verdict over fewer runs than asked would overstate stability
            summary.error = f"incomplete records: {', '.join(short[:5])}{' ...' if len(short) > 5 else ''}"
        out.append(summary)
    reference = next((s for s in out if not s.error), None)
    if reference is not None:
        first = {t.task: t.answer for t in reference.tasks}
        for s in out:
            if not s.error:
                s.changed_vs_reference = sum(1 for t in s.tasks if t.task in first and t.answer != first[t.task])
    return out


def _task_result(task: Task, runs: list[dict[str, Any]]) -> TaskResult:
    prints = [r["fingerprint"] for r in runs]
    answers = [answer_key(r["text"]) for r in runs]
    first = None
    if len(set(prints)) > 1:
        base = [[tuple(e) for e in top] for top in runs[0]["tops"]]
        firsts = [first_divergence(base, [[tuple(e) for e in top] for top in r["tops"]]) for r in runs[1:]]
        first = min((f for f in firsts if f is not None), default=None)
    return TaskResult(
        task.id, len(runs), sum(1 for r in runs if r.get("correct")), len(set(answers)) == 1, len(set(prints)) == 1,
        first, answers[0], [r.get("cached_tokens") for r in runs],
    )  # fmt: skip


def suite_exit_status(summaries: list[SuiteArmSummary]) -> int:
    """0 every task's logits stable in every arm, 1 some not, 2 an arm could not run."""
    if any(s.error for s in summaries) or not any(s.tasks for s in summaries):
        return 2
    return 0 if all(t.logits_stable for s in summaries for t in s.tasks) else 1


def print_suite_table(title: str, summaries: list[SuiteArmSummary], console: Console) -> None:
    table = Table(title=title)
    for column in ("arm", "accuracy", "answers agree", "logits stable", "same answers, other logits", "vs first arm"):
        table.add_column(column)
    for s in summaries:
        if s.error:
            table.add_row(s.arm, "-", "-", "-", "-", f"[red]error: {escape(s.error.splitlines()[0][:80])}[/red]")
            continue
        n = len(s.tasks)
        drift = s.count("hidden_drift")
        table.add_row(
            s.arm, f"{s.accuracy:.0%}", f"{s.count('answers_agree')}/{n}",
            ("[green]" if s.count("logits_stable") == n else "[red]") + f"{s.count('logits_stable')}/{n}",
            ("[red]" if drift else "") + str(drift), f"{s.changed_vs_reference} answers differ",
        )  # fmt: skip
    console.print(table)


def suite_verdict(summaries: list[SuiteArmSummary]) -> tuple[str, str]:
    errors = [s.arm for s in summaries if s.error]
    unstable = {s.arm: len(s.tasks) - s.count("logits_stable") for s in summaries if not s.error}
    drift = sum(s.count("hidden_drift") for s in summaries if not s.error)
    if any(unstable.values()):
        where = ", ".join(f"{arm} ({n} tasks)" for arm, n in unstable.items() if n)
        extra = f"; in {drift} of them the answers agreed while the logits moved" if drift else ""
        return "unstable", f"UNSTABLE: logits moved between runs in {where}{extra}"
    if errors:
        return "error", f"INCOMPLETE: {', '.join(errors)} failed"
    return "stable", "STABLE: every task's runs had bitwise identical top-20 logprobs in every arm"


def write_suite_report(
    path: Path, title: str, suite: Suite, summaries: list[SuiteArmSummary], context: list[tuple[str, str]]
) -> None:
    kind, text = suite_verdict(summaries)
    body = f"<p class='banner {kind}'>{html.escape(text)}</p>" + context_table(context)
    body += _overview(summaries)
    tasks = {t.id: t for t in suite.tasks}
    for s in summaries:
        body += f"<h2>Arm {html.escape(s.arm)}</h2><p class='note'>{html.escape(ARM_MEANINGS.get(s.arm, ''))}</p>"
        body += _arm_table(s, tasks) if not s.error else f"<p>Could not run: {html.escape(s.error)}</p>"
    path.write_text(page(title, body, None))


def _overview(summaries: list[SuiteArmSummary]) -> str:
    rows = []
    for s in summaries:
        if s.error:
            rows.append(f"<tr class='error'><td>{html.escape(s.arm)}</td><td colspan='5'>error</td></tr>")
            continue
        n, stable = len(s.tasks), s.count("logits_stable")
        rows.append(
            f"<tr class='{'stable' if stable == n else 'unstable'}'><td>{html.escape(s.arm)}</td>"
            f"<td>{s.accuracy:.1%}</td><td>{s.count('answers_agree')}/{n}</td><td>{stable}/{n}</td>"
            f"<td>{s.count('hidden_drift')}</td><td>{s.changed_vs_reference}</td></tr>"
        )
    return (
        "<table><caption>Per arm: the three measures over all tasks</caption><tr><th>arm</th>"
        "<th>accuracy (runs with every expected field right)</th><th>tasks whose answers agree across runs</th>"
        "<th>tasks whose top-20 logprobs are bitwise stable</th><th>same answers, other logits</th>"
        f"<th>tasks whose answer differs from the first arm's</th></tr>{''.join(rows)}</table>"
    )


def _arm_table(s: SuiteArmSummary, tasks: dict[str, Task]) -> str:
    rows = []
    for t in s.tasks:
        task = tasks[t.task]
        cls = "stable" if t.logits_stable else "unstable"
        first = "-" if t.first_divergent_token is None else str(t.first_divergent_token)
        cached = " ".join("?" if c is None else str(c) for c in t.cached_tokens)
        rows.append(
            f"<tr class='{cls}'><td>{html.escape(t.task)}</td><td>{html.escape(task.question)}</td>"
            f"<td><code>{html.escape(json.dumps(task.expected, ensure_ascii=False))}</code></td>"
            f"<td><code>{html.escape(t.answer[:160])}</code></td><td>{t.correct}/{t.runs}</td>"
            f"<td>{'yes' if t.answers_agree else 'no'}</td><td>{'yes' if t.logits_stable else 'NO'}</td>"
            f"<td>{first}</td><td>{cached}</td></tr>"
        )
    return (
        f"<table><caption>Arm {html.escape(s.arm)}: one row per task</caption><tr><th>task</th><th>question</th>"
        "<th>expected</th><th>first run's answer</th><th>correct runs</th><th>answers agree</th>"
        "<th>logits stable</th><th>first divergent token</th><th>cached prompt tokens per run</th></tr>"
        f"{''.join(rows)}</table>"
    )


def suite_context(suite: Suite, records: list[dict[str, Any]], launcher: str | None, model: str | None) -> list:
    info = next((r["info"] for r in records if r.get("type") == "server_info"), {})
    documents = len({t.document for t in suite.tasks})
    return [
        ("date", time.strftime("%Y-%m-%d %H:%M %Z")),
        ("model", model or info.get("model") or "as served"),
        ("server", f"started fresh per arm by the {launcher} launcher" if launcher else "a running server (--url)"),
        ("block size", f"{info.get('block_size', '?')} ({info.get('block_size_source', '?')})"),
        ("suite", f"{suite.name}: {len(suite.tasks)} tasks on {documents} documents"),
        ("runs per task and arm", str(suite.repeats)),
        ("max_tokens", str(suite.max_tokens)),
        ("answer schema sent as", suite.constraint),
    ]
