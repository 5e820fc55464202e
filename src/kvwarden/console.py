"""Consoles for the commands' tables: on a terminal its width, piped or logged a wide one.

rich falls back to 80 columns when stdout is not a terminal, which cut the probe's and the demo's
tables (``contamin…``, ``identic…``) in CI logs and ``| tee`` runs.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console

PIPED_WIDTH = 160


def wide_console(stderr: bool = False, **kwargs: Any) -> Console:
    """A rich console at the terminal's width, or :data:`PIPED_WIDTH` columns when not on a terminal."""
    on_terminal = Console(stderr=stderr).is_terminal
    return Console(stderr=stderr, width=None if on_terminal else PIPED_WIDTH, **kwargs)
