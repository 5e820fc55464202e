"""Summaries of a probe run: per-arm stability, first divergent token, cached tokens; table + HTML.

Stability is N/N identical fingerprints of an arm's measured runs (in the
server's order and sorted by token id). Hashes are compared within an arm, and
across the arms a scenario names in ``compare_arms`` (same server settings).
The HTML page plots, for every unstable arm, the max |delta logprob| per token
position against the arm's first run, and the candidate-set churn (the share
of top-k tokens that are not in the first run's list).
"""

from __future__ import annotations

import html
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

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

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d.pop("deltas")
        return d


def _latest(records: list[dict[str, Any]], arm: str) -> tuple[str | None, str | None]:
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
        attempt, error = _latest(records, arm)
        runs = [r for r in records if r.get("type") == "response" and r["arm"] == arm and r["attempt"] == attempt]
        measured = [r for r in runs if r["measured"]]
        if attempt is None or not measured:
            out.append(ArmSummary(arm, 0, 0, 0, False, None, [], False, error or "no completed runs"))
            continue
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
    console = console or Console()
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


def _svg_lines(series: list[list[float]], width: int = 560, height: int = 180, ylabel: str = "") -> str:
    points = [v for s in series for v in s if v == v]
    top = max(points, default=1.0) or 1.0
    n = max((len(s) for s in series), default=1)
    colours = ["#d62728", "#1f77b4", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b"]
    paths = []
    for i, s in enumerate(series):
        pts = [
            f"{40 + (width - 50) * j / max(1, n - 1):.1f},{height - 20 - (height - 35) * (v / top):.1f}"
            for j, v in enumerate(s)
            if v == v
        ]
        if pts:
            colour = colours[i % len(colours)]
            paths.append(f'<polyline fill="none" stroke="{colour}" stroke-width="1.5" points="{" ".join(pts)}"/>')
    return (
        f'<svg width="{width}" height="{height}" xmlns="http://www.w3.org/2000/svg">'
        f'<line x1="40" y1="{height - 20}" x2="{width - 10}" y2="{height - 20}" stroke="#888"/>'
        f'<line x1="40" y1="10" x2="40" y2="{height - 20}" stroke="#888"/>'
        f'<text x="2" y="14" font-size="10">{top:.2g}</text><text x="2" y="{height - 22}" font-size="10">0</text>'
        f'<text x="{width // 2}" y="{height - 4}" font-size="10">token position (0..{n - 1})</text>'
        f'<text x="44" y="20" font-size="10">{html.escape(ylabel)}</text>{"".join(paths)}</svg>'
    )


def write_html(
    path: Path, title: str, summaries: list[ArmSummary], cross: dict[str, bool], extra_html: str = ""
) -> Path:
    rows = []
    for s in summaries:
        verdict = "error" if s.error else ("stable" if s.stable else "UNSTABLE")
        cached = " ".join("?" if c is None else str(c) for c in s.cached_tokens)
        first = "-" if s.first_divergent_token is None else s.first_divergent_token
        rows.append(
            f"<tr class='{verdict.lower()}'><td>{html.escape(s.arm)}</td><td>{s.identical}/{s.runs}</td>"
            f"<td>{s.identical_sorted}/{s.runs}</td><td>{first}</td>"
            f"<td>{cached}</td><td>{verdict}{(': ' + html.escape(s.error)) if s.error else ''}</td></tr>"
        )
    plots = []
    for s in summaries:
        if s.deltas:
            plots.append(f"<h3>{html.escape(s.arm)}: max |&Delta; logprob| vs run 1, per token</h3>")
            plots.append(_svg_lines(s.deltas, ylabel="max |delta logprob|"))
            plots.append(f"<h3>{html.escape(s.arm)}: candidate-set churn (share of top-k not in run 1's)</h3>")
            plots.append(_svg_lines([s.churn], ylabel="churn"))
    cross_html = "".join(
        f"<li>{html.escape(k)}: {'same' if v else 'different'} first fingerprint</li>" for k, v in cross.items()
    )
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>body{{font-family:sans-serif;margin:2em}} td,th{{border:1px solid #ccc;padding:4px 8px}}
table{{border-collapse:collapse}} tr.unstable td{{background:#fde2e2}} tr.error td{{background:#eee}}
tr.stable td{{background:#e6f4ea}}</style></head><body>
<h1>{html.escape(title)}</h1>
<table><tr><th>arm</th><th>identical (order)</th><th>identical (sorted)</th><th>first divergent token</th>
<th>cached tokens per run</th><th>verdict</th></tr>{"".join(rows)}</table>
<h2>Across arms</h2><ul>{cross_html or "<li>(none compared)</li>"}</ul>
{extra_html}
<h2>Unstable arms</h2>{"".join(plots) or "<p>none</p>"}
</body></html>"""
    path.write_text(page)
    return path
