"""kvwarden command line: one sub-command per job.

Each sub-command lives in its own module and registers itself here; argparse
errors name the flag, and expected failures (bad model path, bad values) end
with a one-line message and exit status 2 rather than a traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kvwarden import __version__
from kvwarden.commands.engine_args import HelpFormatter


def build_parser() -> argparse.ArgumentParser:
    from kvwarden.commands import (
        bench,
        cold_warm,
        demo,
        generate,
        guard,
        make_model,
        predict,
        probe,
        serve,
        trace_divergence,
    )

    parser = argparse.ArgumentParser(prog="kvwarden", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"kvwarden {__version__}")
    # dest "subcommand": a command's own --command flag (probe's launcher template) must not overwrite it
    sub = parser.add_subparsers(dest="subcommand", required=True, metavar="COMMAND")
    for module in (demo, cold_warm, generate, make_model, predict, probe, serve, guard, trace_divergence, bench):
        module.register(sub)
    for command in sub.choices.values():
        if not issubclass(command.formatter_class, HelpFormatter):  # bench's keeps its list's lines
            command.formatter_class = HelpFormatter
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as exc:
        print(f"kvwarden {args.subcommand}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"kvwarden {args.subcommand}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
