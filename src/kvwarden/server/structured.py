"""Structured outputs over HTTP: OpenAI's ``response_format`` and vLLM's ``structured_outputs`` / ``guided_*``.

Every spelling becomes one :class:`StructuredOutputsParams`; more than one in a
request is a 400 naming both (which one should win is not ours to guess). The
constraint is compiled before the request is queued, on a worker thread
(``formatting.compile_constraint``): a schema the grammar library cannot compile
is a 400 naming the field, and the engine's step loop only ever finds compiled
grammars in its cache.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvwarden.engine.structured.params import StructuredOutputsParams

# vLLM's request fields for guided decoding that kvwarden implements; other guided_* fields are refused.
GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow", populate_by_name=True)


class JsonSchemaFormat(_Strict):
    """``response_format.json_schema``: a name, the schema, and OpenAI's ``strict`` flag."""

    name: str
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None  # the schema is always enforced exactly (a mask cannot be "best effort")


class ResponseFormat(_Strict):
    """OpenAI's ``response_format``: ``text`` (no constraint), ``json_object`` or ``json_schema``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(_Strict):
    """vLLM's ``structured_outputs`` object (exactly one of json, regex, choice, grammar, json_object).

    Its other keys (``structural_tag``, ``whitespace_pattern``, ...) are refused as unrecognised.
    """

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False


def constraint_of(req: Any) -> tuple[StructuredOutputsParams, str] | None:
    """The request's constraint and the field it came from (for error messages); ``None`` without one.

    Raises:
        ValueError: ``(field, message)`` as args - more than one spelling, or a malformed one.
    """
    found: list[tuple[str, dict[str, Any]]] = []
    rf: ResponseFormat | None = req.response_format
    if rf is not None and rf.type != "json_schema" and rf.json_schema is not None:
        raise ValueError("response_format.json_schema", f"only read with type json_schema (type is {rf.type})")
    if rf is not None and rf.type == "json_object":
        found.append(("response_format", {"json_object": True}))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise ValueError("response_format.json_schema", "type json_schema needs json_schema.schema")
        found.append(("response_format.json_schema.schema", {"json": rf.json_schema.schema_}))
    so: StructuredOutputsField | None = req.structured_outputs
    if so is not None:
        spellings = {"json": so.json_, "regex": so.regex, "choice": so.choice, "grammar": so.grammar}
        spellings["json_object"] = so.json_object or None  # false means "no constraint"
        given = {k: v for k, v in spellings.items() if v is not None}
        if not given:
            raise ValueError("structured_outputs", "give one of json, regex, choice, grammar or json_object")
        if so.disable_any_whitespace and not given.keys() & {"json", "json_object"}:
            raise ValueError("structured_outputs.disable_any_whitespace", "applies to json and json_object only")
        whitespace = {"any_whitespace": not so.disable_any_whitespace}
        found += [(f"structured_outputs.{k}", {k: v, **whitespace}) for k, v in given.items()]
    for name in GUIDED_FIELDS:
        value = getattr(req, name, None)
        if value is not None:
            found.append((name, {name.removeprefix("guided_"): value}))
    if not found:
        return None
    if len(found) > 1:
        raise ValueError(found[1][0], f"only one structured-output constraint per request (also got {found[0][0]})")
    field, kwargs = found[0]
    try:
        return StructuredOutputsParams(**kwargs), field
    except ValueError as exc:
        raise ValueError(field, str(exc).split(": ", 1)[-1]) from exc
