"""Task suites: extraction tasks with their ground truth, run like a probe scenario (``probe --suite``).

A suite file is JSON Lines, one task per line::

    {"id": "inv-07-date", "document": "Számla ...", "question": "When was it issued?",
     "schema": {"type": "object", ...}, "expected": {"date": "2026-09-03"}}

``schema`` is optional (without it the answer is free text, parsed as JSON if it
can be); ``expected`` maps answer fields to their true values. Tasks that share
a ``document`` text share a prompt prefix, which is what lets one task's cached
blocks serve another's. Errors name the file, the line and the field.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TASK_FIELDS = {"id", "document", "question", "schema", "expected"}


class SuiteError(ValueError):
    """A suite file problem, naming file, line and field."""


@dataclass(frozen=True)
class Task:
    """One extraction task: a question about a document, the answer's schema and the true values."""

    id: str
    document: str
    question: str
    expected: dict[str, Any]
    schema: dict[str, Any] | None = None
    meta: dict[str, Any] = field(default_factory=dict, compare=False)  # e.g. language, kind (built-ins)

    @property
    def prompt(self) -> str:
        """The completion prompt: the document first, so tasks on one document share a prefix."""
        return f"{self.document}\n\nQuestion: {self.question}\nAnswer with JSON only.\nAnswer: "


def load_suite(path: str | Path) -> list[Task]:
    """Tasks of a JSONL suite file.

    Raises:
        SuiteError: naming ``file:line`` and the field (unknown fields included: nothing is ignored).
    """
    path = Path(path)
    if not path.is_file():
        raise SuiteError(f"--suite: {path} is not a file")
    tasks: list[Task] = []
    seen: set[str] = set()
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            raw = json.loads(line)
        except json.JSONDecodeError as exc:
            raise SuiteError(f"{where}: not valid JSON ({exc.msg})") from exc
        task = _task(raw, where)
        if task.id in seen:
            raise SuiteError(f"{where}: id: {task.id!r} appears twice")
        seen.add(task.id)
        tasks.append(task)
    if not tasks:
        raise SuiteError(f"{path}: no tasks")
    return tasks


def _task(raw: Any, where: str) -> Task:
    if not isinstance(raw, dict):
        raise SuiteError(f"{where}: a task is a JSON object, got {type(raw).__name__}")
    unknown = sorted(set(raw) - TASK_FIELDS)
    if unknown:
        raise SuiteError(f"{where}: {unknown[0]}: unknown field; a task has {', '.join(sorted(TASK_FIELDS))}")
    for name in ("id", "document", "question"):
        if not isinstance(raw.get(name), str) or not raw[name].strip():
            raise SuiteError(f"{where}: {name}: required, a non-empty string")
    expected = raw.get("expected")
    if not isinstance(expected, dict) or not expected:
        raise SuiteError(f"{where}: expected: required, an object of answer fields and their true values")
    schema = raw.get("schema")
    if schema is not None and not isinstance(schema, dict):
        raise SuiteError(f"{where}: schema: a JSON schema object, got {type(schema).__name__}")
    return Task(raw["id"], raw["document"], raw["question"], expected, schema)


def write_suite(tasks: list[Task], path: Path) -> None:
    """A suite as JSONL (what ``load_suite`` reads back)."""
    rows = ({"id": t.id, "document": t.document, "question": t.question, "schema": t.schema,
             "expected": t.expected} for t in tasks)  # fmt: skip
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")


def parse_answer(text: str) -> dict[str, Any] | None:
    """The first JSON object in a completion's text, or None (free-text models add words around it)."""
    start = text.find("{")
    while start != -1:
        try:
            value, _ = json.JSONDecoder().raw_decode(text[start:])
        except json.JSONDecodeError:
            start = text.find("{", start + 1)
            continue
        return value if isinstance(value, dict) else None
    return None


def is_correct(answer: dict[str, Any] | None, expected: dict[str, Any]) -> bool:
    """Every expected field present and equal: numbers to the cent, strings ignoring case and outer spaces."""
    if answer is None:
        return False
    return all(_same(answer.get(k), v) for k, v in expected.items())


def _same(got: Any, want: Any) -> bool:
    if isinstance(want, (int, float)) and not isinstance(want, bool):
        if isinstance(got, str):  # "48260" for 48260: the value is right, the type is the schema's business
            try:
                got = float(got.replace(" ", "").replace(",", ""))
            except ValueError:
                return False
        return isinstance(got, (int, float)) and not isinstance(got, bool) and math.isclose(got, want, abs_tol=0.005)
    if isinstance(want, str):
        return isinstance(got, str) and got.strip().casefold() == want.strip().casefold()
    return got == want


def answer_key(text: str) -> str:
    """What "the same answer" means across runs: the parsed JSON in canonical form, else the stripped text."""
    answer = parse_answer(text)
    return json.dumps(answer, sort_keys=True, ensure_ascii=False) if answer is not None else text.strip()


def constraint_body(schema: dict[str, Any] | None, style: str) -> dict[str, Any]:
    """The request fields that ask a server for JSON matching ``schema``.

    Args:
        style: ``response_format`` (OpenAI's, kvwarden and vLLM), ``structured_outputs`` (vLLM's, with
            ``disable_any_whitespace``),
            ``json_schema`` (llama.cpp's) or ``none`` (free text: the prompt alone asks for JSON).
    """
    if schema is None or style == "none":
        return {}
    if style == "response_format":
        return {"response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}}
    if style == "structured_outputs":  # compact JSON, as an extraction client parses it
        return {"structured_outputs": {"json": schema, "disable_any_whitespace": True}}
    if style == "json_schema":
        return {"json_schema": schema}
    raise ValueError(f"--constraint-field: unknown style {style!r}")
