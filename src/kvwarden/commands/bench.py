"""``kvwarden bench NAME [ARGS...]``: one entry point over the benchmarks in :mod:`kvwarden.bench`.

A benchmark is a module of that package that runs as a program (``python -m kvwarden.bench.NAME``, whose
``__main__`` block calls its ``main()``); the list is read from the package's files (their opening line),
so a new bench needs no registration here. Each prints a table and ends with one JSON line.

Flags before NAME are the entry point's: ``--result FILE`` writes that JSON line in the one result shape
of :mod:`kvwarden.bench.result` (name, config, machine, status, figures); ``--summarize PATH...`` prints
the summary lines of result files (and pytest JUnit files) instead of running anything.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import signal
import sys
from pathlib import Path
from types import FrameType, ModuleType

from kvwarden.bench import result as results
from kvwarden.commands.engine_args import HelpFormatter

MAIN_GUARD = 'if __name__ == "__main__":'
# Modules that run as programs but are parts of a bench, not benches (guard's instant backend).
NOT_BENCHES = frozenset({"instant"})


def benches() -> dict[str, str]:
    """Each bench's name and the first line of its docstring, sorted by name (read, not imported: fast)."""
    package = Path(__file__).resolve().parents[1] / "bench"
    found = {}
    for path in sorted(package.glob("*.py")):
        text = path.read_text()
        if path.stem in NOT_BENCHES or MAIN_GUARD not in text or "\ndef main(" not in text:
            continue
        doc = ast.get_docstring(ast.parse(text)) or ""
        found[path.stem] = doc.splitlines()[0] if doc else ""
    return found


class _Formatter(HelpFormatter, argparse.RawDescriptionHelpFormatter):
    """The bench list keeps its lines."""


def register(sub: argparse._SubParsersAction) -> None:
    listing = "\n".join(f"  {name:<18} {line}" for name, line in benches().items())
    p = sub.add_parser(
        "bench",
        help="run a benchmark (kvwarden bench --help lists them; kvwarden bench NAME --help its flags)",
        description="Run one of kvwarden's benchmarks; every flag after NAME goes to it, flags before it are these.",
        epilog=f"benchmarks:\n{listing}",
        formatter_class=_Formatter,
    )
    p.add_argument("--result", type=Path, metavar="FILE", help="write the result (name, config, machine, figures) here")
    p.add_argument(
        "--summarize",
        type=Path,
        nargs="+",
        metavar="PATH",
        help="print the summary of result files or folders",
    )
    p.add_argument("name", metavar="NAME", nargs="?", help="the benchmark (listed below)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="its flags (kvwarden bench NAME --help)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.summarize:
        if args.name or args.result:
            raise ValueError("--summarize: reads result files and runs nothing; leave NAME and --result out")
        print("\n".join(results.summary(args.summarize)))
        return 0
    known = benches()
    if not args.name:
        raise ValueError("NAME: which benchmark? (kvwarden bench --help lists them)")
    if args.name not in known:
        close = [n for n in known if n.startswith(args.name[:3])]
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise ValueError(f"NAME: unknown benchmark {args.name!r}{hint} (kvwarden bench --help lists them)")
    # Imported under its own name and its main() called (what its __main__ block does): its functions
    # keep their module's name, so worker processes it spawns can unpickle them.
    module = importlib.import_module(f"kvwarden.bench.{args.name}")
    # A `timeout` (the GPU script's) ends a bench with SIGTERM: as SystemExit, its servers are stopped by
    # their context managers and its result file says how it ended.
    previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        if args.result is None:
            return _call(module, args.name, args.args)
        call = lambda: _call(module, args.name, args.args)  # noqa: E731
        return results.run_recorded(args.name, args.args, args.result, call, sys.stdout)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _terminated(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


def _call(module: ModuleType, name: str, argv: list[str]) -> int:
    saved = sys.argv
    sys.argv = [f"kvwarden bench {name}", *argv]
    try:
        result = module.main()
    except SystemExit as done:  # argparse's refusals, the bench's own exit status, SIGTERM
        code = done.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    finally:
        sys.argv = saved
    return result if isinstance(result, int) else 0
