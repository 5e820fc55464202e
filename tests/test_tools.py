"""Tool calling and reasoning output on ``/v1/chat/completions``, through the official ``openai`` client.

The model has random weights, so what it chooses to say is noise; what is asserted is what the contract
makes exact: a ``required`` or named call is constrained by the tool's JSON schema (the arguments always
parse and validate), the calls arrive as OpenAI ``tool_calls`` (whole and streamed), the conversation with
calls and tool results renders through the checkpoint's template, and what cannot be served is refused by
name. The parsers themselves are checked on the formats the families write.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from kvwarden.server.reasoning import PARSERS as REASONING
from kvwarden.server.reasoning import StreamedReasoning
from kvwarden.server.tool_parsers import PARSERS, StreamedCalls
from server_util import Server, running_server

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "days": {"type": "integer", "minimum": 1, "maximum": 14},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}, "additionalProperties": False}},
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(llama_tiny: Path) -> Iterator[Server]:
    args = ["--served-model-name", "m", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    with running_server(str(llama_tiny), *args) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def _valid_weather(arguments: str) -> None:
    args = json.loads(arguments)
    assert set(args) == {"city", "days"} and isinstance(args["city"], str) and len(args["city"]) <= 12
    assert isinstance(args["days"], int) and 1 <= args["days"] <= 14


@pytest.mark.parametrize("stream", [False, True])
def test_a_named_function_is_called_with_arguments_under_its_schema(client: openai.OpenAI, stream: bool) -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    kw = dict(
        model="m", messages=ASK, tools=[WEATHER, TIME], tool_choice=choice, max_tokens=100, temperature=0.8, seed=1
    )
    if not stream:
        out = client.chat.completions.create(**kw)
        msg = out.choices[0].message
        assert out.choices[0].finish_reason == "tool_calls"  # the schema bounds the call: it always completes
        assert msg.content is None and len(msg.tool_calls) == 1
        call = msg.tool_calls[0]
        assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
        _valid_weather(call.function.arguments)
        return
    calls, finish, contents = [], None, []
    for chunk in client.chat.completions.create(**kw, stream=True):
        delta = chunk.choices[0].delta
        calls += delta.tool_calls or []
        contents.append(delta.content or "")
        finish = chunk.choices[0].finish_reason or finish
    assert "".join(contents) == ""  # the call's JSON never leaks as content
    assert finish == "tool_calls"
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].function.name == "get_weather"
    _valid_weather(calls[0].function.arguments)


def test_required_calls_one_or_more_tools_each_under_its_schema(client: openai.OpenAI) -> None:
    for seed in range(3):
        out = client.chat.completions.create(
            model="m", messages=ASK, tools=[WEATHER, TIME], tool_choice="required", max_tokens=120, temperature=0.7,
            seed=seed, parallel_tool_calls=False,
        )  # fmt: skip
        assert out.choices[0].finish_reason == "tool_calls"
        calls = out.choices[0].message.tool_calls
        assert len(calls) == 1  # parallel_tool_calls false: at most one
        assert calls[0].function.name in ("get_weather", "get_time")
        if calls[0].function.name == "get_weather":
            _valid_weather(calls[0].function.arguments)
        else:
            assert isinstance(json.loads(calls[0].function.arguments), dict)


def test_auto_answers_with_content_when_no_call_is_opened_and_the_history_renders(client: openai.OpenAI) -> None:
    """``auto`` with the hermes parser: free text until the model writes ``<tool_call>`` (a random model does
    not). A conversation holding an assistant's calls and the tool's answer renders through the template."""
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]  # fmt: skip
    out = client.chat.completions.create(model="m", messages=history, tools=[WEATHER], max_tokens=12, temperature=0.0)
    msg = out.choices[0].message
    assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert msg.content or msg.tool_calls
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(
            model="m", messages=history, tools=[WEATHER], max_tokens=12, temperature=0.0, stream=True
        )
    )
    if not msg.tool_calls:
        assert streamed == msg.content


@pytest.mark.parametrize(
    ("edit", "param", "message"),
    [
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
         "no tool named 'nope'"),
        ({"tools": [WEATHER, WEATHER]}, "tools", "must be unique"),
        ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tools",
         "one constraint per answer"),
        ({"chat_template_kwargs": {"enable_thinking": False}}, "chat_template_kwargs.enable_thinking",
         "does not read it"),
        ({"functions": [{"name": "f"}]}, "functions", "use tools"),
    ],
)  # fmt: skip
def test_what_cannot_be_served_is_refused_by_name(client: openai.OpenAI, edit: dict, param: str, message: str) -> None:
    body = {"model": "m", "messages": ASK, "max_tokens": 4}
    extra = {k: v for k, v in edit.items() if k not in ("tools", "tool_choice", "response_format")}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(**body, **{k: v for k, v in edit.items() if k not in extra}, extra_body=extra)
    assert err.value.body["param"] == param and message in err.value.body["message"]


def test_auto_needs_the_servers_flags(llama_tiny: Path) -> None:
    with running_server(str(llama_tiny), "--served-model-name", "m") as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="--enable-auto-tool-choice and --tool-call-parser"):
            client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER], max_tokens=4)
        # a named call needs no parser: the schema constrains it
        out = client.chat.completions.create(
            model="m", messages=ASK, tools=[WEATHER], max_tokens=100,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
        )  # fmt: skip
        assert out.choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize(
    ("name", "text", "content", "calls"),
    [
        ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
         "Let me check.", [("get_weather", {"city": "Paris"})]),
        ("hermes", '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": '
         '{"x": 1}}</tool_call>', "", [("a", {}), ("b", {"x": 1})]),
        ("hermes", "no call <tool_call>not json</tool_call>", "no call <tool_call>not json</tool_call>", []),
        ("glm45", "Sure.<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
         "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>", "Sure.",
         [("get_weather", {"city": "Paris", "days": 3})]),
        ("llama3_json", '<|python_tag|>{"name": "get_time", "parameters": {"tz": "UTC"}}', "",
         [("get_time", {"tz": "UTC"})]),
        ("llama3_json", "Just text, no call.", "Just text, no call.", []),
    ],
)  # fmt: skip
def test_the_parsers_read_each_familys_format_whole_and_streamed(
    name: str, text: str, content: str, calls: list
) -> None:
    parser = PARSERS[name]
    got_content, got = parser.parse(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
    for step in (1, 4, 11):  # any chunking streams the same content and the same calls
        stream = StreamedCalls(parser)
        sent = "".join(stream.feed(text[i : i + step]) for i in range(0, len(text), step))
        rest, streamed = stream.finish()
        assert [(c.name, c.arguments) for c in streamed] == [(c.name, c.arguments) for c in got]
        assert (sent + rest).strip() == content.strip() if calls else sent + rest == text


@pytest.mark.parametrize(
    ("name", "text", "reasoning", "content"),
    [
        ("qwen3", "<think>\nLet me add.\n</think>\n\n2 + 2 = 4", "Let me add.", "2 + 2 = 4"),
        ("qwen3", "Thinking was off: 4", None, "Thinking was off: 4"),
        ("deepseek_r1", "Adding two and two.</think>4", "Adding two and two.", "4"),
        ("deepseek_r1", "cut off while thinking", "cut off while thinking", ""),
    ],
)
def test_reasoning_is_split_from_the_answer_whole_and_streamed(
    name: str, text: str, reasoning: str | None, content: str
) -> None:
    parser = REASONING[name]
    assert parser.split(text) == (reasoning, content)
    for step in (1, 2, 5, 9):
        stream = StreamedReasoning(parser)
        pieces = [p for i in range(0, len(text), step) for p in stream.feed(text[i : i + step])] + stream.finish()
        got_r = "".join(t for k, t in pieces if k == "reasoning_content") or None
        assert (got_r, "".join(t for k, t in pieces if k == "content")) == (reasoning, content)


def test_reasoning_output_through_the_server(llama_tiny: Path) -> None:
    """With ``--reasoning-parser qwen3`` an answer without ``<think>`` is all content, ``reasoning_content``
    null (a random model does not think), whole and streamed alike; a constraint then applies after the
    reasoning block (the regex's text is the content)."""
    with running_server(str(llama_tiny), "--served-model-name", "m", "--reasoning-parser", "qwen3") as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        out = client.chat.completions.create(model="m", messages=ASK, max_tokens=10, temperature=0.0)
        msg = out.choices[0].message
        assert msg.model_extra["reasoning_content"] is None and msg.content
        chunks = list(client.chat.completions.create(model="m", messages=ASK, max_tokens=10, temperature=0.0,
                                                     stream=True))  # fmt: skip
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == msg.content
        digits = {"structured_outputs": {"regex": "[0-9]{3}"}}
        for seed in range(3):
            regex = client.chat.completions.create(
                model="m", messages=ASK, max_tokens=40, temperature=1.0, seed=seed, extra_body=digits
            )
            m = regex.choices[0].message
            if regex.choices[0].finish_reason == "stop":  # done: the content (after any reasoning) is the regex's
                assert len(m.content) == 3 and m.content.isdigit(), (m.content, m.model_extra)
