"""Summaries of a probe run: per-arm stability, first divergent token, cached tokens; terminal table.

Stability is N/N identical fingerprints of an arm's measured runs (in the
server's order and sorted by token id). Hashes are compared within an arm, and
across the arms a scenario names in ``compare_arms`` (same server settings).
For unstable arms the per-position max |delta logprob| against the first run
and the candidate-set churn are kept for the HTML page (``html_report.py``).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.table import Table

from kvwarden.console import wide_console
from kvwarden.probe.fingerprint import first_divergence


@dataclass
class ArmSummary:
    arm: str
    runs: int
    identical: int  # runs sharing the most common ordered fingerprint
    identical_sorted: int
    stable: bool
    first_divergent_token: int | None
    cached_tokens: list[int | None]
    texts_identical: bool
    error: str | None = None
    deltas: list[list[float]] = field(default_factory=list)  # per other run: max |delta| per position
    churn: list[float] = field(default_factory=list)  # per position, max over runs
    fingerprints: list[str] = field(default_factory=list)
    server: dict[str, Any] = field(default_factory=dict)  # what the server reported (block size, budget)

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d.pop("deltas")
        return d


def latest_attempt(records: list[dict[str, Any]], arm: str) -> tuple[str | None, str | None]:
    """(attempt whose arm finished, error of the last failed attempt)."""
    done = [r["attempt"] for r in records if r.get("arm") == arm and r.get("type") == "arm_done"]
    errors = [r for r in records if r.get("arm") == arm and r.get("type") == "arm_error"]
    if done:
        return done[-1], None
    return None, (
        errors[-1]["error"] + ("\n" + errors[-1]["log_tail"] if errors[-1].get("log_tail") else "")
    ) if errors else None


def _tops(r: dict[str, Any]) -> list[list[tuple[Any, float]]]:
    return [[(k, v) for k, v in top] for top in r["tops"]]


def _deltas(
    base: list[list[tuple[Any, float]]], other: list[list[tuple[Any, float]]]
) -> tuple[list[float], list[float]]:
    deltas, churn = [], []
    for x, y in zip(base, other, strict=False):
        dx, dy = dict(x), dict(y)
        common = set(dx) & set(dy)
        deltas.append(max((abs(dx[k] - dy[k]) for k in common), default=float("nan")))
        churn.append(1.0 - len(common) / max(1, len(dx)))
    return deltas, churn


def summarize(records: list[dict[str, Any]], arms: list[str]) -> list[ArmSummary]:
    out = []
    for arm in arms:
        attempt, error = latest_attempt(records, arm)
        runs = [r for r in records if r.get("type") == "response" and r["arm"] == arm and r["attempt"] == attempt]
        measured = [r for r in runs if r["measured"]]
        if attempt is None or not measured:
            out.append(ArmSummary(arm, 0, 0, 0, False, None, [], False, error or "no completed runs"))
            continue
        info = next((r["info"] for r in records if r.get("type") == "server_info" and r["attempt"] == attempt), {})
        fps = [r["fingerprint"] for r in measured]
        common = Counter(fps).most_common(1)[0][1]
        common_sorted = Counter(r["fingerprint_sorted"] for r in measured).most_common(1)[0][1]
        base = _tops(measured[0])
        divergences = [first_divergence(base, _tops(r)) for r in measured[1:]]
        firsts = [d for d in divergences if d is not None]
        summary = ArmSummary(
            arm=arm,
            runs=len(measured),
            identical=common,
            identical_sorted=common_sorted,
            stable=common == len(measured),
            first_divergent_token=min(firsts) if firsts else None,
            cached_tokens=[r["cached_tokens"] for r in measured],
            texts_identical=len({r["text_sha256"] for r in measured}) == 1,
            fingerprints=fps,
            server=info,
        )
        if not summary.stable:
            churn: list[float] = []
            for r in measured[1:]:
                d, c = _deltas(base, _tops(r))
                summary.deltas.append(d)
                churn = [max(a, b) for a, b in zip(churn, c, strict=False)] + c[len(churn) :] if churn else c
            summary.churn = churn
        out.append(summary)
    return out


def cross_arm(summaries: list[ArmSummary], names: tuple[str, ...]) -> dict[str, bool]:
    """Whether the first measured run of each named arm matches the first named arm's."""
    by = {s.arm: s for s in summaries}
    if not names or names[0] not in by or not by[names[0]].fingerprints:
        return {}
    ref = by[names[0]].fingerprints[0]
    return {n: bool(by[n].fingerprints) and by[n].fingerprints[0] == ref for n in names[1:] if n in by}


def contamination_verdict(summaries: list[ArmSummary]) -> tuple[bool, bool]:
    """Observed (repeats stable, history dependent) of a contamination run, as the predictor states them.

    B's repeats after A are stable if the contaminated arm is; B's runs are
    history-dependent if any of them differs from B's first run in the clean arm.
    """
    by = {s.arm: s for s in summaries}
    clean, cont = by["clean"], by["contaminated"]
    if clean.error or cont.error:
        raise ValueError(f"arm failed: {clean.error or cont.error}")
    reference = clean.fingerprints[0]
    return cont.stable, any(fp != reference for fp in cont.fingerprints)


def print_table(title: str, summaries: list[ArmSummary], console: Console | None = None) -> None:
    console = console or wide_console()
    table = Table(title=title)
    for col in (
        "arm",
        "identical (order)",
        "identical (sorted)",
        "first divergent token",
        "cached tokens per run",
        "text same",
        "verdict",
    ):
        table.add_column(col)
    for s in summaries:
        if s.error:
            table.add_row(s.arm, "-", "-", "-", "-", "-", f"[red]error[/red]: {s.error.splitlines()[0][:60]}")
            continue
        verdict = "[green]stable[/green]" if s.stable else "[red]UNSTABLE[/red]"
        table.add_row(
            s.arm,
            f"{s.identical}/{s.runs}",
            f"{s.identical_sorted}/{s.runs}",
            "-" if s.first_divergent_token is None else str(s.first_divergent_token),
            " ".join("?" if c is None else str(c) for c in s.cached_tokens),
            "yes" if s.texts_identical else "no",
            verdict,
        )
    console.print(table)
