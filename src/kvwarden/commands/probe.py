"""``kvwarden probe``: the logit-level determinism method against any OpenAI-compatible server.

Exit status: 0 every arm stable, 1 some arm unstable, 2 an arm could not run
(or bad arguments) - so the probe can gate a deployment in CI.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from rich.markup import escape

from kvwarden.config import CHUNKING_RULES, DEVICES, NUMERICS_MODES
from kvwarden.console import wide_console
from kvwarden.probe.builtin import BUILTINS
from kvwarden.probe.invoices import SUITES
from kvwarden.probe.launchers import LAUNCHERS
from kvwarden.probe.reachable import check_reachable

if TYPE_CHECKING:
    from kvwarden.probe.runner import Target


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "probe",
        help="measure logprob stability of a server across cache/batch/budget arms",
        description=(
            "Runs a scenario's arms (e.g. clean / contaminated / no-cache) against an OpenAI-compatible server, "
            "a fresh one per arm with --launcher, and fingerprints the top-20 logprobs of every generated token. "
            "Exit status: 0 every arm stable, 1 some arm unstable, 2 an arm could not run. "
            "See docs/production-story.md §2 for the method."
        ),
    )
    p.add_argument("--scenario", help=f"built-in ({', '.join(BUILTINS)}; default contamination) or a .yaml/.toml file")
    p.add_argument(
        "--suite",
        help=f"run a task suite instead of a scenario: built-in ({', '.join(SUITES)}) or a .jsonl file "
        "(docs/probe.md): accuracy, answer agreement and logit stability per task and arm",
    )
    p.add_argument("--tasks", type=int, help="--suite: run only the first N tasks")
    p.add_argument(
        "--constraint-field",
        choices=("auto", "response_format", "structured_outputs", "json_schema", "none"),
        help="--suite: how a task's answer schema is sent (auto: llama.cpp's json_schema for --launcher "
        "llama.cpp, else OpenAI's response_format; none: the prompt alone asks for JSON)",
    )
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--launcher", choices=LAUNCHERS, help="start a fresh server per arm")
    target.add_argument("--url", help="a server that is already running (arms isolated by cache_salt)")
    p.add_argument("--model", help="model for the launcher (dir, .gguf, builtin:...)")
    p.add_argument("--command", help="command template for --launcher custom/sglang, with {model} and {port}")
    p.add_argument("--served-model-name", help="model name for requests (default: the server's first model)")
    p.add_argument(
        "--api-key",
        default=os.environ.get("KVWARDEN_API_KEY") or None,
        help="sent as 'Authorization: Bearer KEY' (default: the KVWARDEN_API_KEY environment variable; a key on "
        "the command line is visible to other users in ps)",
    )
    p.add_argument("--tokenizer", help="'auto' (default: the model's, when local), a model, or 'none' (text)")
    p.add_argument("--out", type=Path, help="run directory (an existing one resumes); default runs/probe-...")
    p.add_argument("--repeats", type=int, help="runs of the measured request per arm (default 5; --suite: 3 per task)")
    p.add_argument("--max-tokens", type=int, help="tokens generated per request (default 8; --suite: 48)")
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens (vLLM's extension)")
    p.add_argument("--a-len", type=int, help="built-in scenarios: tokens of request A (default 28)")
    p.add_argument("--b-len", type=int, help="built-in scenarios: tokens of request B (default 44)")
    p.add_argument("--shared", type=int, help="built-in scenarios: leading tokens A and B share (default 24)")
    p.add_argument("--block-size", type=int, help="requested KV block size (the server may pick another)")
    p.add_argument("--max-num-batched-tokens", type=int, help="requested step budget")
    p.add_argument("--budgets", type=int, nargs=2, help="the budget scenario's two budgets (default 32 512)")
    p.add_argument("--chunking", choices=CHUNKING_RULES, help="kvwarden launcher only: prefill chunking rule")
    p.add_argument("--numerics", choices=NUMERICS_MODES, help="kvwarden launcher only: kernels")
    p.add_argument("--device", choices=DEVICES, help="kvwarden launcher only: cpu, cuda or auto")
    p.add_argument("--num-speculative-tokens", type=int, default=2, help="draft tokens in arms with speculation")
    p.add_argument(
        "--spec-method",
        choices=("ngram", "mtp"),
        default="ngram",
        help="kvwarden launcher only: proposer in arms with speculation (vLLM's arms use n-gram)",
    )
    p.add_argument("--dtype", choices=["float32", "bfloat16"], help="server dtype (vLLM serves Qwen3-Next in bfloat16)")
    p.add_argument("--server-arg", action="append", default=[], help="extra server argument (repeatable)")
    p.add_argument("--ready-timeout", type=float, help="seconds to wait for a server (default: per launcher)")
    p.add_argument("--json", action="store_true", help="print the per-arm summary as JSON on stdout")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=run)


def _tokenizer(spec: str, model: str | None) -> object:
    from kvwarden.models.loader import gguf_tokenizer
    from kvwarden.models.sources import resolve_model
    from kvwarden.models.tokenizer import Tokenizer

    if spec == "none":
        return None
    name = model if spec == "auto" else spec
    if name is None:
        return None
    try:
        path = resolve_model(name)
    except FileNotFoundError:
        if spec == "auto":
            return None
        raise
    if path.suffix == ".gguf":
        return gguf_tokenizer(path)
    return Tokenizer.from_dir(path) if (path / "tokenizer.json").is_file() else None


def _target(args: argparse.Namespace, model: str | None, tokenizer: object) -> Target:
    from kvwarden.probe.launchers import make_launcher
    from kvwarden.probe.runner import Target

    launcher = make_launcher(args.launcher, args.command) if args.launcher else None
    if launcher is not None and args.ready_timeout:
        launcher.ready_timeout = args.ready_timeout
    return Target(
        launcher=launcher,
        model=model,
        url=args.url,
        served_name=args.served_model_name,
        api_key=args.api_key,
        tokenizer=tokenizer,
    )


# Flags of one mode only: given with the other, they are refused rather than ignored.
SCENARIO_ONLY = ("scenario", "a_len", "b_len", "shared", "budgets", "tokenizer", "ignore_eos")
SUITE_ONLY = ("tasks", "constraint_field")


def _refuse_other_mode(args: argparse.Namespace) -> None:
    given = [name for name in (SCENARIO_ONLY if args.suite else SUITE_ONLY) if getattr(args, name) not in (None, False)]
    if given:
        flag = "--" + given[0].replace("_", "-")
        where = "is for scenarios, not --suite" if args.suite else "needs --suite"
        raise ValueError(f"{flag} {where} (it would be ignored)")


def _scenario_defaults(args: argparse.Namespace) -> None:
    defaults = {"scenario": "contamination", "a_len": 28, "b_len": 44, "shared": 24, "budgets": (32, 512),
                "tokenizer": "auto", "repeats": 5, "max_tokens": 8}  # fmt: skip
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)


def run(args: argparse.Namespace) -> int:
    from kvwarden.probe.builtin import Shape, build
    from kvwarden.probe.crosscheck import CacheCheck
    from kvwarden.probe.launchers import ServerSettings
    from kvwarden.probe.report import print_table
    from kvwarden.probe.results import finish_run
    from kvwarden.probe.runner import run_probe
    from kvwarden.probe.scenario import load_scenario
    from kvwarden.probe.server_info import ServerInfo

    _refuse_other_mode(args)
    settings = ServerSettings(
        block_size=args.block_size,
        max_num_batched_tokens=args.max_num_batched_tokens,
        chunking=args.chunking,
        numerics=args.numerics,
        device=args.device,
        num_speculative_tokens=args.num_speculative_tokens,
        spec_method=args.spec_method,
        dtype=args.dtype,
        extra_args=tuple(args.server_arg),
    )
    model = args.model
    if args.launcher and args.launcher != "custom" and not model:
        raise ValueError(f"--model is required with --launcher {args.launcher}")
    if model and args.launcher in ("kvwarden", "vllm", "llama.cpp"):
        from kvwarden.models.sources import resolve_model

        model = str(resolve_model(model))
    if args.suite:  # text prompts: no tokenizer needed
        from kvwarden.commands.probe_suite import run_suite_command

        return run_suite_command(args, settings, _target(args, model, None), model)
    _scenario_defaults(args)
    if args.scenario not in BUILTINS and not Path(args.scenario).suffix and not Path(args.scenario).exists():
        near = difflib.get_close_matches(args.scenario, BUILTINS, n=1)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        raise ValueError(
            f"--scenario: {args.scenario!r} is neither a built-in scenario ({', '.join(BUILTINS)}) nor a "
            f".yaml/.toml file{hint}"
        )
    if args.url:
        check_reachable(args.url, args.api_key)  # the flags are checked: now the server, before a run directory
    tokenizer = _tokenizer(args.tokenizer, model)
    lengths = "tokens (the model's tokenizer)"
    if tokenizer is None and args.url and args.tokenizer != "none":
        from kvwarden.probe.remote_tokenizer import RemoteTokenizer

        tokenizer, why = RemoteTokenizer.reach(args.url, args.served_model_name, args.api_key)
        if tokenizer is not None:
            lengths = f"tokens (the server's {args.url}/tokenize)"
        else:
            lengths = "WORDS: no tokenizer (give --tokenizer, or a server with /tokenize)"
            print(
                f"kvwarden probe: warning: {args.url}/tokenize did not answer ({why}); --a-len, --b-len and "
                "--shared count WORDS, which the server turns into several times as many tokens",
                file=sys.stderr,
            )
    if args.scenario in BUILTINS:
        shape = Shape(a_len=args.a_len, b_len=args.b_len, shared=args.shared)
        scenario = build(
            args.scenario,
            settings,
            tokenizer,
            shape,
            args.repeats,
            args.max_tokens,
            tuple(args.budgets),
            ignore_eos=args.ignore_eos,
        )
    else:
        scenario = load_scenario(args.scenario, settings)
    target = _target(args, model, tokenizer)
    out = args.out or Path("runs") / f"probe-{scenario.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    console = wide_console(stderr=args.json)  # with --json, stdout carries only the JSON summary
    arms = f"{len(scenario.arms)} arm{'s' if len(scenario.arms) != 1 else ''}"
    console.print(f"kvwarden probe: scenario {scenario.name}, {arms} -> {out}")
    if args.scenario in BUILTINS:
        console.print(f"  prompt lengths in {lengths}: A {args.a_len}, B {args.b_len}, shared {args.shared}")
    records = run_probe(scenario, target, out, show_progress=not args.no_progress)
    title = f"probe {scenario.name} ({args.launcher or args.url})"
    result = finish_run(out, scenario, records, title, args.launcher, model)
    print_table(title, result.summaries, console)
    for name, same in result.cross.items():
        console.print(f"  {scenario.compare_arms[0]} vs {name}: {'same' if same else 'DIFFERENT'} first fingerprint")
    for s in result.summaries:
        if s.server:
            console.print(f"  {s.arm}: server reported {ServerInfo(**s.server).describe()}")
    if isinstance(result.check, CacheCheck):
        console.print(("  " if result.check.matches else "  [red]") + escape(result.check.describe()))
    summary = result.to_dict()
    if args.json:
        print(json.dumps(summary))
    console.print(f"report: {out / 'report.html'}")
    return result.exit_status
