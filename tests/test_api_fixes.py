"""What a new user hit (each item a real request through a real server; the official ``openai`` client where the
request is one it can send): refusals in OpenAI's error format, and answers that mean what they say."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from server_util import Server, running_server


@pytest.fixture(scope="module")
def server(llama_tiny: Path) -> Iterator[Server]:
    with running_server(str(llama_tiny), "--served-model-name", "m", "--max-model-len", "256") as s:
        yield s


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def _post(server: Server, path: str, body: dict[str, Any]) -> httpx.Response:
    # raw bytes: a lone surrogate survives json.dumps' default ASCII escaping ("\ud800"), as a client sends it
    return httpx.post(f"{server.url}{path}", content=json.dumps(body), timeout=60,
                      headers={"content-type": "application/json"})  # fmt: skip


def _error(resp: httpx.Response, status: int, param: str) -> str:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert err["param"] == param, err
    return err["message"]


def test_a_regex_that_matches_nothing_is_a_400(server: Server, client: openai.OpenAI) -> None:
    """``a[^\\s\\S]`` has no match: a 400 at admission (it answered 200 with "" and ``stop``)."""
    body = {"model": "m", "prompt": "x", "max_tokens": 4, "structured_outputs": {"regex": "a[^\\s\\S]"}}
    message = _error(_post(server, "/v1/completions", body), 400, "structured_outputs.regex")
    assert "matches no text" in message
    ok = client.completions.create(
        model="m", prompt="x", max_tokens=8, extra_body={"structured_outputs": {"regex": "ab"}}
    )
    assert ok.choices[0].text == "ab"  # a satisfiable one is unaffected


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": "\ud800 hi"}, "prompt"),
        ("/v1/completions", {"prompt": ["ok", "\ud800 hi"]}, "prompt[1]"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800 hi"}]}, "messages[0].content"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "a\udfff"}]}]},
            "messages[0].content[0].text",
        ),
        ("/tokenize", {"prompt": "\ud800 hi"}, "prompt"),
    ],
)
def test_a_lone_surrogate_is_a_400_naming_the_field(server: Server, path: str, body: dict, param: str) -> None:
    resp = _post(server, path, {"model": "m", "max_tokens": 2, **body} if path != "/tokenize" else body)
    assert "not valid Unicode text" in _error(resp, 400, param)
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


def test_each_seed_and_choice_has_its_own_stream(client: openai.OpenAI) -> None:
    """``n=3`` with seeds 42 and 43: six different samples (``seed + index`` made two of them shared)."""
    texts = []
    for seed in (42, 43):
        out = client.completions.create(
            model="m", prompt="Once", max_tokens=8, temperature=1.0, n=3, seed=seed, logprobs=1,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        texts += [json.dumps(c.logprobs.token_logprobs) for c in out.choices]
    assert len(set(texts)) == 6
    again = client.completions.create(model="m", prompt="Once", max_tokens=8, temperature=1.0, n=1, seed=42, logprobs=1,
                                      extra_body={"ignore_eos": True})  # fmt: skip
    assert json.dumps(again.choices[0].logprobs.token_logprobs) == texts[0]  # choice 0 keeps the request's seed


@pytest.mark.parametrize("seed", [2**64 + 42, 2**64, -(2**63) - 1])
def test_seeds_past_64_bits_are_refused(server: Server, seed: int) -> None:
    body = {"model": "m", "prompt": "x", "max_tokens": 2, "seed": seed}
    assert "seed must be between" in _error(_post(server, "/v1/completions", body), 400, "seed")


def test_fields_that_would_be_silently_ignored_are_refused(server: Server) -> None:
    body = {"model": "m", "prompt": "x", "max_tokens": 2, "stream_options": {"include_usage": True}}
    assert "only allowed when stream is true" in _error(_post(server, "/v1/completions", body), 400, "stream_options")
    chat = {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 3, "max_completion_tokens": 5}
    assert "disagree" in _error(_post(server, "/v1/chat/completions", chat), 400, "max_completion_tokens")
    same = _post(server, "/v1/chat/completions", {**chat, "max_completion_tokens": 3, "temperature": 0.0})
    assert same.status_code == 200 and same.json()["usage"]["completion_tokens"] <= 3


def test_a_stop_string_beside_a_constraint_is_refused(server: Server) -> None:
    body = {"model": "m", "prompt": "x", "max_tokens": 12, "stop": ["-"],
            "structured_outputs": {"regex": "\\d{4}-\\d{2}-\\d{2}"}}  # fmt: skip
    assert "stop cannot be combined" in _error(_post(server, "/v1/completions", body), 400, "stop")


def test_text_keyed_top_logprobs_keep_the_highest_ranked_token_of_a_text() -> None:
    """Legacy completions key top logprobs by text: where two tokens share a text, the higher-ranked one stays
    (it kept the last, lowest one). Tokens 1 and 2 both read "a" here."""
    from kvwarden.server.formatting import completion_logprobs

    text = {1: "a", 2: "a", 3: "b"}.__getitem__
    body = completion_logprobs([1], [-0.1], [[(1, -0.1), (2, -0.5), (3, -0.7)]], text)
    assert body["top_logprobs"] == [{"a": -0.1, "b": -0.7}]


def test_the_api_key_can_come_from_the_environment(llama_tiny: Path) -> None:
    """``KVWARDEN_API_KEY`` (as vLLM reads ``VLLM_API_KEY``): required from clients, and not in the process list."""
    import os

    env = {**os.environ, "KVWARDEN_API_KEY": "s3cret-from-env"}
    with running_server(str(llama_tiny), "--served-model-name", "m", env=env) as server:
        body = {"model": "m", "prompt": "x", "max_tokens": 2}
        assert _post(server, "/v1/completions", body).status_code == 401
        ok = httpx.post(f"{server.url}/v1/completions", json=body, headers={"Authorization": "Bearer s3cret-from-env"})
        assert ok.status_code == 200, ok.text
        cmdline = Path(f"/proc/{server.process.pid}/cmdline").read_bytes()
        assert b"s3cret" not in cmdline


def test_predict_takes_the_engines_spelling_of_the_draft_count() -> None:
    import subprocess
    import sys

    base = [sys.executable, "-m", "kvwarden.cli", "predict", "--rule", "vllm-align", "--block-size", "16",
            "--pair", "40:60:30", "--json"]  # fmt: skip
    new, old = (
        subprocess.run([*base, flag, "1"], capture_output=True, text=True, check=False).stdout
        for flag in ("--num-speculative-tokens", "--num-spec-tokens")
    )
    assert new == old and json.loads(new.splitlines()[0])


def test_what_a_body_gets_wrong_is_named_in_openais_format(server: Server, client: openai.OpenAI) -> None:
    """#63 item 13: a body without a JSON content type, invalid UTF-8, image parts, field paths, a prompt the
    engine alone can measure - each a 4xx in OpenAI's format naming what to change; the server stays up."""
    chat = f"{server.url}/v1/chat/completions"
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    form = httpx.post(chat, content=json.dumps(body), headers={"content-type": "text/plain"}, timeout=60)
    assert form.status_code == 415 and form.json()["error"]["code"] == "unsupported_media_type"
    assert "Content-Type: application/json" in form.json()["error"]["message"]
    raw = b'{"model": "m", "messages": [{"role": "user", "content": "\xff\xfe"}]}'
    bad_utf8 = httpx.post(chat, content=raw, headers={"content-type": "application/json"}, timeout=60)
    assert bad_utf8.status_code == 400 and bad_utf8.json()["error"]["code"] == "invalid_json", bad_utf8.text
    with pytest.raises(openai.BadRequestError) as image:
        client.chat.completions.create(
            model="m", max_tokens=2,
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}],
        )  # fmt: skip
    err = image.value.body
    assert err["param"] == "messages[0].content[0].type" and err["code"] == "unsupported_content", err
    assert "'image_url' are not supported" in err["message"]
    # pydantic's paths in the spelling of kvwarden's own refusals: messages[0].role, never messages.0.role
    missing = _post(server, "/v1/chat/completions", {"model": "m", "messages": [{"rol": "user", "content": "x"}]})
    assert _error(missing, 422, "messages[0].role").startswith("messages[0].role: Field required")
    # a text prompt over max_model_len (256): only the engine's tokenizer measures it, in the engine's words
    long = _post(server, "/v1/completions", {"model": "m", "prompt": "word " * 400, "max_tokens": 1})
    assert long.status_code == 400 and long.json()["error"]["code"] == "context_length_exceeded", long.text
    assert "maximum context length is 256 tokens" in long.json()["error"]["message"]
    assert client.chat.completions.create(**body).choices[0].finish_reason in ("length", "stop")


def test_a_model_name_or_length_the_model_cannot_have_is_refused_naming_it(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    def serve(*args: str) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "kvwarden.cli", "serve", *args, "--port", "0"]
        env = {**os.environ, "KVWARDEN_HOME": str(tmp_path)}
        return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)

    huge = serve("builtin:llama-huge")
    assert huge.returncode == 2 and "--preset" not in huge.stderr, huge.stderr
    assert "unknown preset 'huge'" in huge.stderr and "did you mean 'builtin:llama-tiny'" in huge.stderr
    assert not list(tmp_path.glob("models/*"))  # nothing made
    long = serve("builtin:llama-tiny", "--max-model-len", "999999")
    assert long.returncode == 2 and "max_model_len: 999999 is more than the model supports" in long.stderr
