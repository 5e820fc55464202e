"""Per-request sampling parameters, validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

from kvwarden.engine.structured.params import StructuredOutputsParams

MAX_LOGPROBS = 20


@dataclass(frozen=True)
class _Fields:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None


class SamplingParams(_Fields):
    """How to sample one request.

    Attributes:
        temperature: 0 means greedy; otherwise logits are divided by it.
        top_p: nucleus mass kept (0 < top_p <= 1).
        top_k: keep the k most likely tokens (0 = all).
        seed: makes sampling reproducible for this request alone, whatever its
            batch partners; ``None`` draws a fresh seed per request.
        max_tokens: most tokens to generate (>= 1).
        min_tokens: stop tokens are ignored until this many are generated.
        stop: strings that end generation (not included in the text unless
            ``include_stop_str_in_output``).
        stop_token_ids: extra token ids that end generation.
        ignore_eos: keep generating past the model's end-of-sequence tokens.
        logprobs: return the top-k (token id, logprob) pairs of every generated
            token, 0 <= k <= 20 (the sampled token is always included).
        prompt_logprobs: the same for every prompt position (disables prefix hits
            for this request, since cached positions produce no logits).
        structured_outputs: what the text must match (JSON schema, regex, choice,
            grammar); the request ends when the grammar is complete, so it cannot be
            combined with ``ignore_eos`` or ``min_tokens``.

    Raises:
        ValueError: naming the field, for unknown fields or out-of-range values.
    """

    def __init__(self, **kwargs: Any) -> None:
        known = {f.name for f in fields(_Fields)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown sampling field {unknown[0]!r}; known fields: {sorted(known)}")
        if isinstance(kwargs.get("stop"), str):
            kwargs["stop"] = (kwargs["stop"],)
        for name in ("stop", "stop_token_ids"):
            if name in kwargs:
                kwargs[name] = _as_tuple(name, kwargs[name])
        super().__init__(**kwargs)
        self._validate()

    def _validate(self) -> None:
        _number("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        _number("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _integer("top_k", self.top_k)
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = disabled), got {self.top_k}")
        if self.seed is not None:
            _integer("seed", self.seed)
        _integer("max_tokens", self.max_tokens)
        if self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        _integer("min_tokens", self.min_tokens)
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is None:
                continue
            _integer(name, value)
            if not 0 <= value <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be between 0 and {MAX_LOGPROBS}, got {value}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must contain non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            _integer("stop_token_ids", t)
        self._validate_structured()

    def _validate_structured(self) -> None:
        so = self.structured_outputs
        if so is None:
            return
        if not isinstance(so, StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be a StructuredOutputsParams, got {type(so).__name__}")
        # The grammar decides where the text ends (it allows only EOS once complete): generating past
        # it or forbidding the end until some length would contradict the constraint, so refuse both.
        if self.ignore_eos:
            raise ValueError("ignore_eos cannot be combined with structured_outputs (the grammar ends the output)")
        if self.min_tokens:
            raise ValueError("min_tokens cannot be combined with structured_outputs (the grammar ends the output)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def replace(self, **changes: Any) -> SamplingParams:
        values = {f.name: getattr(self, f.name) for f in fields(_Fields)}
        values.update(changes)
        return SamplingParams(**values)


def _as_tuple(name: str, value: Any) -> tuple[Any, ...]:
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(value)
    raise ValueError(f"{name} must be a list, got {type(value).__name__}")


def _number(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")


def _integer(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
