"""``kvwarden demo``'s sparse-attention rows: the first incident (a key selection that keeps equal scores in
arrival order) and kvwarden's deterministic top-k, on a GLM-5-style model.

Each row probes the ``topk`` scenario on fresh servers: B alone, then B among concurrent requests, at
temperature 0. With the incident's selection (``--unsafe-topk``: bfloat16 index scores, ties kept in the
order partitions of the key range finish, set by the batch) B's answer follows its batch partners; with
kvwarden's selection it is bitwise the same alone and in any company.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.markup import escape
from rich.table import Table

if TYPE_CHECKING:
    from kvwarden.probe.results import RunResult

TOPK_MODEL = "builtin:glm_moe_dsa-tiny"

STORY = (
    "Before the cache bug came a selection bug: GLM-5's sparse attention picks, for every query, the keys its "
    "lightning indexer scores highest. The kernel that picked them handed out output slots in the order its "
    "threads arrived, so among equal scores (common in the low-precision scores production indexers use) which "
    "key won depended on what else the GPU was doing. Temperature-0 answers changed with their batch."
)


@dataclass(frozen=True)
class TopkConfig:
    label: str
    extra_args: tuple[str, ...]
    batch_dependent: bool  # what the row should show


TOPK_CONFIGS = (
    TopkConfig("sparse attention, the incident's top-k (ties in arrival order)", ("--unsafe-topk",), True),
    TopkConfig("sparse attention, kvwarden's deterministic top-k", (), False),
)


def observed(result: RunResult) -> tuple[str, bool]:
    """(plain-words observation, whether B's answer depended on its company)."""
    by = {s.arm: s for s in result.summaries}
    alone, noisy = by["alone"], by["among-noise"]
    same = result.cross.get("among-noise", False) and noisy.stable and alone.stable
    if same:
        return "B identical alone and among other requests, in every run", False
    where = "" if noisy.first_divergent_token is None else f", first at generated token {noisy.first_divergent_token}"
    texts = "same text" if noisy.texts_identical else "the TEXT changed too"
    return (
        f"B among other requests differs from B alone ({noisy.identical}/{noisy.runs} of its runs agree{where}; "
        f"{texts})",
        True,
    )


def run_topk(
    console: Console, out: Path, js: Path, repeats: int, max_tokens: int
) -> tuple[bool, list[tuple[TopkConfig, RunResult]]]:
    """Probe both rows; print a table; ``(every row showed what it should, results)``."""
    from kvwarden.models.sources import resolve_model
    from kvwarden.models.tokenizer import Tokenizer
    from kvwarden.probe.builtin import Shape, build
    from kvwarden.probe.launchers import KvwardenLauncher, ServerSettings
    from kvwarden.probe.results import finish_run
    from kvwarden.probe.runner import Target, run_probe

    model = str(resolve_model(TOPK_MODEL))
    tokenizer = Tokenizer.from_dir(model)
    console.print(f"\n[bold]Sparse attention ({TOPK_MODEL}): does the key selection change the answer?[/bold]")
    console.print(escape(STORY))
    results: list[tuple[TopkConfig, RunResult]] = []
    for i, cfg in enumerate(TOPK_CONFIGS, start=1):
        settings = ServerSettings(block_size=16, extra_args=cfg.extra_args)
        scenario = build("topk", settings, tokenizer, Shape(), repeats, max_tokens=max_tokens, ignore_eos=True)
        run_dir = out / "topk" / ("unsafe-topk" if cfg.extra_args else "kvwarden")
        console.print(f"\n[bold][topk {i}/{len(TOPK_CONFIGS)}] {escape(cfg.label)}[/bold] -> {run_dir}")
        target = Target(launcher=KvwardenLauncher(), model=model, tokenizer=tokenizer)
        records = run_probe(scenario, target, run_dir)
        result = finish_run(run_dir, scenario, records, cfg.label, "kvwarden", model, plotly_js=js)
        results.append((cfg, result))
        if not any(s.error for s in result.summaries):
            text, dependent = observed(result)
            console.print(f"  observed: [{'red' if dependent else 'green'}]{escape(text)}[/]")
    table = Table(title="Sparse attention: B alone vs B among other requests (temperature 0)", title_justify="left")
    for col in ("configuration", "expected", "observed", "as expected"):
        table.add_column(col)
    all_ok = True
    for cfg, result in results:
        if any(s.error for s in result.summaries):
            table.add_row(cfg.label, "-", "an arm failed: see " + str(result.run_dir / "logs"), "[red]NO[/red]")
            all_ok = False
            continue
        text, dependent = observed(result)
        ok = dependent == cfg.batch_dependent
        all_ok &= ok
        colour = "red" if dependent else "green"
        expected = "B's answer follows its batch" if cfg.batch_dependent else "B identical in any company"
        table.add_row(cfg.label, expected, f"[{colour}]{escape(text)}[/{colour}]", "yes" if ok else "[red]NO[/red]")
    console.print()
    console.print(table)
    return all_ok, results
