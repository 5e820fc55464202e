"""Bad input over HTTP: OpenAI-style error JSON, the right status, nothing disturbed.

Raw HTTP (httpx) for malformed bodies; schemathesis fuzzes both POST endpoints
from the server's own OpenAPI schema; afterwards the server must still be up
and give the same answers as before.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from server_util import Server, running_server

REFERENCE = {
    "model": "tiny",
    "prompt": [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21],
    "max_tokens": 6,
    "temperature": 0.0,
    "logprobs": 20,
    "return_tokens_as_token_ids": True,
    "ignore_eos": True,
}


@pytest.fixture(scope="module")
def server(llama_tiny: Path) -> Iterator[Server]:
    args = ["--served-model-name", "tiny", "--max-model-len", "256", "--max-body-bytes", "20000", "--max-num-seqs", "8"]
    with running_server(str(llama_tiny), *args) as s:
        yield s


def fingerprint(server: Server) -> list[list[tuple[str, bytes]]]:
    resp = httpx.post(f"{server.url}/v1/completions", json=REFERENCE, timeout=30)
    assert resp.status_code == 200, resp.text
    tops = resp.json()["choices"][0]["logprobs"]["top_logprobs"]
    return [[(k, struct.pack("<d", v)) for k, v in top.items()] for top in tops]


@pytest.fixture(scope="module")
def reference(server: Server) -> list[list[tuple[str, bytes]]]:
    return fingerprint(server)


def _error(resp: httpx.Response, status: int) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    return body["error"]


CASES = [
    # (description, request kwargs for httpx.post, status, param)
    (
        "malformed json",
        {"content": b'{"model": "tiny", "prompt": ', "headers": {"content-type": "application/json"}},
        400,
        None,
    ),
    ("not json at all", {"content": b"prompt=hello"}, 400, None),
    ("json but not an object", {"json": [1, 2, 3]}, 422, None),
    ("missing prompt", {"json": {"model": "tiny"}}, 422, "prompt"),
    ("wrong type max_tokens", {"json": {**REFERENCE, "max_tokens": "5"}}, 422, "max_tokens"),
    ("bool as int", {"json": {**REFERENCE, "max_tokens": True}}, 422, "max_tokens"),
    ("unknown model", {"json": {**REFERENCE, "model": "gpt-7"}}, 404, "model"),
    ("negative max_tokens", {"json": {**REFERENCE, "max_tokens": -1}}, 400, "max_tokens"),
    ("zero max_tokens", {"json": {**REFERENCE, "max_tokens": 0}}, 400, "max_tokens"),
    ("logprobs above 20", {"json": {**REFERENCE, "logprobs": 21}}, 400, "logprobs"),
    ("negative logprobs", {"json": {**REFERENCE, "logprobs": -2}}, 400, "logprobs"),
    ("prompt too long", {"json": {**REFERENCE, "prompt": [5] * 300}}, 400, "prompt"),
    (
        "prompt + max_tokens too long",
        {"json": {**REFERENCE, "prompt": [5] * 200, "max_tokens": 100}},
        400,
        "max_tokens",
    ),
    ("token id outside vocabulary", {"json": {**REFERENCE, "prompt": [5, 999999]}}, 400, "prompt"),
    ("empty prompt", {"json": {**REFERENCE, "prompt": ""}}, 400, "prompt"),
    ("temperature negative", {"json": {**REFERENCE, "temperature": -1.0}}, 400, "temperature"),
    ("n too large", {"json": {**REFERENCE, "n": 1000}}, 400, "n"),
    ("unsupported penalty", {"json": {**REFERENCE, "presence_penalty": 0.5}}, 400, "presence_penalty"),
    ("misspelt max_tokens", {"json": {**REFERENCE, "max_token": 3}}, 400, "max_token"),
    ("misspelt temperature", {"json": {**REFERENCE, "temprature": 0}}, 400, "temprature"),
    (
        "unknown key inside stream_options",
        {"json": {**REFERENCE, "stream": True, "stream_options": {"include_usage": True, "usage_every": 1}}},
        400,
        "stream_options.usage_every",
    ),
    ("vLLM field kvwarden lacks", {"json": {**REFERENCE, "min_p": 0.1}}, 400, "min_p"),
    ("oversized body", {"json": {**REFERENCE, "prompt": "x" * 30000}}, 413, None),
]


@pytest.mark.parametrize(("what", "kwargs", "status", "param"), CASES, ids=[c[0] for c in CASES])
def test_bad_completion_requests(
    server: Server, reference: list, what: str, kwargs: dict, status: int, param: str | None
) -> None:
    err = _error(httpx.post(f"{server.url}/v1/completions", timeout=30, **kwargs), status)
    if param is not None:
        assert err["param"] == param, err
    assert fingerprint(server) == reference


def test_bad_chat_requests(server: Server, reference: list) -> None:
    url = f"{server.url}/v1/chat/completions"
    ok = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    assert _error(httpx.post(url, json={**ok, "messages": []}), 422)["param"] == "messages"
    assert _error(httpx.post(url, json={**ok, "messages": [{"role": "wizard", "content": "x"}]}), 422)[
        "param"
    ].startswith("messages")
    assert _error(httpx.post(url, json={**ok, "top_logprobs": 5}), 400)["param"] == "top_logprobs"
    assert _error(httpx.post(url, json={**ok, "logprobs": True, "top_logprobs": 50}), 400)["param"] == "top_logprobs"
    assert _error(httpx.post(url, json={**ok, "max_completion_tokens": -5}), 400)["param"] == "max_tokens"
    typo = {**ok, "messages": [{"role": "user", "content": "hi", "nmae": "bob"}]}
    assert _error(httpx.post(url, json=typo), 400)["param"] == "messages[0].nmae"
    assert _error(httpx.post(url, json={**ok, "top_logprob": 3}), 400)["code"] == "unrecognized_argument"
    assert fingerprint(server) == reference


def test_fields_that_cannot_change_an_answer_are_accepted(server: Server, reference: list) -> None:
    """OpenAI's bookkeeping fields (and an empty refusal echoed back from an earlier turn) are accepted;
    the official client's extra_body reaches the server and a misspelt field comes back as BadRequestError."""
    import openai

    body = {**REFERENCE, "user": "u1", "metadata": {"team": "a"}, "store": False, "service_tier": "auto"}
    resp = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
    assert resp.status_code == 200, resp.text
    chat = {
        "model": "tiny",
        "max_tokens": 2,
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello", "refusal": None, "tool_calls": []},
            {"role": "user", "content": "again"},
        ],
    }
    assert httpx.post(f"{server.url}/v1/chat/completions", json=chat, timeout=30).status_code == 200
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="Unrecognized request argument supplied: max_token"):
        client.completions.create(model="tiny", prompt="hi", extra_body={"max_token": 3})
    assert fingerprint(server) == reference


