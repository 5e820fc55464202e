"""The probe's HTML report: labelled tables, plain-words verdicts and plotly plots.

Plots are drawn by plotly.js, copied once next to the report (``plotly.min.js``)
so the page works offline. For every unstable arm two plots, each with a legend
and axis units:

* max |Δ logprob| per generated token (nats, log scale) of every run against
  the arm's first run; runs whose curves are identical share one trace;
* candidate-set churn per generated token: the share of the first run's top-k
  tokens missing from a run's top-k list (0 = same candidates).
"""

from __future__ import annotations

import html
import shutil
from pathlib import Path

from kvwarden.probe.report import ArmSummary

PLOTLY_JS = "plotly.min.js"

ARM_MEANINGS = {
    "clean": "request B alone, repeated on a fresh server",
    "contaminated": "request A once on the same document, then B repeated: B may reuse blocks A's run wrote",
    "no-cache": "B repeated with prefix caching off: every run computed cold",
    "alone": "B repeated with nothing else running",
    "among-noise": "B repeated while unrelated requests run beside it (different batch partners)",
    "repeat": "B repeated on one fresh server",
    "spec-off": "B repeated without speculative decoding",
    "spec-on": "B repeated with speculative decoding",
}
PAGE_STYLE = """body{font-family:system-ui,sans-serif;margin:2em;max-width:72em}
td,th{border:1px solid #ccc;padding:4px 8px;text-align:left}table{border-collapse:collapse;margin:1em 0}
caption{text-align:left;font-weight:bold;padding:4px 0}tr.unstable td{background:#fde2e2}
tr.error td{background:#eee}tr.stable td{background:#e6f4ea}.note{color:#555;font-size:90%}
.banner{padding:.6em 1em;font-weight:bold;border-radius:4px}.banner.stable{background:#e6f4ea}
.banner.unstable{background:#fde2e2}.banner.error{background:#eee}"""
URL_MEANINGS = {"repeat": "B repeated on the running server (each run isolated by its own cache_salt)"}


def ensure_plotly_js(directory: Path) -> Path:
    """Copy plotly.js next to a report (once) and return its path."""
    from plotly.offline import get_plotlyjs

    target = directory / PLOTLY_JS
    if not target.is_file():
        directory.mkdir(parents=True, exist_ok=True)
        tmp = target.with_suffix(".tmp")
        tmp.write_text(get_plotlyjs())
        shutil.move(tmp, target)
    return target


def verdict_banner(summaries: list[ArmSummary]) -> str:
    """One line on top of the page: stable, which arms differ, or which failed."""
    errors = [s.arm for s in summaries if s.error]
    unstable = [s.arm for s in summaries if not s.error and not s.stable]
    if unstable:
        kind, text = "unstable", f"UNSTABLE: the runs of {', '.join(unstable)} are not bitwise identical"
    elif errors:
        kind, text = "error", f"INCOMPLETE: {', '.join(errors)} failed (see the table)"
    else:
        kind, text = "stable", "STABLE: every arm's runs were bitwise identical"
    return f"<p class='banner {kind}'>{html.escape(text)}</p>"


def context_table(rows: list[tuple[str, str]]) -> str:
    """What was measured: model, server, its block size and budget, prompt lengths, ``max_tokens``, date."""
    cells = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in rows)
    return f"<table><caption>What was measured</caption>{cells}</table>"


def arms_table(caption: str, summaries: list[ArmSummary], url_mode: bool = False) -> str:
    """One row per arm: what it is, N/N identical, first divergent token, cached tokens, verdict."""
    meanings = {**ARM_MEANINGS, **(URL_MEANINGS if url_mode else {})}
    rows = []
    for s in summaries:
        verdict = "error" if s.error else ("stable" if s.stable else "UNSTABLE")
        cached = " ".join("?" if c is None else str(c) for c in s.cached_tokens) or "-"
        first = "-" if s.first_divergent_token is None else str(s.first_divergent_token)
        detail = f": {html.escape(s.error.splitlines()[0][:200])}" if s.error else ""
        rows.append(
            f"<tr class='{verdict.lower()}'><td>{html.escape(s.arm)}</td>"
            f"<td>{html.escape(meanings.get(s.arm, ''))}</td><td>{s.identical}/{s.runs}</td>"
            f"<td>{s.identical_sorted}/{s.runs}</td><td>{first}</td><td>{cached}</td>"
            f"<td>{'yes' if s.texts_identical else 'no'}</td><td>{verdict}{detail}</td></tr>"
        )
    return (
        f"<table><caption>{html.escape(caption)}</caption><tr><th>arm</th><th>what it runs</th>"
        "<th>identical fingerprints (server order)</th><th>identical (sorted by token id)</th>"
        "<th>first divergent generated token</th><th>cached prompt tokens per run</th><th>same text</th>"
        f"<th>verdict</th></tr>{''.join(rows)}</table>"
    )


