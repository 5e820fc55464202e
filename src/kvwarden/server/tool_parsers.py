"""Tool calls in a model's text, in the formats the supported families emit (``--tool-call-parser NAME``, vLLM's
names): Hermes-style ``<tool_call>{json}</tool_call>`` (Qwen2.5, Qwen3), GLM-4.5 / GLM-5's ``<tool_call>name
<arg_key>..</arg_key><arg_value>..</arg_value></tool_call>``, and Llama 3.x's bare JSON object.

A parser turns the whole text into ``(content, calls)``. Streaming sends content until the text reaches the
parser's ``start`` marker (holding back a suffix that may be the marker's beginning), then waits for the end
and sends the calls whole (``StreamedCalls``): one delta per call, its arguments complete.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # a JSON object as text


def _call(obj: Any, args_key: str = "arguments") -> ParsedCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False))


class HermesParser:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number, text around them is content."""

    name = "hermes"
    start = "<tool_call>"
    _block = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)

    def parse(self, text: str) -> tuple[str, list[ParsedCall]]:
        calls: list[ParsedCall] = []
        kept: list[str] = []
        last = 0
        for m in self._block.finditer(text):
            try:
                call = _call(json.loads(m.group(1)))
            except json.JSONDecodeError:
                call = None
            if call is None:
                continue  # not a well-formed call: stays in the content
            kept.append(text[last : m.start()])
            last = m.end()
            calls.append(call)
        kept.append(text[last:])
        return "".join(kept).strip() if calls else text, calls


class Glm45Parser:
    """GLM-4.5 / GLM-5: ``<tool_call>NAME\\n<arg_key>K</arg_key>\\n<arg_value>V</arg_value>...</tool_call>``; a
    value that reads as JSON is that JSON, else a string."""

    name = "glm45"
    start = "<tool_call>"
    _block = re.compile(r"<tool_call>\s*([^\s<]+)\s*(.*?)</tool_call>", re.S)
    _pair = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)

    def parse(self, text: str) -> tuple[str, list[ParsedCall]]:
        calls, kept, last = [], [], 0
        for m in self._block.finditer(text):
            args: dict[str, Any] = {}
            for key, value in self._pair.findall(m.group(2)):
                try:
                    args[key.strip()] = json.loads(value)
                except json.JSONDecodeError:
                    args[key.strip()] = value
            kept.append(text[last : m.start()])
            last = m.end()
            calls.append(ParsedCall(m.group(1), json.dumps(args, ensure_ascii=False)))
        kept.append(text[last:])
        return "".join(kept).strip() if calls else text, calls


class Llama3JsonParser:
    """Llama 3.x: the answer is a JSON object ``{"name": ..., "parameters": {...}}`` (``<|python_tag|>`` first,
    optionally; several separated by ``;``). Anything else is content."""

    name = "llama3_json"
    start = "{"

    def parse(self, text: str) -> tuple[str, list[ParsedCall]]:
        body = text.strip().removeprefix(PYTHON_TAG).strip()
        if not body.startswith("{"):
            return text, []
        calls = []
        decoder = json.JSONDecoder()
        at = 0
        while at < len(body):
            try:
                obj, end = decoder.raw_decode(body, at)
            except json.JSONDecodeError:
                return text, []
            call = _call(obj, "parameters")
            if call is None:
                return text, []
            calls.append(call)
            at = end
            while at < len(body) and body[at] in " \n\t;":
                at += 1
        return "", calls


PYTHON_TAG = "<|python_tag|>"
PARSERS = {p.name: p for p in (HermesParser(), Glm45Parser(), Llama3JsonParser())}


class StreamedCalls:
    """Content deltas of a streamed answer until its tool-call marker; the calls once the answer ends."""

    def __init__(self, parser: Any) -> None:
        self.parser = parser
        self.text = ""
        self.sent = 0  # characters of ``text`` already sent as content
        self.in_calls = False

    def feed(self, delta: str) -> str:
        """The content that can be sent now."""
        self.text += delta
        if self.in_calls:
            return ""
        at = self.text.find(self.parser.start, self.sent)
        if self.parser.start == "{":  # Llama 3: a call is the whole answer, so only a leading "{" opens one
            head = self.text.lstrip()
            if self.sent == 0 and (not head or PYTHON_TAG.startswith(head)):
                return ""  # undecided: the answer may still open with <|python_tag|>
            if self.sent == 0 and head.startswith(("{", PYTHON_TAG)):
                self.in_calls = True
                return ""
            at = -1
        if at >= 0:
            self.in_calls = True
            out, self.sent = self.text[self.sent : at], at
            return out
        hold = _held(self.text, self.parser.start)
        out = self.text[self.sent : len(self.text) - hold]
        self.sent = len(self.text) - hold
        return out

    def finish(self) -> tuple[str, list[ParsedCall]]:
        """``(content not yet sent, calls)`` of the whole answer."""
        content, calls = self.parser.parse(self.text)
        if not calls:
            return self.text[self.sent :], []
        rest = self.parser.parse(self.text[self.sent :])[0] if self.sent < len(self.text) else ""
        return (rest if content else ""), calls


def _held(text: str, marker: str) -> int:
    """How many trailing characters of ``text`` could be the beginning of ``marker`` (held back, unsent)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
