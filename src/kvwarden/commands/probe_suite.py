"""``kvwarden probe --suite``: a task suite's accuracy, answer agreement and logit stability, per arm.

Exit status as the probe's: 0 every task's logits stable in every arm, 1 some
not, 2 an arm could not run (or bad arguments).
"""

from __future__ import annotations

import argparse
import difflib
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

from rich.markup import escape

from kvwarden.console import wide_console
from kvwarden.probe.invoices import SUITES
from kvwarden.probe.reachable import check_reachable

if TYPE_CHECKING:
    from kvwarden.probe.launchers import ServerSettings
    from kvwarden.probe.runner import Target
    from kvwarden.probe.suite import Task


def load_tasks(spec: str, limit: int | None) -> list[Task]:
    """A built-in suite by name or a JSONL file, cut to the first ``limit`` tasks."""
    from kvwarden.probe.invoices import builtin_suite
    from kvwarden.probe.suite import load_suite

    if spec in SUITES:
        tasks = builtin_suite(spec)
    elif Path(spec).suffix != ".jsonl" and not Path(spec).exists():
        near = difflib.get_close_matches(spec, SUITES, n=1)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        raise ValueError(f"--suite: {spec!r} is neither a built-in suite ({', '.join(SUITES)}) nor a .jsonl file{hint}")
    else:
        tasks = load_suite(spec)
    if limit is not None:
        if limit < 1:
            raise ValueError(f"--tasks must be >= 1, got {limit}")
        tasks = tasks[:limit]
    return tasks


def run_suite_command(args: argparse.Namespace, settings: ServerSettings, target: Target, model: str | None) -> int:
    from kvwarden.probe.suite_report import (
        print_suite_table,
        suite_context,
        suite_exit_status,
        suite_verdict,
        summarize_suite,
        write_suite_report,
    )
    from kvwarden.probe.suite_runner import Suite, run_suite, suite_arms

    tasks = load_tasks(args.suite, args.tasks)
    style = args.constraint_field or "auto"
    if style == "auto":
        style = "json_schema" if args.launcher == "llama.cpp" else "response_format"
    suite = Suite(
        name=Path(args.suite).stem if args.suite not in SUITES else args.suite,
        tasks=tuple(tasks),
        arms=suite_arms(settings, url_mode=args.url is not None),
        repeats=3 if args.repeats is None else args.repeats,
        max_tokens=48 if args.max_tokens is None else args.max_tokens,
        constraint=style,
    )
    if args.url:
        check_reachable(args.url, args.api_key)  # the flags are checked: now the server, before a run directory
    out = args.out or Path("runs") / f"suite-{suite.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    console = wide_console(stderr=args.json)
    documents = len({t.document for t in tasks})
    console.print(
        f"kvwarden probe: suite {suite.name}, {len(tasks)} tasks on {documents} documents, {suite.repeats} runs "
        f"each, arms {', '.join(a.name for a in suite.arms)} -> {out}"
    )
    records = run_suite(suite, target, out, show_progress=not args.no_progress)
    summaries = summarize_suite(records, suite)
    title = f"probe suite {suite.name} ({args.launcher or args.url})"
    context = suite_context(suite, records, args.launcher, model)
    write_suite_report(out / "report.html", title, suite, summaries, context)
    summary = {"run_dir": str(out), "suite": suite.name, "arms": [s.to_dict() for s in summaries]}
    (out / "summary.json").write_text(json.dumps(summary, indent=2, ensure_ascii=False))
    print_suite_table(title, summaries, console)
    _, verdict = suite_verdict(summaries)
    console.print(f"  verdict: {escape(verdict)}")
    if args.json:
        brief = {**summary, "arms": [{k: v for k, v in a.items() if k != "per_task"} for a in summary["arms"]]}
        print(json.dumps(brief, ensure_ascii=False))
    console.print(f"report: {out / 'report.html'}")
    return suite_exit_status(summaries)
