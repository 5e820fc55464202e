"""Faults injected on purpose, for tests only: ``kvwarden serve --inject-fault NAME=VALUE``.

Nothing is injected unless the flag names it; a server with faults says so in
``/health`` and at start-up, so nobody mistakes it for a healthy one.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

# name -> (type, what it does)
KNOWN: dict[str, tuple[type, str]] = {
    "engine-crash-after-steps": (int, "the engine thread raises after this many steps (tests the failure path)"),
}


@dataclass(frozen=True)
class Faults:
    """Injected faults (all off by default)."""

    engine_crash_after_steps: int | None = None

    @property
    def any(self) -> bool:
        return any(v is not None for v in asdict(self).values())

    def describe(self) -> dict[str, object]:
        return {k.replace("_", "-"): v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def parse(cls, specs: list[str]) -> Faults:
        """From ``NAME=VALUE`` strings; a ``ValueError`` naming ``--inject-fault`` for anything else."""
        values: dict[str, object] = {}
        for spec in specs:
            name, sep, raw = spec.partition("=")
            if not sep or name not in KNOWN:
                known = ", ".join(f"{k}=N" for k in KNOWN)
                raise ValueError(f"--inject-fault {spec!r}: expected NAME=VALUE with NAME one of: {known}")
            kind, _ = KNOWN[name]
            try:
                values[name.replace("-", "_")] = kind(raw)
            except ValueError as exc:
                raise ValueError(f"--inject-fault {spec!r}: {raw!r} is not a valid {kind.__name__}") from exc
        return cls(**values)  # type: ignore[arg-type]
