"""Where kvwarden keeps what it makes outside a checkout: models, engine builds, compiled kernels."""

from __future__ import annotations

import os
from pathlib import Path


def cache_home() -> Path:
    """``$KVWARDEN_HOME``, else ``~/.cache/kvwarden``."""
    return Path(os.environ.get("KVWARDEN_HOME") or Path.home() / ".cache" / "kvwarden")
