"""Tool calling and reasoning output on ``/v1/chat/completions``: what a request's ``tools`` / ``tool_choice``
constrain and parse, and how an answer becomes ``content``, ``reasoning_content`` and ``tool_calls``.

* ``tool_choice: "required"`` or a named function: the answer is *constrained* - a JSON array of calls, each
  ``{"name", "arguments"}`` with the arguments under the tool's own JSON schema, or the named function's
  arguments object - by the structured-output machinery (invariant as it is), whatever the parser.
* ``"auto"`` (needs ``--enable-auto-tool-choice`` and ``--tool-call-parser``, as vLLM): the answer is free
  text; with the ``hermes`` parser the constraint starts where the model opens a call (``<tool_call>``): the
  call's JSON is then one of the tools' schemas. Other parsers parse what the model wrote.
* ``"none"``: no call is made or parsed (the tools still reach the template, as vLLM renders them).
* With ``--reasoning-parser``, a constraint applies to the answer after ``</think>``.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from kvwarden.engine.structured.params import StructuredOutputsParams
from kvwarden.server.protocol import ApiError
from kvwarden.server.reasoning import END, START, ReasoningParser, StreamedReasoning
from kvwarden.server.tool_parsers import PARSERS, ParsedCall, StreamedCalls
from kvwarden.server.tool_protocol import NamedToolChoice, ToolDef

TOOL_PARSERS = tuple(PARSERS)


@dataclass(frozen=True)
class ToolSettings:
    """The server's flags: ``--enable-auto-tool-choice``, ``--tool-call-parser``, ``--reasoning-parser``."""

    auto_tool_choice: bool = False
    tool_parser: str | None = None
    reasoning_parser: ReasoningParser | None = None


@dataclass(frozen=True)
class ToolPlan:
    """What one request does with its tools: ``mode`` none / auto / required / named."""

    mode: str
    parser: Any = None  # auto: how calls are read from the text
    named: str | None = None  # named: the function
    constraint: StructuredOutputsParams | None = None


def _schema(tool: ToolDef) -> dict[str, Any]:
    return tool.function.parameters or {"type": "object"}


def plan(req: Any, settings: ToolSettings) -> ToolPlan:
    """The request's tool plan; 400 naming the field for what cannot be served."""
    tools: list[ToolDef] = req.tools or []
    choice = req.tool_choice if req.tool_choice is not None else ("auto" if tools else "none")
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise ApiError(400, f"tools: function names must be unique, got {names}", "tools", "invalid_value")
    if choice != "none" and not tools:
        raise ApiError(400, f"tool_choice {_say(choice)} needs tools", "tool_choice", "invalid_value")
    if choice == "none":
        return ToolPlan("none")
    if _constrained(req):
        raise ApiError(
            400, "tools cannot be combined with response_format / structured_outputs (one constraint per answer)",
            "tools", "invalid_value",
        )  # fmt: skip
    single = req.parallel_tool_calls is False
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise ApiError(400, f"tool_choice: no tool named {choice.function.name!r} in tools", "tool_choice")
        tool = tools[names.index(choice.function.name)]
        return ToolPlan("named", named=tool.function.name, constraint=_json(_schema(tool)))
    items = {"anyOf": [_call_schema(t) for t in tools]}
    if choice == "required":
        array: dict[str, Any] = {"type": "array", "items": items, "minItems": 1}
        if single:
            array["maxItems"] = 1
        return ToolPlan("required", constraint=_json(array))
    if not settings.auto_tool_choice or settings.tool_parser is None:
        raise ApiError(
            400, '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set',
            "tool_choice", "invalid_value",
        )  # fmt: skip
    parser = PARSERS[settings.tool_parser]
    if parser.name != "hermes":
        return ToolPlan("auto", parser=parser)
    # the model writes freely until it opens a call; the call's JSON is then one of the tools' (llguidance's
    # stop lexeme: the text ends where "<tool_call>" is written, the token stays in the output)
    calls = 'call?\ncall: json "</tool_call>"' if single else 'call*\ncall: json "</tool_call>" text'
    lark = f'start: text {calls}\ntext[stop="<tool_call>"]: /(?s:.*)/\njson: %json {_lark_schema(items, False)}\n'
    return ToolPlan("auto", parser=parser, constraint=StructuredOutputsParams(grammar=lark))


def _call_schema(tool: ToolDef) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": tool.function.name}, "arguments": _schema(tool)},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _lark_schema(schema: dict[str, Any], any_whitespace: bool) -> str:
    """A JSON schema for llguidance's ``%json`` in a Lark grammar (its whitespace rule travels inside it)."""
    if not schema:
        schema = {"type": "object"}
    return json.dumps({**schema, "x-guidance": {"whitespace_flexible": any_whitespace}})


def _json(schema: dict[str, Any]) -> StructuredOutputsParams:
    # compact JSON, as models write calls: free whitespace would let a model spin in blanks inside a call
    return StructuredOutputsParams(json=json.dumps(schema), any_whitespace=False)


def _constrained(req: Any) -> bool:
    fields = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar")
    return any(getattr(req, f, None) is not None for f in fields)


def _say(choice: Any) -> str:
    return json.dumps(choice) if isinstance(choice, str) else f"function {choice.function.name!r}"


