"""What a request's output must match (vLLM's ``StructuredOutputsParams``), validated on construction."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one constraint on the generated text.

    Attributes:
        json: a JSON schema (a dict, or its JSON text); the output is one JSON value it accepts.
        regex: the output matches this regular expression as a whole.
        choice: the output is one of these strings.
        grammar: a grammar in GBNF (llama.cpp's EBNF, start rule ``root``) or Lark (start rule ``start``).
        json_object: the output is any JSON object.
        any_whitespace: JSON outputs may put whitespace between tokens (vLLM's default); ``False``
            keeps them compact (vLLM's ``disable_any_whitespace``).

    Raises:
        ValueError: naming the field, when no constraint or more than one is given, or a value has the
            wrong type (a schema that the grammar library cannot compile is refused when it compiles).
    """

    json: str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False
    any_whitespace: bool = True

    def __init__(
        self,
        json: str | dict[str, Any] | None = None,
        regex: str | None = None,
        choice: list[str] | tuple[str, ...] | None = None,
        grammar: str | None = None,
        json_object: bool = False,
        any_whitespace: bool = True,
    ) -> None:
        set_ = object.__setattr__  # frozen: the constructor normalises once
        set_(self, "json", _schema_text(json))
        set_(self, "regex", _text("regex", regex))
        set_(self, "choice", _choices(choice))
        set_(self, "grammar", _text("grammar", grammar))
        if not isinstance(json_object, bool) or not isinstance(any_whitespace, bool):
            raise ValueError("structured_outputs: json_object and any_whitespace must be true or false")
        set_(self, "json_object", json_object)
        set_(self, "any_whitespace", any_whitespace)
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            what = "none" if not given else " and ".join(given)
            raise ValueError(f"structured_outputs: give exactly one of {', '.join(KINDS)} (got {what})")

    @property
    def kind(self) -> str:
        """Which constraint this is: one of ``KINDS``."""
        return next(k for k in KINDS if getattr(self, k) not in (None, False))


def _schema_text(value: str | dict[str, Any] | None) -> str | None:
    """A schema as compact JSON text (the cache key). Key order is kept: it is the order the properties
    are generated in, so two orders are two different constraints."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"structured_outputs.json: not valid JSON ({exc})") from exc
        except RecursionError as exc:
            raise ValueError("structured_outputs.json: nested too deeply to parse") from exc
    if not isinstance(value, dict):
        raise ValueError(f"structured_outputs.json: a JSON schema is an object, got {type(value).__name__}")
    try:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    except RecursionError as exc:
        raise ValueError("structured_outputs.json: nested too deeply") from exc


def _text(name: str, value: str | None) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ValueError(f"structured_outputs.{name}: must be a non-empty string")
    return value


def _choices(value: list[str] | tuple[str, ...] | None) -> tuple[str, ...] | None:
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or not value or not all(isinstance(c, str) and c for c in value):
        raise ValueError("structured_outputs.choice: must be a non-empty list of non-empty strings")
    return tuple(value)
