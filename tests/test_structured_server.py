"""Structured outputs over HTTP with the official openai client: every spelling, the errors, invariance.

A real ``kvwarden serve`` on loopback. Each spelling of a constraint (OpenAI's ``response_format``,
vLLM's ``structured_outputs`` and ``guided_*``) must give the same tokens and logprob bytes as the
Python API with the same :class:`StructuredOutputsParams`; a constraint that cannot be compiled is a
400 naming the field, and afterwards the server serves on with every KV block back in the pool.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from kvwarden import LLM, SamplingParams, StructuredOutputsParams
from server_util import Server, running_server

DATE = r"[0-9]{4}-[0-9]{2}-[0-9]{2}"
INVOICE = {
    "type": "object",
    "properties": {
        "date": {"type": "string", "pattern": f"^{DATE}$"},
        "amount": {"type": "integer", "minimum": 0, "maximum": 99999},
        "currency": {"enum": ["EUR", "HUF", "USD"]},
    },
    "required": ["date", "amount", "currency"],
    "additionalProperties": False,
}
DOC = "Számla 2026/118. Kelt: 2026. szeptember 3. Fizetendő: 48 260 Ft. " * 6  # a shared document prefix
MAX_TOKENS = 60


@pytest.fixture(scope="module")
def server(llama_tiny: Path) -> Iterator[Server]:
    args = ("--served-model-name", "tiny", "--block-size", "8", "--max-num-batched-tokens", "64")
    with running_server(str(llama_tiny), *args) as s:
        yield s


@pytest.fixture()
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def _bytes(pairs: list[tuple[int, float]]) -> list[tuple[int, bytes]]:
    return [(t, struct.pack("<d", v)) for t, v in pairs]


def tops(resp: openai.types.Completion) -> list[list[tuple[int, bytes]]]:
    lists = resp.choices[0].logprobs.top_logprobs
    return [_bytes([(int(k.split(":")[1]), v) for k, v in top.items()]) for top in lists]


def complete(client: openai.OpenAI, prompt: str, extra: dict, **kw: object) -> openai.types.Completion:
    args = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "logprobs": 5, **kw}
    return client.completions.create(**args, extra_body={"return_tokens_as_token_ids": True, **extra})


def test_every_spelling_equals_the_python_api(llama_tiny: Path, client: openai.OpenAI) -> None:
    prompt = f"{DOC}Extract the invoice as JSON:"
    llm = LLM(str(llama_tiny), block_size=8)
    spellings = {
        "structured_outputs.json": ({"structured_outputs": {"json": INVOICE}}, StructuredOutputsParams(json=INVOICE)),
        "guided_json": ({"guided_json": INVOICE}, StructuredOutputsParams(json=INVOICE)),
        "guided_regex": ({"guided_regex": DATE}, StructuredOutputsParams(regex=DATE)),
        "guided_choice": ({"guided_choice": ["paid", "unpaid"]}, StructuredOutputsParams(choice=["paid", "unpaid"])),
        "structured_outputs.grammar": (
            {"structured_outputs": {"grammar": 'root ::= "total: " [1-9] [0-9]? " Ft"'}},
            StructuredOutputsParams(grammar='root ::= "total: " [1-9] [0-9]? " Ft"'),
        ),
        "compact json": (
            {"structured_outputs": {"json": INVOICE, "disable_any_whitespace": True}},
            StructuredOutputsParams(json=INVOICE, any_whitespace=False),
        ),
    }
    for name, (extra, params) in spellings.items():
        resp = complete(client, prompt, extra)
        ids = llm.engine.tokenize(prompt)
        ref = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=5,
                                                 structured_outputs=params))[0]  # fmt: skip
        assert tops(resp) == [_bytes(top) for top in ref.logprobs], name
        assert resp.choices[0].text == ref.text, name
        text = resp.choices[0].text
        if name == "guided_regex":  # finite languages: they end within MAX_TOKENS, and must match whole
            assert resp.choices[0].finish_reason == "stop" and re.fullmatch(DATE, text), text
        elif name == "guided_choice":
            assert resp.choices[0].finish_reason == "stop" and text in ("paid", "unpaid"), text
        elif name == "structured_outputs.grammar":
            assert resp.choices[0].finish_reason == "stop" and re.fullmatch("total: [1-9][0-9]? Ft", text), text
        elif name == "compact json":
            assert resp.choices[0].finish_reason == "stop", text
            value = json.loads(text)
            assert list(value) == ["date", "amount", "currency"] and re.fullmatch(DATE, value["date"]), text
        else:  # free whitespace: a random-weight model may spend every token on it; a prefix of a value
            assert text.startswith("{"), text


def test_chat_response_format_json_schema_and_json_object(llama_tiny: Path, client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": f"{DOC}Give the date, the amount and the currency as JSON."}]
    schema = {"name": "invoice", "schema": INVOICE, "strict": True}
    resp = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        response_format={"type": "json_schema", "json_schema": schema},
    )
    llm = LLM(str(llama_tiny), block_size=8)
    ids = llm.engine.tokenize(llm.tokenizer.apply_chat_template(messages))
    params = SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs=StructuredOutputsParams(json=INVOICE)
    )
    assert resp.choices[0].message.content == llm.generate([ids], params)[0].text
    text = resp.choices[0].message.content
    assert text.startswith("{"), text
    if resp.choices[0].finish_reason == "stop":
        value = json.loads(text)
        assert list(value) == ["date", "amount", "currency"] and re.fullmatch(DATE, value["date"]), text
    streamed = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        response_format={"type": "json_schema", "json_schema": schema},
        stream=True,
    )
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == text
    seeded = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=MAX_TOKENS, temperature=1.0, seed=7,
        response_format={"type": "json_object"},
    )  # fmt: skip
    ref = llm.generate(
        [ids],
        SamplingParams(temperature=1.0, seed=7, max_tokens=MAX_TOKENS,
                       structured_outputs=StructuredOutputsParams(json_object=True)),
    )  # fmt: skip
    assert seeded.choices[0].message.content == ref[0].text and ref[0].text.startswith("{")


def test_constrained_answers_do_not_depend_on_cache_or_company(server: Server, client: openai.OpenAI) -> None:
    prompt = f"{DOC}The invoice as JSON:"
    extra = {"guided_json": INVOICE, "cache_salt": "structured-invariance"}
    cold = complete(client, prompt, extra, temperature=0.8, seed=11)
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    warm = complete(client, prompt, extra, temperature=0.8, seed=11)
    assert warm.usage.prompt_tokens_details.cached_tokens > 0
    assert tops(warm) == tops(cold) and warm.choices[0].text == cold.choices[0].text

    def crowded(i: int) -> openai.types.Completion:
        if i == 0:
            return complete(client, prompt, extra, temperature=0.8, seed=11)
        other = {"guided_regex": DATE} if i % 2 else {}
        return complete(client, f"{DOC}Note {i}:", other, temperature=1.0, seed=i)

    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(crowded, range(6)))
    first = results[0]
    assert tops(first) == tops(cold) and first.choices[0].text == cold.choices[0].text


BAD = [
    ({"guided_regex": "([0-9]"}, "guided_regex"),
    ({"guided_json": {"type": "object", "properties": {"a": {"type": "no-such-type"}}}}, "guided_json"),
    ({"structured_outputs": {"grammar": "root ::= undefined_rule"}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"guided_choice": ["a"], "guided_regex": "b"}, "guided_choice"),  # two: the message names the other too
    ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern"),
    ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
    ({"structured_outputs": {}}, "structured_outputs"),  # no constraint: refused, not ignored
    ({"structured_outputs": {"json_object": False, "disable_any_whitespace": True}}, "structured_outputs"),
    (
        {"structured_outputs": {"regex": "a", "disable_any_whitespace": True}},
        "structured_outputs.disable_any_whitespace",
    ),
    ({"guided_json": '{"a":' * 5000 + "1" + "}" * 5000}, "guided_json"),  # nested past the parser's recursion
]


def test_bad_constraints_are_400s_naming_the_field_and_lose_nothing(server: Server, client: openai.OpenAI) -> None:
    baseline = server.metrics()["kvwarden:kv_blocks_free"]
    for extra, param in BAD:
        with pytest.raises(openai.BadRequestError) as info:
            complete(client, "Hello", extra)
        error = info.value.body
        assert info.value.status_code == 400 and error["param"] == param, (extra, error)
        assert param.split(".")[-1] in error["message"], error
    bad_formats = [
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 12}}},
            "response_format.json_schema.schema",
        ),
        ({"type": "json_schema", "json_schema": {"name": "x"}}, "response_format.json_schema"),
        ({"type": "json_object", "json_schema": {"name": "x", "schema": INVOICE}}, "response_format.json_schema"),
    ]
    for response_format, param in bad_formats:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hi"}], response_format=response_format
            )
        assert info.value.body["param"] == param, info.value.body
    # the server is up, serves a constrained request, and every block is back in the pool
    ok = complete(client, "Hello", {"guided_choice": ["yes", "no"]})
    assert ok.choices[0].text in ("yes", "no")
    assert server.metrics()["kvwarden:kv_blocks_free"] == baseline
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok", "invariant": True}
