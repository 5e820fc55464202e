"""``kvwarden demo``: the contamination scenario, predicted and measured, in a few minutes.

On a built-in hybrid model, three kvwarden servers are probed with the
contamination scenario (arms clean / contaminated / no-cache, a fresh server
per arm): vLLM's align rule with vendor-style numerics (the production bug),
the one-line fix, and kvwarden's defaults. Beside each, the predictor's verdict
for the same lengths. Ends with the path of the HTML report.
"""

from __future__ import annotations

import argparse
import html
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

CONFIGS = (
    ("legacy-align + shape-dependent", "legacy-align", "shape-dependent", "vllm-align"),
    ("legacy-align-fixed + shape-dependent", "legacy-align-fixed", "shape-dependent", "vllm-align-fixed"),
    ("kvwarden defaults", "kvwarden", "canonical", "kvwarden"),
)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo", help="the contamination scenario: legacy rule vs fix vs kvwarden, predicted and measured"
    )
    p.add_argument(
        "--model", default="builtin:qwen3_next-tiny", help="a hybrid model (default: built-in Qwen3-Next tiny)"
    )
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--a-len", type=int, default=28, help="A: just below two blocks")
    p.add_argument("--b-len", type=int, default=44)
    p.add_argument("--shared", type=int, default=24)
    p.add_argument("--num-speculative-tokens", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path, default=None)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvwarden.models.sources import resolve_model
    from kvwarden.models.tokenizer import Tokenizer
    from kvwarden.probe.builtin import Shape, build, prompts
    from kvwarden.probe.launchers import KvwardenLauncher, ServerSettings
    from kvwarden.probe.predict import predict_pair
    from kvwarden.probe.report import contamination_verdict, cross_arm, summarize, write_html
    from kvwarden.probe.runner import Target, run_probe

    console = Console(width=None if Console().is_terminal else 150)
    model = str(resolve_model(args.model))
    tokenizer = Tokenizer.from_dir(model)
    shape = Shape(a_len=args.a_len, b_len=args.b_len, shared=args.shared)
    a, b = prompts(shape, tokenizer)
    out = args.out or Path("runs") / f"demo-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    console.print(
        f"[bold]kvwarden demo[/bold]: contamination scenario on {args.model}: A = {len(a)} tokens, "
        f"B = {len(b)} tokens, sharing {args.shared}; block {args.block_size}, "
        f"speculative pull-back {args.num_speculative_tokens}; {args.repeats} runs of B per arm; a fresh server per arm"
    )
    rows, sections = [], []
    for label, chunking, numerics, rule in CONFIGS:
        settings = ServerSettings(
            block_size=args.block_size,
            max_num_batched_tokens=max(len(a), len(b)) + 64,
            chunking=chunking,
            numerics=numerics,
            num_speculative_tokens=args.num_speculative_tokens,
        )
        scenario = build("contamination", settings, tokenizer, shape, args.repeats, max_tokens=6)
        run_dir = out / chunking / numerics
        console.print(f"\n[bold]{label}[/bold] -> {run_dir}")
        records = run_probe(scenario, Target(launcher=KvwardenLauncher(), model=model, tokenizer=tokenizer), run_dir)
        summaries = summarize(records, [arm.name for arm in scenario.arms])
        cross = cross_arm(summaries, scenario.compare_arms)
        write_html(run_dir / "report.html", f"{label}", summaries, cross)
        pred = predict_pair(rule, args.block_size, len(a), len(b), args.shared, args.num_speculative_tokens)
        cont = next(s for s in summaries if s.arm == "contaminated")
        errors = [s.arm for s in summaries if s.error]
        observed_stable, observed_history = contamination_verdict(summaries) if not errors else (False, True)
        match = pred.repeats_stable == observed_stable and pred.history_dependent == observed_history
        rows.append((label, pred, cont, observed_history, match, errors, summaries))
        sections.append(
            f'<li><a href="{html.escape(str(run_dir.relative_to(out)))}/report.html">{html.escape(label)}</a></li>'
        )
    table = Table(title="contamination: predicted vs observed")
    for col in (
        "configuration",
        "predicted",
        "observed (contaminated arm)",
        "cached tokens (B runs)",
        "clean / no-cache",
        "match",
    ):
        table.add_column(col)
    page_rows = []
    for label, pred, cont, history, match, errors, summaries in rows:
        predicted = f"{_stable(pred.repeats_stable)}, {_history(pred.history_dependent)}"
        observed = f"{cont.identical}/{cont.runs} identical, {_history(history)}"
        if cont.first_divergent_token is not None:
            observed += f", first divergent token {cont.first_divergent_token}"
        others = ", ".join(f"{s.arm} {s.identical}/{s.runs}" for s in summaries if s.arm != "contaminated")
        cached = " ".join(str(c) for c in cont.cached_tokens)
        verdict = "[green]yes[/green]" if match and not errors else "[red]NO[/red]"
        table.add_row(label, predicted, observed, cached, others, verdict)
        page_rows.append(
            f"<tr><td>{html.escape(label)}</td><td>{html.escape(predicted)}</td><td>{html.escape(observed)}</td>"
            f"<td>{cached}</td><td>{html.escape(others)}</td><td>{'yes' if match else 'NO'}</td></tr>"
            f"<tr><td colspan='6'><small>{html.escape(pred.explanation)}</small></td></tr>"
        )
    console.print()
    console.print(table)
    extra = (
        "<h2>Predicted vs observed</h2><table><tr><th>configuration</th><th>predicted</th><th>observed</th>"
        f"<th>cached tokens</th><th>other arms</th><th>match</th></tr>{''.join(page_rows)}</table>"
        f"<h2>Per-configuration reports</h2><ul>{''.join(sections)}</ul>"
    )
    last = rows[0][6]
    page = write_html(out / "report.html", "kvwarden demo: contamination scenario", last, {}, extra)
    console.print(f"\nHTML report: {page.resolve()}")
    return 0 if all(r[4] and not r[5] for r in rows) else 1


def _stable(stable: bool) -> str:
    return "stable" if stable else "UNSTABLE"


def _history(dependent: bool) -> str:
    return "history-dep." if dependent else "history-indep."
