"""Running a task suite: every task N times in every arm, one record per response with its answer scored.

The run directory holds ``tasks.jsonl`` (the tasks with their ground truth), ``records.jsonl`` (one
record per response, with its parsed answer and whether it is correct), ``logs/`` and the reports.
The arms are the contamination scenario's, applied to a whole suite:

* ``clean``: each task's runs see only their own cached blocks (a ``cache_salt`` per task), as if every
  task had a server of its own;
* ``contaminated``: the tasks in suite order on one server, so a task reuses the blocks another task on
  the same document wrote - what a production server does;
* ``no-cache``: every run computed cold (prefix caching off on a launched server; a ``cache_salt`` per
  run on a running one).

llama.cpp's server ignores ``cache_salt``: there ``clean`` runs as ``contaminated`` does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.progress import Progress

from kvwarden.probe.client import Client
from kvwarden.probe.launchers import ServerSettings
from kvwarden.probe.runner import RecordLog, Target, guarded_arm, response_record
from kvwarden.probe.suite import Task, constraint_body, is_correct, load_suite, parse_answer, write_suite

ISOLATION = {"clean": "task", "contaminated": "shared", "no-cache": "run"}
ARM_MEANINGS = {
    "clean": "each task's runs reuse only their own cached blocks (a cache_salt per task)",
    "contaminated": "the tasks in order on one server: a task may reuse blocks another task on its document wrote",
    "no-cache": "every run computed cold",
}


@dataclass(frozen=True)
class SuiteArm:
    name: str
    server: ServerSettings
    isolation: str  # task | shared | run: which requests may share cached blocks


@dataclass(frozen=True)
class Suite:
    """A suite run: the tasks, the arms, and how each request is made."""

    name: str
    tasks: tuple[Task, ...]
    arms: tuple[SuiteArm, ...]
    repeats: int = 3
    max_tokens: int = 48
    top_logprobs: int = 20
    constraint: str = "response_format"  # how the schema is sent (suite.constraint_body)


def suite_arms(base: ServerSettings, url_mode: bool) -> tuple[SuiteArm, ...]:
    """clean, contaminated and no-cache (on a running server no-cache is a salt per run)."""
    no_cache = base if url_mode else base.replace(prefix_caching=False)
    return (
        SuiteArm("clean", base, "task"),
        SuiteArm("contaminated", base, "shared"),
        SuiteArm("no-cache", no_cache, "run"),
    )


def run_suite(suite: Suite, target: Target, run_dir: Path, show_progress: bool = True) -> list[dict[str, Any]]:
    """Run every arm not yet done in ``run_dir`` (an interrupted run resumes by arm); returns all records."""
    if suite.repeats < 2:
        raise ValueError("--repeats must be >= 2 (agreement needs at least two runs)")
    _refuse_other_run(suite, run_dir)
    log = RecordLog(run_dir / "records.jsonl")
    done = {r["arm"] for r in log.read() if r.get("type") == "arm_done"}
    (run_dir / "scenario.json").write_text(json.dumps(_describe(suite), indent=2, ensure_ascii=False))
    write_suite(list(suite.tasks), run_dir / "tasks.jsonl")  # the exact tasks, ground truth included
    with Progress(disable=not show_progress, transient=False) as progress:
        for arm in suite.arms:
            if arm.name in done:
                continue
            task = progress.add_task(arm.name, total=len(suite.tasks) * suite.repeats) if show_progress else None

            advance = (lambda task=task: progress.advance(task)) if task is not None else None

            def body(
                url: str, extra: dict[str, Any], attempt: str, arm: SuiteArm = arm, advance: Any = advance
            ) -> None:
                _run_tasks(suite, arm, target, log, attempt, url, extra, advance)

            guarded_arm(arm.name, arm.server, target, log, run_dir, body)
    return log.read()


def _refuse_other_run(suite: Suite, run_dir: Path) -> None:
    """Resume only the same suite run: a directory holding another run's records (a scenario, other tasks,
    repeats or settings) would otherwise mix them into this one's verdicts."""
    described = run_dir / "scenario.json"
    if not described.is_file() and not (run_dir / "records.jsonl").is_file():
        return
    before = json.loads(described.read_text()) if described.is_file() else {}
    now = json.loads(json.dumps(_describe(suite), ensure_ascii=False))
    differs = sorted(k for k in now.keys() | before.keys() if before.get(k) != now.get(k))
    tasks = run_dir / "tasks.jsonl"
    if not differs and tasks.is_file() and [t.id for t in load_suite(tasks)] != [t.id for t in suite.tasks]:
        differs = ["tasks"]
    if differs:
        raise ValueError(
            f"--out: {run_dir} holds another run (it differs in {', '.join(differs)}); give a new --out "
            "(a directory is resumed only by the same suite, tasks and settings)"
        )


def _run_tasks(
    suite: Suite, arm: SuiteArm, target: Target, log: RecordLog, attempt: str, url: str, extra: dict, advance: Any
) -> None:
    client = Client(url, target.api_key)
    try:
        model = target.served_name or client.model_name()
        for task in suite.tasks:
            body = {**extra, **constraint_body(task.schema, suite.constraint)}
            for run in range(suite.repeats):
                if arm.isolation != "shared":
                    scope = task.id if arm.isolation == "task" else f"{task.id}-{run}"
                    body["cache_salt"] = f"{arm.name}-{attempt}-{scope}"
                resp = client.complete(model, task.prompt, suite.max_tokens, suite.top_logprobs, body)
                record = response_record(arm.name, attempt, 0, run, True, task.id, resp)
                answer = parse_answer(resp.text)
                record.update(task=task.id, answer=answer, correct=is_correct(answer, task.expected))
                log.append(record)
                if advance is not None:
                    advance()
    finally:
        client.close()


def _describe(s: Suite) -> dict[str, Any]:
    return {
        "name": s.name,
        "suite": True,
        "tasks": len(s.tasks),
        "repeats": s.repeats,
        "max_tokens": s.max_tokens,
        "top_logprobs": s.top_logprobs,
        "constraint": s.constraint,
        "arms": [{"name": a.name, "isolation": a.isolation, "server": a.server.__dict__} for a in s.arms],
    }