def cross_arm_html(cross: dict[str, bool], reference: str | None) -> str:
    if not cross or reference is None:
        return "<p class='note'>This scenario compares runs within each arm only.</p>"
    items = "".join(
        f"<li>{html.escape(reference)} vs {html.escape(name)}: first runs "
        f"{'have the same fingerprint' if same else '<b>differ</b>'}</li>"
        for name, same in cross.items()
    )
    return f"<ul>{items}</ul>"


def _grouped(deltas: list[list[float]]) -> list[tuple[str, list[float]]]:
    """Runs with identical curves share one trace: ``("runs 2, 3 vs run 1", curve)``."""
    groups: dict[tuple[float, ...], list[int]] = {}
    for i, d in enumerate(deltas, start=2):
        groups.setdefault(tuple(d), []).append(i)
    return [(f"run{'s' if len(r) > 1 else ''} {', '.join(map(str, r))} vs run 1", list(k)) for k, r in groups.items()]


def arm_plots(summary: ArmSummary, label: str) -> str:
    """The two plots of an unstable arm, as HTML divs (plotly.js must be on the page)."""
    import plotly.graph_objects as go

    if not summary.deltas:
        return ""
    positions = list(range(max(len(d) for d in summary.deltas)))
    delta = go.Figure()
    for name, curve in _grouped(summary.deltas):
        ys = [v if v == v and v > 0 else None for v in curve]  # 0 (identical) and NaN cannot sit on a log axis
        delta.add_trace(go.Scatter(x=positions[: len(ys)], y=ys, mode="lines+markers", name=name))
    delta.update_layout(
        title=f"{label}, arm {summary.arm}: max |Δ logprob| per generated token against run 1",
        xaxis_title="generated token position",
        yaxis_title="max |Δ logprob| over shared top-k tokens (nats)",
        yaxis_type="log",
        legend_title="runs",
        showlegend=True,
        height=380,
    )
    if not any(summary.churn):  # a plot of zeros says nothing a sentence cannot
        return delta.to_html(full_html=False, include_plotlyjs=False) + (
            "<p class='note'>Positions where a run equals run 1 exactly (Δ = 0) have no point on the log axis. "
            "Candidate sets: every run had run 1's top-k tokens at every position (churn 0): the values "
            "moved, not the candidates.</p>"
        )
    churn = go.Figure(
        go.Scatter(x=positions[: len(summary.churn)], y=summary.churn, mode="lines+markers", name="worst run")
    )
    churn.update_layout(
        title=f"{label}, arm {summary.arm}: candidate-set churn per generated token",
        xaxis_title="generated token position",
        yaxis_title="share of run 1's top-k missing (0-1)",
        yaxis_range=[0, 1.05],
        showlegend=True,
        height=320,
    )
    note = (
        "<p class='note'>Positions where a run equals run 1 exactly (Δ = 0) have no point on the log axis. "
        "Churn is the largest over runs 2..N.</p>"
    )
    return (
        delta.to_html(full_html=False, include_plotlyjs=False)
        + churn.to_html(full_html=False, include_plotlyjs=False)
        + note
    )


def page(title: str, body: str, plotly_src: str | None) -> str:
    script = f"<script src='{html.escape(plotly_src)}'></script>" if plotly_src else ""
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        f"{script}<style>{PAGE_STYLE}</style></head><body>"
        f"<h1>{html.escape(title)}</h1>{body}</body></html>"
    )


def write_report(
    path: Path,
    title: str,
    summaries: list[ArmSummary],
    cross: dict[str, bool],
    reference: str | None,
    intro_html: str = "",
    extra_html: str = "",
    plotly_js: Path | None = None,
    context: list[tuple[str, str]] | None = None,
    url_mode: bool = False,
) -> Path:
    """Write a probe run's page; ``plotly_js`` points at a shared copy (default: next to the page, and only
    when the page has plots)."""
    plots = "".join(arm_plots(s, title) for s in summaries if s.deltas)
    src = None
    if plots:
        js = plotly_js or ensure_plotly_js(path.parent)
        src = Path(_relative(js, path.parent)).as_posix()
    body = (
        verdict_banner(summaries)
        + (context_table(context) if context else "")
        + intro_html
        + arms_table(f"{title}: arms, fingerprints and cached tokens", summaries, url_mode)
        + "<h2>Across arms</h2>"
        + cross_arm_html(cross, reference)
        + extra_html
        + "<h2>Unstable arms</h2>"
        + (plots or "<p>None: every arm's runs were bitwise identical.</p>")
    )
    path.write_text(page(title, body, src))
    return path


def _relative(target: Path, start: Path) -> str:
    import os

    return os.path.relpath(target.resolve(), start.resolve())
