"""Probe scenarios: documents, requests, arms, server settings; from YAML/TOML files or built in.

A scenario file (YAML, or TOML with the same fields)::

    name: lease-questions
    max_tokens: 16
    top_logprobs: 20
    ignore_eos: false                # true: always generate max_tokens (kvwarden, vLLM, llama.cpp)
    server: {block_size: 16, max_num_batched_tokens: 512}
    documents:
      lease: {bundled: 1}            # or {file: lease.txt} or {text: "..."}
    requests:
      A: {document: lease, question: "Who signed it?"}
      B: {document: lease, question: "What is the total amount, and when is it due?"}
    arms:
      clean:        {steps: [{request: B, repeat: 5}]}
      contaminated: {steps: [{request: A}, {request: B, repeat: 5}]}
      no-cache:     {server: {prefix_caching: false}, steps: [{request: B, repeat: 5}]}

In each arm the measured request is the last step's (override with
``measure: true`` on a step). ``concurrent_noise: N`` sends N unrelated requests
alongside every run of a step. Errors name the file, the line and the field.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kvwarden.models.bundled import documents as bundled_documents
from kvwarden.probe.launchers import ServerSettings

SERVER_FIELDS = {
    "prefix_caching",
    "block_size",
    "max_num_batched_tokens",
    "speculative",
    "num_speculative_tokens",
    "chunking",
    "numerics",
    "device",
    "dtype",
    "extra_args",
}


class ScenarioError(ValueError):
    """A scenario file problem, naming file, line and field."""


@dataclass(frozen=True)
class Request:
    name: str
    prompt: str | list[int]


@dataclass(frozen=True)
class Step:
    request: str
    repeat: int = 1
    measure: bool = False
    concurrent_noise: int = 0


@dataclass(frozen=True)
class Arm:
    name: str
    steps: tuple[Step, ...]
    server: ServerSettings

    @property
    def measured_step(self) -> int:
        marked = [i for i, s in enumerate(self.steps) if s.measure]
        return marked[-1] if marked else len(self.steps) - 1


@dataclass(frozen=True)
class Scenario:
    name: str
    requests: dict[str, Request]
    arms: tuple[Arm, ...]
    max_tokens: int = 16
    top_logprobs: int = 20
    compare_arms: tuple[str, ...] = ()  # arms whose measured fingerprints should also agree with each other
    notes: dict[str, Any] = field(default_factory=dict)
    ignore_eos: bool = False  # generate max_tokens even past an end-of-sequence token (vLLM's extension)


class _Located:
    """Field access with the line it came from (YAML node marks; TOML best effort)."""

    def __init__(self, path: Path, text: str, lines: dict[str, int]) -> None:
        self.path, self.text, self.lines = path, text, lines

    def error(self, field_path: str, message: str) -> ScenarioError:
        line = self.lines.get(field_path)
        if line is None:  # fall back to the first line naming the last key
            key = field_path.rsplit(".", 1)[-1]
            line = next((i + 1 for i, t in enumerate(self.text.splitlines()) if key in t), None)
        where = f"{self.path}:{line}" if line else str(self.path)
        return ScenarioError(f"{where}: {field_path}: {message}")


def _yaml_lines(node: yaml.Node, prefix: str, out: dict[str, int]) -> None:
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            path = f"{prefix}.{key.value}" if prefix else str(key.value)
            out[path] = key.start_mark.line + 1
            _yaml_lines(value, path, out)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            path = f"{prefix}[{i}]"
            out[path] = item.start_mark.line + 1
            _yaml_lines(item, path, out)


def load_scenario(path: str | Path, defaults: ServerSettings | None = None) -> Scenario:
    """Parse and validate a scenario file.

    Raises:
        ScenarioError: naming the file, line and field of the first problem.
    """
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ScenarioError(f"{path}: cannot read: {exc}") from exc
    lines: dict[str, int] = {}
    try:
        if path.suffix == ".toml":
            data = tomllib.loads(text)
        else:
            node = yaml.compose(text)
            if node is not None:
                _yaml_lines(node, "", lines)
            data = yaml.safe_load(text)
    except (yaml.YAMLError, tomllib.TOMLDecodeError) as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        raise ScenarioError(f"{where}: not valid {'TOML' if path.suffix == '.toml' else 'YAML'}: {exc}") from exc
    return parse_scenario(data, _Located(path, text, lines), defaults or ServerSettings())


def _expect(loc: _Located, value: Any, kind: type | tuple[type, ...], field_path: str) -> Any:
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise loc.error(field_path, f"expected {names}, got {type(value).__name__} {value!r}")
    return value


def _server(loc: _Located, raw: Any, base: ServerSettings, field_path: str) -> ServerSettings:
    if raw is None:
        return base
    _expect(loc, raw, dict, field_path)
    for key in raw:
        if key not in SERVER_FIELDS:
            raise loc.error(f"{field_path}.{key}", f"unknown server setting (known: {sorted(SERVER_FIELDS)})")
    values = dict(raw)
    if "extra_args" in values:
        values["extra_args"] = tuple(
            str(a) for a in _expect(loc, values["extra_args"], list, f"{field_path}.extra_args")
        )
    for key in ("block_size", "max_num_batched_tokens", "num_speculative_tokens"):
        if key in values:
            _expect(loc, values[key], int, f"{field_path}.{key}")
    for key in ("prefix_caching", "speculative"):
        if key in values:
            _expect(loc, values[key], bool, f"{field_path}.{key}")
    return base.replace(**values)


def _document_text(loc: _Located, name: str, raw: Any) -> str:
    fp = f"documents.{name}"
    _expect(loc, raw, dict, fp)
    if "text" in raw:
        return _expect(loc, raw["text"], str, f"{fp}.text")
    if "file" in raw:
        file = loc.path.parent / _expect(loc, raw["file"], str, f"{fp}.file")
        if not file.is_file():
            raise loc.error(f"{fp}.file", f"no such file {file}")
        return file.read_text()
    if "bundled" in raw:
        number = _expect(loc, raw["bundled"], int, f"{fp}.bundled")
        docs = {d.number: d for d in bundled_documents()}
        if number not in docs:
            raise loc.error(f"{fp}.bundled", f"no bundled document {number} (1..{len(docs)})")
        return docs[number].text
    raise loc.error(fp, "needs one of text, file, bundled")


def parse_scenario(data: Any, loc: _Located, defaults: ServerSettings) -> Scenario:
    _expect(loc, data, dict, "(top level)")
    known = {"name", "max_tokens", "top_logprobs", "ignore_eos", "server", "documents", "requests", "arms"}
    known.add("compare_arms")
    for key in data:
        if key not in known:
            raise loc.error(key, f"unknown field (known: {sorted(known)})")
    name = _expect(loc, data.get("name", loc.path.stem), str, "name")
    max_tokens = _expect(loc, data.get("max_tokens", 16), int, "max_tokens")
    top = _expect(loc, data.get("top_logprobs", 20), int, "top_logprobs")
    if not 1 <= top <= 20:
        raise loc.error("top_logprobs", f"must be between 1 and 20, got {top}")
    if max_tokens < 1:
        raise loc.error("max_tokens", f"must be >= 1, got {max_tokens}")
    base = _server(loc, data.get("server"), defaults, "server")
    docs = {k: _document_text(loc, k, v) for k, v in _expect(loc, data.get("documents", {}), dict, "documents").items()}
    requests: dict[str, Request] = {}
    raw_requests = _expect(loc, data.get("requests"), dict, "requests")
    for rname, raw in raw_requests.items():
        fp = f"requests.{rname}"
        _expect(loc, raw, dict, fp)
        if "prompt" in raw:
            prompt = _expect(loc, raw["prompt"], (str, list), f"{fp}.prompt")
        else:
            doc = _expect(loc, raw.get("document"), str, f"{fp}.document")
            if doc not in docs:
                raise loc.error(f"{fp}.document", f"unknown document {doc!r} (defined: {sorted(docs)})")
            question = _expect(loc, raw.get("question", ""), str, f"{fp}.question")
            prompt = f"{docs[doc]}\n\nQuestion: {question}\nAnswer:"
        requests[rname] = Request(rname, prompt)
    arms = []
    for aname, raw in _expect(loc, data.get("arms"), dict, "arms").items():
        fp = f"arms.{aname}"
        _expect(loc, raw, dict, fp)
        steps = []
        for i, step in enumerate(_expect(loc, raw.get("steps"), list, f"{fp}.steps")):
            sp = f"{fp}.steps[{i}]"
            _expect(loc, step, dict, sp)
            req = _expect(loc, step.get("request"), str, f"{sp}.request")
            if req not in requests:
                raise loc.error(f"{sp}.request", f"unknown request {req!r} (defined: {sorted(requests)})")
            repeat = _expect(loc, step.get("repeat", 1), int, f"{sp}.repeat")
            noise = _expect(loc, step.get("concurrent_noise", 0), int, f"{sp}.concurrent_noise")
            if repeat < 1 or noise < 0:
                raise loc.error(f"{sp}.repeat", "repeat must be >= 1 and concurrent_noise >= 0")
            steps.append(Step(req, repeat, bool(step.get("measure", False)), noise))
        if not steps:
            raise loc.error(f"{fp}.steps", "an arm needs at least one step")
        arms.append(Arm(aname, tuple(steps), _server(loc, raw.get("server"), base, f"{fp}.server")))
    compare = tuple(_expect(loc, data.get("compare_arms", []), list, "compare_arms"))
    for a in compare:
        if a not in {arm.name for arm in arms}:
            raise loc.error("compare_arms", f"unknown arm {a!r}")
    ignore_eos = _expect(loc, data.get("ignore_eos", False), bool, "ignore_eos")
    return Scenario(name, requests, tuple(arms), max_tokens, top, compare, ignore_eos=ignore_eos)