def test_unknown_path_and_method(server: Server) -> None:
    assert _error(httpx.get(f"{server.url}/v1/nothing"), 404)["code"] == "not_found"
    assert _error(httpx.get(f"{server.url}/v1/completions"), 405)["code"] == "method_not_allowed"


def test_api_key(llama_tiny: Path) -> None:
    with running_server(str(llama_tiny), "--served-model-name", "tiny", "--api-key", "s3cret") as s:
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
        assert _error(httpx.post(f"{s.url}/v1/completions", json=body), 401)["type"] == "authentication_error"
        wrong = {"Authorization": "Bearer nope"}
        assert _error(httpx.post(f"{s.url}/v1/completions", json=body, headers=wrong), 401)["code"] == "invalid_api_key"
        good = {"Authorization": "Bearer s3cret"}
        assert httpx.post(f"{s.url}/v1/completions", json=body, headers=good, timeout=30).status_code == 200
        assert httpx.get(f"{s.url}/health").status_code == 200  # health and metrics stay open
        assert httpx.get(f"{s.url}/metrics").status_code == 200
        for path, payload in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [5, 6]})):
            assert _error(httpx.post(f"{s.url}{path}", json=payload), 401)["code"] == "invalid_api_key"
            assert httpx.post(f"{s.url}{path}", json=payload, headers=good).status_code == 200


def test_full_queue_answers_503_and_serves_the_rest(llama_tiny: Path) -> None:
    with running_server(str(llama_tiny), "--served-model-name", "tiny", "--max-waiting", "2") as s:

        async def burst() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=60) as client:
                body = {"model": "tiny", "prompt": "go " * 20, "max_tokens": 200, "ignore_eos": True}
                return await asyncio.gather(*[client.post(f"{s.url}/v1/completions", json=body) for _ in range(8)])

        statuses = sorted(r.status_code for r in asyncio.run(burst()))
        assert statuses.count(200) >= 2 and 503 in statuses, statuses
        rejected = next(r for r in asyncio.run(burst()) if r.status_code == 503)
        assert _error(rejected, 503)["code"] == "overloaded"
        assert rejected.headers["retry-after"] == "1"
        assert httpx.get(f"{s.url}/health").status_code == 200
        assert s.metrics()["kvwarden:kv_blocks_used"] == 0


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_fuzz_never_breaks_the_server(server: Server, path: str) -> None:
    """schemathesis generates bodies from the server's own OpenAPI schema (valid and not)."""
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    operation = schema[path]["POST"]
    seen: list[int] = []

    @given(case=operation.as_strategy())
    @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
    def call(case: schemathesis.Case) -> None:
        if isinstance(case.body, dict) and isinstance(case.body.get("max_tokens"), int):
            case.body["max_tokens"] = min(case.body["max_tokens"], 64)  # bound the run time, not the validation
        response = case.call(base_url=server.url, timeout=60)
        seen.append(response.status_code)
        assert response.status_code < 500, response.text
        if response.status_code >= 400:
            assert set(response.json()["error"]) == {"message", "type", "param", "code"}

    call()
    assert any(code >= 400 for code in seen), "the fuzzer never produced an invalid request"


def test_after_fuzzing_the_server_is_up_and_unchanged(server: Server, reference: list) -> None:
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert fingerprint(server) == reference
    assert server.metrics()["kvwarden:kv_blocks_used"] == 0


def test_twenty_logprobs_are_twenty_entries_keyed_by_token_id(server: Server) -> None:
    """Keyed by text, byte-level tokens that decode to the same text (an incomplete UTF-8 character's
    "\ufffd") collide and a top-20 list shows fewer entries (vLLM has the same flaw); keyed by token id,
    never - which is how the probe and the guard's canary ask."""
    body = {**REFERENCE, "prompt": "naïve café déjà vu", "max_tokens": 8}
    tops = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30).json()["choices"][0]["logprobs"]
    assert all(len(top) == 20 for top in tops["top_logprobs"])
    assert all(key.startswith("token_id:") for top in tops["top_logprobs"] for key in top)
    text_keyed = {**body, "return_tokens_as_token_ids": False}
    tops = httpx.post(f"{server.url}/v1/completions", json=text_keyed, timeout=30).json()["choices"][0]["logprobs"]
    assert all(len(top) <= 20 for top in tops["top_logprobs"])
