"""``kvwarden demo``: does a prefix cache change the answer? Predicted and measured, in about a minute.

On a built-in hybrid model, the contamination scenario (docs/production-story.md
§1) is probed under four server configurations, each arm on a fresh server:
vLLM's align rule with vendor-style numerics (the production bug), the rule's
one-line fix, and kvwarden's defaults, all with speculative decoding on (as in
production), and kvwarden's defaults with it off. Beside each observation, the predictor's
verdict for the same lengths and the block size the server reported. Every
configuration leaves a probe run directory (``records.jsonl``,
``summary.json``, ``report.html``); the top directory has the summary page.
Then the sparse-attention rows (``commands/demo_topk.py``): the key selection
of the first incident against kvwarden's deterministic top-k.
"""

from __future__ import annotations

import argparse
import html
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kvwarden.console import wide_console

if TYPE_CHECKING:
    from kvwarden.probe.results import RunResult


@dataclass(frozen=True)
class Config:
    label: str
    chunking: str
    numerics: str
    speculative: bool = True


# Speculative decoding is on, as in production: it is what pulls the align rule's last cacheable
# position back one block. The last row turns it off to show kvwarden's output does not depend on it.
CONFIGS = (
    Config("vLLM's align rule + vendor-style kernels (the production bug)", "legacy-align", "shape-dependent"),
    Config("the rule's one-line fix + vendor-style kernels", "legacy-align-fixed", "shape-dependent"),
    Config("kvwarden's defaults (canonical kernels, any chunking)", "kvwarden", "canonical"),
    Config("kvwarden's defaults, speculative decoding off", "kvwarden", "canonical", speculative=False),
)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo", help="the contamination scenario: legacy rule vs fix vs kvwarden, predicted and measured"
    )
    p.add_argument("--model", default="builtin:qwen3_next-tiny", help="a hybrid model (built-in: random weights)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--a-len", type=int, default=28, help="tokens of request A (just below two blocks)")
    p.add_argument("--b-len", type=int, default=44, help="tokens of request B")
    p.add_argument("--shared", type=int, default=24, help="leading tokens A and B share (the document)")
    p.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=1,
        help="draft tokens per step (MTP when the model has a head, else n-gram); speculation on pulls the "
        "legacy rule's last cacheable position back one block",
    )
    p.add_argument("--repeats", type=int, default=5, help="runs of B per arm")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens B generates (the plots' x axis)")
    p.add_argument("--out", type=Path, default=None, help="run directory (default: runs/demo-TIMESTAMP)")
    p.add_argument("--no-topk", action="store_true", help="skip the sparse-attention rows (the key-selection incident)")
    p.set_defaults(func=run)


def _says(result: RunResult) -> tuple[str, bool, bool]:
    """(plain-words observation, stable, B-after-A differs from B alone)."""
    from kvwarden.probe.report import contamination_verdict

    stable, history = contamination_verdict(result.summaries)
    cont = result.arm("contaminated")
    if not stable:
        # which runs: those whose logprobs moved against run 1 (deltas are runs 2..N against run 1)
        moved = [str(i) for i, d in enumerate(cont.deltas, start=2) if any(v != 0 for v in d)]
        which = f"runs {', '.join(moved)} differ from run 1" if moved else f"{cont.identical}/{cont.runs} identical"
        text = f"UNSTABLE: B's runs after A differ ({which}"
        text += f", first at generated token {cont.first_divergent_token})"
    elif history:
        text = "repeatable, but B after A differs from B alone"
    else:
        text = "stable: every run of B, after A or alone, is bitwise identical"
    return text, stable, history


def _coloured(text: str, stable: bool, history: bool) -> str:
    """The observation in the verdict's colour (red unstable, yellow history-dependent, green stable)."""
    colour = "red" if not stable else ("yellow" if history else "green")
    return f"[{colour}]{escape(text)}[/{colour}]"


def _predicted(stable: bool, history: bool) -> str:
    if not stable:
        return "B's runs after A differ from each other"
    return "B after A differs from B alone" if history else "every run identical"


def run(args: argparse.Namespace) -> int:
    from kvwarden.models.mtp import checkpoint_has_mtp
    from kvwarden.models.sources import resolve_model
    from kvwarden.models.tokenizer import Tokenizer
    from kvwarden.probe.builtin import Shape, build, prompts
    from kvwarden.probe.crosscheck import CacheCheck
    from kvwarden.probe.html_report import ensure_plotly_js
    from kvwarden.probe.launchers import KvwardenLauncher, ServerSettings
    from kvwarden.probe.results import finish_run
    from kvwarden.probe.runner import Target, run_probe

    console = wide_console(highlight=False)
    start = time.perf_counter()
    model = str(resolve_model(args.model))
    tokenizer = Tokenizer.from_dir(model)
    method = "mtp" if checkpoint_has_mtp(model) else "ngram"
    shape = Shape(a_len=args.a_len, b_len=args.b_len, shared=args.shared)
    a, b = prompts(shape, tokenizer)
    out = args.out or Path("runs") / f"demo-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    js = ensure_plotly_js(out)
    console.print("[bold]kvwarden demo: does a prefix cache change the answer?[/bold]")
    console.print(STORY + "\n")
    for line in _setup(args, len(a), len(b)):
        console.print(escape(line))
    results: list[tuple[Config, RunResult]] = []
    drafted: dict[str, int] = {}  # draft tokens the server scored, per configuration
    for i, cfg in enumerate(CONFIGS, start=1):
        settings = ServerSettings(
            block_size=args.block_size,
            max_num_batched_tokens=max(len(a), len(b)) + 64,
            chunking=cfg.chunking,
            numerics=cfg.numerics,
            speculative=cfg.speculative,
            num_speculative_tokens=args.num_speculative_tokens,
            spec_method=method,
        )
        scenario = build(
            "contamination", settings, tokenizer, shape, args.repeats, max_tokens=args.max_tokens, ignore_eos=True
        )
        # the speculation-off row gets its own directory: the runner resumes arms it finds on disk
        run_dir = out / cfg.chunking / (cfg.numerics if cfg.speculative else f"{cfg.numerics}-spec-off")
        console.print(f"\n[bold][{i}/{len(CONFIGS)}] {escape(cfg.label)}[/bold] -> {run_dir}")
        target = Target(launcher=KvwardenLauncher(), model=model, tokenizer=tokenizer)
        records = run_probe(scenario, target, run_dir)
        drafted[cfg.label] = sum((r.get("spec_decoding") or {}).get("num_draft_tokens", 0) for r in records)
        result = finish_run(run_dir, scenario, records, cfg.label, "kvwarden", model, plotly_js=js)
        results.append((cfg, result))
        console.print("  " + escape(_arm_line(result)))
        if any(s.error for s in result.summaries):
            console.print("  [red]an arm failed: see its log under[/red] " + str(run_dir / "logs"))
            continue
        console.print(f"  observed: {_coloured(*_says(result))}")
        if isinstance(result.check, CacheCheck):
            c = result.check
            console.print(
                f"  predicted ({c.rule} rule, block size {c.block_size} as the server reported): "
                f"{_predicted(c.predicted_repeats_stable, c.predicted_history_dependent)}; cached tokens "
                f"{'as predicted' if c.matches else 'NOT as predicted'}"
            )
    ok = _summary(console, results)
    ok &= _spec_row(console, results, method, drafted)
    topk: list = []
    if not args.no_topk:
        from kvwarden.commands.demo_topk import run_topk

        topk_ok, topk = run_topk(console, out, js, args.repeats, min(args.max_tokens, 16))
        ok &= topk_ok
    page = _write_page(out, args, len(a), len(b), results + topk, js)
    (out / "summary.json").write_text(
        json.dumps({cfg.label: r.to_dict() for cfg, r in results + topk} | {"all_as_predicted": ok}, indent=2)
    )
    console.print(f"\nHTML report: {page.resolve()}  ({time.perf_counter() - start:.0f} s)")
    return 0 if ok else 1


STORY = (
    "On a hybrid model, vLLM's align scheduling rule saves a recurrent state only where a prefill chunk ends on "
    "a block boundary. Request A, just under two blocks, runs as one chunk and saves no state; request B, which "
    "shares A's first block, later combines the KV that A's chunk wrote with a state its own chunk saved. Same "
    "tokens, numbers computed under different chunk shapes: the top-20 logprobs of B's answer change from run to "
    "run while the text often stays the same. (docs/production-story.md tells the whole story.)"
)


def _setup(args: argparse.Namespace, a_len: int, b_len: int) -> list[str]:
    return [
        f"Setup: {args.model}, {args.block_size}-token blocks; A = {a_len} tokens of a document, B = its first "
        f"{args.shared} tokens + {b_len - args.shared} others; B generates {args.max_tokens} tokens.",
        "Three arms per configuration, each on a fresh server:",
        f"  clean         B alone, {args.repeats} times",
        f"  contaminated  A once, then B {args.repeats} times (B may reuse the blocks A wrote)",
        f"  no-cache      B {args.repeats} times with prefix caching off",
        f"An arm is stable when all {args.repeats} runs of B give bitwise identical top-20 logprobs for every token.",
    ]


def _arm_line(result: RunResult) -> str:
    parts = []
    for s in result.summaries:
        if s.error:
            parts.append(f"{s.arm}: error")
            continue
        first = "" if s.first_divergent_token is None else f", first difference at token {s.first_divergent_token}"
        parts.append(f"{s.arm} {s.identical}/{s.runs} identical{first}")
    return "; ".join(parts)


def _summary(console: Console, results: list[tuple[Config, RunResult]]) -> bool:
    from kvwarden.probe.crosscheck import CacheCheck

    table = Table(title="Predicted vs observed (contaminated arm: A once, then B repeated)", title_justify="left")
    for col in ("configuration", "predicted", "observed", "cached tokens of B's runs", "as predicted"):
        table.add_column(col)
    all_ok = True
    for cfg, result in results:
        check = result.check
        if any(s.error for s in result.summaries) or not isinstance(check, CacheCheck):
            table.add_row(cfg.label, "-", "an arm failed" if isinstance(check, CacheCheck) else str(check), "-", "NO")
            all_ok = False
            continue
        text, stable, history = _says(result)
        ok = (stable, history) == (check.predicted_repeats_stable, check.predicted_history_dependent)
        ok = ok and check.matches
        all_ok &= ok
        predicted = _predicted(check.predicted_repeats_stable, check.predicted_history_dependent)
        cached = " ".join(str(c) for c in result.arm("contaminated").cached_tokens)
        observed = _coloured(text, stable, history)
        table.add_row(cfg.label, predicted, observed, cached, "[green]yes[/green]" if ok else "[red]NO[/red]")
    console.print()
    console.print(table)
    return all_ok


def _spec_row(console: Console, results: list[tuple[Config, RunResult]], method: str, drafted: dict[str, int]) -> bool:
    """kvwarden with speculation on must give B exactly the answer it gives with speculation off."""
    canonical = [(cfg, r) for cfg, r in results if cfg.chunking == "kvwarden"]
    if len(canonical) != 2 or any(s.error for _, r in canonical for s in r.summaries):
        return False
    (on_cfg, on_run), (_, off_run) = canonical
    on, off = ({fp for s in r.summaries for fp in s.fingerprints} for r in (on_run, off_run))
    scored = drafted.get(on_cfg.label, 0)
    same = on == off and len(on) == 1 and scored > 0
    console.print(
        f"kvwarden, speculative decoding ({method}, {scored} draft tokens scored) on vs off: B's top-20 logprobs "
        + ("[green]bitwise identical[/green] in every run" if same else "[red]DIFFER or nothing drafted[/red]")
    )
    return same


def _observation(result: RunResult) -> str:
    if "alone" in {s.arm for s in result.summaries}:  # a sparse-attention row
        from kvwarden.commands.demo_topk import observed

        return observed(result)[0]
    return _says(result)[0]


def _settings(cfg: object) -> str:
    if isinstance(cfg, Config):
        return f"chunking {cfg.chunking}, numerics {cfg.numerics}"
    return "server flags: " + (" ".join(getattr(cfg, "extra_args", ())) or "defaults")


def _write_page(
    out: Path, args: argparse.Namespace, a_len: int, b_len: int, results: list[tuple[Any, RunResult]], js: Path
) -> Path:
    from kvwarden.probe.html_report import arm_plots, arms_table, page

    intro = f"<p>{html.escape(STORY)}</p><pre>{html.escape(chr(10).join(_setup(args, a_len, b_len)))}</pre>"
    rows = []
    sections = []
    for cfg, result in results:
        link = (result.run_dir.relative_to(out) / "report.html").as_posix()
        text = "an arm failed" if any(s.error for s in result.summaries) else _observation(result)
        rows.append(
            f"<tr><td><a href='{html.escape(link)}'>{html.escape(cfg.label)}</a></td><td>{html.escape(text)}</td></tr>"
        )
        plots = "".join(arm_plots(s, cfg.label) for s in result.summaries if s.deltas)
        sections.append(
            f"<h2>{html.escape(cfg.label)}</h2>"
            + arms_table(f"{cfg.label}: arms ({_settings(cfg)})", result.summaries)
            + (plots or "<p>Every arm's runs were bitwise identical: nothing to plot.</p>")
        )
    summary = (
        "<table><caption>Configurations: what B's runs after A showed</caption>"
        f"<tr><th>configuration (link: its probe report)</th><th>observed</th></tr>{''.join(rows)}</table>"
    )
    path = out / "report.html"
    path.write_text(
        page("kvwarden demo: does a prefix cache change the answer?", intro + summary + "".join(sections), js.name)
    )
    return path
