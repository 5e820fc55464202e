"""The guard's configuration: frozen dataclasses, read from ``guard.toml`` and the command line.

Every threshold has the production default (the acceptance rule is Z.ai's:
after 128 generated tokens, stop if accept length < 1.4 or accept rate > 0.96);
every error names the TOML key (``monitors.acceptance.min_accept_length``) or
the flag, so a typo never silently falls back to a default.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class AcceptanceConfig:
    """Speculative-decoding acceptance, read from the backend's per-choice statistics.

    Attributes:
        enabled: check it when the backend reports statistics (kvwarden's
            ``spec_decoding``, SGLang's ``spec_accept_length`` / ``spec_accept_rate``).
        min_tokens: the rule applies once more than this many tokens are generated.
        min_accept_length: below this mean tokens per verify step, drafts and
            target disagree: corrupt KV or garbage.
        max_accept_rate: above this share of accepted drafts, the output is a loop.
    """

    enabled: bool = True
    min_tokens: int = 128
    min_accept_length: float = 1.4
    max_accept_rate: float = 0.96


@dataclass(frozen=True)
class RepetitionConfig:
    """A loop: the last ``window`` tokens repeat with a period of at most ``max_period``."""

    enabled: bool = True
    window: int = 64
    max_period: int = 16


@dataclass(frozen=True)
class GarbageConfig:
    """Mean chosen-token logprob over the last ``window`` tokens below ``min_mean_logprob``.

    Needs logprobs: the guard asks the backend for them when the client did not
    (and strips them from the answer).
    """

    enabled: bool = True
    window: int = 32
    min_mean_logprob: float = -6.0


@dataclass(frozen=True)
class MonitorsConfig:
    acceptance: AcceptanceConfig = field(default_factory=AcceptanceConfig)
    repetition: RepetitionConfig = field(default_factory=RepetitionConfig)
    garbage: GarbageConfig = field(default_factory=GarbageConfig)

    @property
    def min_tokens(self) -> int:
        """Tokens before any enabled monitor can fire (the default hold-back window)."""
        needs = [
            self.acceptance.min_tokens if self.acceptance.enabled else 0,
            self.repetition.window if self.repetition.enabled else 0,
            self.garbage.window if self.garbage.enabled else 0,
        ]
        return max(needs)


@dataclass(frozen=True)
class CanaryConfig:
    """The determinism canary: a fixed two-request contamination pattern replayed per backend.

    Attributes:
        interval: seconds between replays (0 turns the canary off).
        max_tokens: tokens generated for request B (compared by fingerprint).
        top_logprobs: top-k lists fingerprinted (20, as the probe).
        drain_on_drift: stop routing to a backend once its fingerprint changed.
    """

    interval: float = 60.0
    max_tokens: int = 16
    top_logprobs: int = 20
    drain_on_drift: bool = False


@dataclass(frozen=True)
class GuardConfig:
    """Everything ``kvwarden guard`` needs.

    Attributes:
        backends: base URLs of OpenAI-compatible servers (``http://127.0.0.1:8000``).
        host, port: where the guard listens (loopback by default).
        max_retries: attempts after the first when a monitor fires or a backend fails.
        hold_back_tokens: tokens held before the first byte reaches a streaming
            client, so a retry inside the window is invisible (``None`` = the
            monitors' minimum, 128 by default).
        request_timeout: seconds an upstream may stay silent before it counts as failed.
        health_interval: seconds between health checks (a failed backend is probed back in).
        api_key: sent to the backends as ``Authorization: Bearer``.
        client_api_key: when set, clients must send ``Authorization: Bearer``
            with it on ``/v1/*`` (401 otherwise), as ``kvwarden serve --api-key``.
        max_body_bytes: larger request bodies are answered 413 unread.
        prefill: disaggregated serving: prefill instances (``kvwarden serve --role
            prefill``); every backend is then a decode instance, and each attempt
            names one prefill instance (round robin) in ``kv_transfer_params``.
    """

    backends: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 8100
    max_retries: int = 2
    hold_back_tokens: int | None = None
    request_timeout: float = 120.0
    health_interval: float = 5.0
    api_key: str | None = None
    client_api_key: str | None = None
    max_body_bytes: int = 8 * 1024 * 1024
    monitors: MonitorsConfig = field(default_factory=MonitorsConfig)
    canary: CanaryConfig = field(default_factory=CanaryConfig)
    prefill: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.backends:
            raise ValueError("--backend: at least one backend URL is needed")
        for url in self.backends:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"--backend {url!r}: expected an http:// or https:// URL")
        if len(set(self.backends)) != len(self.backends):
            raise ValueError("--backend: the same URL is given twice")
        for url in self.prefill:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"--prefill {url!r}: expected an http:// or https:// URL")
            if url in self.backends:
                raise ValueError(f"--prefill {url!r}: also given as a decode instance (--backend/--decode)")
        _check("port", self.port, 0, 65535)
        _check("max_retries", self.max_retries, 0, 100)
        _check("request_timeout", self.request_timeout, 1e-3, None)
        _check("health_interval", self.health_interval, 1e-3, None)
        _check("max_body_bytes", self.max_body_bytes, 1, None)
        if self.hold_back_tokens is not None:
            _check("hold_back_tokens", self.hold_back_tokens, 0, None)
        m = self.monitors
        _check("monitors.acceptance.min_tokens", m.acceptance.min_tokens, 0, None)
        _check("monitors.acceptance.max_accept_rate", m.acceptance.max_accept_rate, 0.0, 1.0)
        _check("monitors.repetition.window", m.repetition.window, 2, None)
        _check("monitors.repetition.max_period", m.repetition.max_period, 1, m.repetition.window // 2)
        _check("monitors.garbage.window", m.garbage.window, 1, None)
        _check("canary.interval", self.canary.interval, 0.0, None)
        _check("canary.max_tokens", self.canary.max_tokens, 1, None)
        _check("canary.top_logprobs", self.canary.top_logprobs, 1, 20)

    @property
    def hold_back(self) -> int:
        return self.monitors.min_tokens if self.hold_back_tokens is None else self.hold_back_tokens


def _check(name: str, value: float, low: float, high: float | None) -> None:
    if value < low or (high is not None and value > high):
        bound = f"[{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{name}: must be {bound}, got {value}")


_SECTIONS: dict[str, type] = {
    "monitors.acceptance": AcceptanceConfig,
    "monitors.repetition": RepetitionConfig,
    "monitors.garbage": GarbageConfig,
    "canary": CanaryConfig,
}


def _typed(key: str, value: Any, default: Any) -> Any:
    """``value`` if it has the default's type (ints accepted for floats), else a ValueError naming ``key``."""
    if isinstance(default, bool) or default is None:
        ok = isinstance(value, bool) if isinstance(default, bool) else True
    elif isinstance(default, float):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    else:
        ok = isinstance(value, type(default)) and not isinstance(value, bool)
    if not ok:
        raise ValueError(f"{key}: expected {type(default).__name__}, got {value!r}")
    return value


def _section(cls: type, prefix: str, table: Any) -> Any:
    if not isinstance(table, dict):
        raise ValueError(f"{prefix}: expected a table")
    known = {f.name: f for f in fields(cls)}
    values = {}
    for key, value in table.items():
        if key not in known:
            raise ValueError(f"{prefix}.{key}: unknown key; known keys: {', '.join(sorted(known))}")
        values[key] = _typed(f"{prefix}.{key}", value, getattr(cls(), key))
    return cls(**values)


def parse_toml(data: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments of :class:`GuardConfig` a TOML document sets (strict: unknown keys are errors)."""
    top = {"backends", "host", "port", "max_retries", "hold_back_tokens", "request_timeout", "health_interval"}
    top |= {"api_key", "client_api_key", "max_body_bytes", "monitors", "canary", "prefill"}
    out: dict[str, Any] = {}
    for key, value in data.items():
        if key not in top:
            raise ValueError(f"{key}: unknown key; known keys: {', '.join(sorted(top))}")
        if key == "monitors":
            if not isinstance(value, dict):
                raise ValueError("monitors: expected a table")
            parts = {}
            for name, table in value.items():
                section = f"monitors.{name}"
                if section not in _SECTIONS:
                    raise ValueError(f"{section}: unknown monitor; known: acceptance, repetition, garbage")
                parts[name] = _section(_SECTIONS[section], section, table)
            out["monitors"] = MonitorsConfig(**parts)
        elif key == "canary":
            out["canary"] = _section(CanaryConfig, "canary", value)
        elif key in ("backends", "prefill"):
            if not isinstance(value, list) or not all(isinstance(u, str) for u in value):
                raise ValueError(f"{key}: expected a list of URLs")
            out[key] = tuple(value)
        elif key in ("hold_back_tokens", "api_key", "client_api_key"):
            kind = int if key == "hold_back_tokens" else str
            if not isinstance(value, kind) or isinstance(value, bool):
                raise ValueError(f"{key}: expected {kind.__name__}, got {value!r}")
            out[key] = value
        else:
            out[key] = _typed(key, value, getattr(GuardConfig(backends=("http://x",)), key))
    return out


def load_config(path: str | Path | None, **overrides: Any) -> GuardConfig:
    """Defaults, then ``path`` (TOML), then the command line's ``overrides`` (``None`` = not given).

    Raises:
        ValueError: naming the key or flag that is wrong.
        FileNotFoundError: ``path`` does not exist.
    """
    values: dict[str, Any] = {}
    if path is not None:
        text = Path(path).read_text()
        try:
            values = parse_toml(tomllib.loads(text))
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"--config {path}: not valid TOML: {exc}") from exc
    values.update({k: v for k, v in overrides.items() if v is not None})
    if "backends" not in values:
        raise ValueError("--backend: at least one backend URL is needed (on the command line or in --config)")
    return GuardConfig(**values)