def after_reasoning(constraint: StructuredOutputsParams | None, reasoning: ReasoningParser | None) -> Any:
    """The constraint as it applies after ``</think>`` when a reasoning parser is on (as vLLM does)."""
    if constraint is None or reasoning is None:
        return constraint
    if constraint.json is not None or constraint.json_object:
        rules = f"answer: %json {_lark_schema(json.loads(constraint.json or '{}'), constraint.any_whitespace)}\n"
    elif constraint.regex is not None:
        rules = "answer: /" + constraint.regex.replace("/", "\\/") + "/\n"
    elif constraint.choice is not None:
        rules = "answer: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in constraint.choice) + "\n"
    elif constraint.grammar is not None and constraint.grammar.startswith("start: text"):
        rules = constraint.grammar.replace("start:", "answer:", 1)  # auto tool calls (ours, above)
    else:
        raise ApiError(
            400, "structured_outputs.grammar cannot follow a reasoning block yet (json, regex and choice can)",
            "structured_outputs", "unsupported_parameter",
        )  # fmt: skip
    opener = "" if reasoning.opens_in_prompt else f'"{START}" '
    start = "start: think answer" if reasoning.opens_in_prompt else "start: think? answer"
    lark = f'{start}\nthink: {opener}thought\nthought[stop="{END}"]: /(?s:.*)/\n{rules}'
    return StructuredOutputsParams(grammar=lark)


def message(text: str, tools: ToolPlan, reasoning: ReasoningParser | None) -> tuple[dict[str, Any], bool]:
    """``(the assistant message, whether it calls tools)`` of a whole answer."""
    thought, content = reasoning.split(text) if reasoning is not None else (None, text)
    calls: list[ParsedCall] = []
    if tools.mode in ("named", "required"):
        calls, content = _constrained_calls(content, tools), ""
    elif tools.mode == "auto":
        content, calls = tools.parser.parse(content)
    body: dict[str, Any] = {"role": "assistant", "content": content if content or not calls else None}
    if reasoning is not None:
        body["reasoning_content"] = thought
    if calls:
        body["tool_calls"] = [wire_call(c) for c in calls]
    return body, bool(calls)


def _constrained_calls(text: str, tools: ToolPlan) -> list[ParsedCall]:
    """The calls of a constrained answer (the grammar made it valid JSON; a cut-off answer has none)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return []
    if tools.mode == "named":
        return [ParsedCall(tools.named or "", json.dumps(value, ensure_ascii=False))]
    return [ParsedCall(c["name"], json.dumps(c["arguments"], ensure_ascii=False)) for c in value]


def wire_call(call: ParsedCall, index: int | None = None) -> dict[str, Any]:
    """OpenAI's ``tool_calls`` entry (``index`` in a streamed delta)."""
    out: dict[str, Any] = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function"}
    out["function"] = {"name": call.name, "arguments": call.arguments}
    return out if index is None else {"index": index, **out}


def template_messages(req: Any) -> list[dict[str, Any]]:
    """The conversation as the chat template reads it: an assistant's ``tool_calls`` with their arguments as
    objects (templates ``tojson`` them), a tool message's ``tool_call_id``."""
    out = []
    for m in req.messages:
        msg: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.tool_calls:
            msg["tool_calls"] = [
                {"id": c.id, "type": c.type, "function": {"name": c.function.name, "arguments": _args(c, i)}}
                for i, c in enumerate(m.tool_calls)
            ]
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            msg["name"] = m.name
        out.append(msg)
    return out


def _args(call: Any, i: int) -> Any:
    try:
        return json.loads(call.function.arguments)
    except json.JSONDecodeError as exc:
        raise ApiError(
            400, f"tool_calls[{i}].function.arguments: not a JSON object ({exc})", "messages", "invalid_value"
        ) from exc


class ChoiceStream:
    """One streamed choice's deltas: ``reasoning_content`` and ``content`` as they come, ``tool_calls`` when
    the answer ends (a constrained call's JSON is sent as calls, never as content)."""

    def __init__(self, tools: ToolPlan, reasoning: ReasoningParser | None) -> None:
        self.tools, self.parser = tools, reasoning
        self.reasoning = StreamedReasoning(reasoning) if reasoning is not None else None
        self.calls = StreamedCalls(tools.parser) if tools.mode == "auto" else None
        self.text = ""
        self.called = False

    def feed(self, text: str) -> list[dict[str, Any]]:
        self.text += text
        return self._route(self.reasoning.feed(text) if self.reasoning is not None else [("content", text)])

    def finish(self) -> list[dict[str, Any]]:
        out = self._route(self.reasoning.finish()) if self.reasoning is not None else []
        calls: list[ParsedCall] = []
        if self.calls is not None:
            rest, calls = self.calls.finish()
            if rest:
                out.append({"content": rest})
        elif self.tools.mode in ("named", "required"):
            content = self.parser.split(self.text)[1] if self.parser is not None else self.text
            calls = _constrained_calls(content, self.tools)
        if calls:
            self.called = True
            out.append({"tool_calls": [wire_call(c, i) for i, c in enumerate(calls)]})
        return out

    def _route(self, pieces: list[tuple[str, str]]) -> list[dict[str, Any]]:
        out = []
        for kind, text in pieces:
            if kind == "reasoning_content":
                out.append({kind: text})
            elif self.tools.mode in ("named", "required"):
                continue  # the call's JSON: sent as tool_calls at the end
            elif self.calls is not None:
                sendable = self.calls.feed(text)
                if sendable:
                    out.append({"content": sendable})
            else:
                out.append({"content": text})
        return out
