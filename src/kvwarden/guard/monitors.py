"""Monitors: cheap checks on a generation in flight that say when to stop it.

Each monitor reads a :class:`ChoiceWatch` (what one choice has produced so far)
and returns a :class:`Verdict` naming its reason label, or ``None``. They look
only at what the backend streams (tokens, chosen-token logprobs, acceptance
statistics), so they work in front of any OpenAI-compatible server:

* ``acceptance``: speculative decoding's acceptance is a free quality signal.
  Corrupt KV makes draft and target disagree (accept length collapses towards
  1); a repetition loop makes every draft right (accept rate near 1).
* ``repetition``: for backends without acceptance statistics, the last window
  of tokens is one short n-gram repeated.
* ``garbage``: the mean logprob of the chosen tokens over the last window is
  so low that the model is sampling noise.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

from kvwarden.guard.config import AcceptanceConfig, GarbageConfig, MonitorsConfig, RepetitionConfig

REASONS = ("acceptance", "repetition", "garbage")


@dataclass(frozen=True)
class Verdict:
    """Why a monitor stopped a generation (``reason`` is the metrics label)."""

    reason: str
    detail: str


@dataclass
class ChoiceWatch:
    """What one choice has produced so far, as the monitors need it.

    Attributes:
        num_tokens: tokens generated (counted from logprobs entries when the
            backend sends them, else from usage, else one per chunk).
        tokens: token identities (ids or strings), for loop detection.
        logprobs: the chosen tokens' logprobs, when the backend sent them.
        accept_length / accept_rate: the backend's cumulative acceptance
            statistics for this choice (``None`` when it reports none).
        finished: the backend sent a ``finish_reason``.
    """

    num_tokens: int = 0
    tokens: list[Hashable] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    accept_length: float | None = None
    accept_rate: float | None = None
    finished: bool = False


def check_acceptance(watch: ChoiceWatch, cfg: AcceptanceConfig) -> Verdict | None:
    if not cfg.enabled or watch.accept_length is None or watch.num_tokens <= cfg.min_tokens:
        return None
    if watch.accept_length < cfg.min_accept_length:
        return Verdict(
            "acceptance",
            f"accept length {watch.accept_length:.2f} < {cfg.min_accept_length} after {watch.num_tokens} tokens "
            "(draft and target disagree: corrupt KV or garbage)",
        )
    if watch.accept_rate is not None and watch.accept_rate > cfg.max_accept_rate:
        return Verdict(
            "acceptance",
            f"accept rate {watch.accept_rate:.3f} > {cfg.max_accept_rate} after {watch.num_tokens} tokens "
            "(every draft right: a repetition loop)",
        )
    return None


def loop_period(tokens: list[Hashable], window: int, max_period: int) -> int | None:
    """The shortest period ``p <= max_period`` with which the last ``window`` tokens repeat, or ``None``."""
    if len(tokens) < window:
        return None
    tail = tokens[-window:]
    for p in range(1, max_period + 1):
        if all(tail[i] == tail[i - p] for i in range(p, window)):
            return p
    return None


def check_repetition(watch: ChoiceWatch, cfg: RepetitionConfig) -> Verdict | None:
    if not cfg.enabled:
        return None
    period = loop_period(watch.tokens, cfg.window, cfg.max_period)
    if period is None:
        return None
    return Verdict("repetition", f"the last {cfg.window} tokens repeat with period {period}")


def check_garbage(watch: ChoiceWatch, cfg: GarbageConfig) -> Verdict | None:
    if not cfg.enabled or len(watch.logprobs) < cfg.window:
        return None
    recent = watch.logprobs[-cfg.window :]
    mean = sum(recent) / len(recent)
    if mean < cfg.min_mean_logprob:
        return Verdict(
            "garbage", f"mean chosen-token logprob {mean:.2f} < {cfg.min_mean_logprob} over the last {cfg.window}"
        )
    return None


def check(watch: ChoiceWatch, cfg: MonitorsConfig) -> Verdict | None:
    """The first monitor that fires, in a fixed order (acceptance, repetition, garbage)."""
    return (
        check_acceptance(watch, cfg.acceptance)
        or check_repetition(watch, cfg.repetition)
        or check_garbage(watch, cfg.garbage)
    )
