"""``kvwarden serve`` end to end: a real server process, the official openai client."""

from __future__ import annotations

import asyncio
import json
import re
import struct
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from kvwarden import LLM, SamplingParams
from server_util import Server, running_server

DOC = " ".join(f"w{i}" for i in range(120))  # a long shared prefix (many blocks)


@pytest.fixture(scope="module")
def server(llama_tiny: Path) -> Iterator[Server]:
    with running_server(
        str(llama_tiny), "--served-model-name", "tiny", "--block-size", "8", "--max-num-batched-tokens", "64"
    ) as s:
        yield s


@pytest.fixture()
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def top20(resp: openai.types.Completion) -> list[list[tuple[int, bytes]]]:
    """Exact (token id, float bytes) pairs of every generated token (keys are token_id:N)."""
    lists = resp.choices[0].logprobs.top_logprobs
    return [[(int(k.split(":")[1]), struct.pack("<d", v)) for k, v in top.items()] for top in lists]


def complete(
    client: openai.OpenAI, prompt: str | list[int], extra: dict | None = None, **kw: object
) -> openai.types.Completion:
    args = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0.0, "logprobs": 20}
    args.update(kw)
    body = {"return_tokens_as_token_ids": True, "ignore_eos": True, **(extra or {})}
    return client.completions.create(**args, extra_body=body)


def test_models_health_and_basic_completion(server: Server, client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok", "invariant": True}
    resp = complete(client, "Hello there, engineers")
    choice = resp.choices[0]
    assert choice.finish_reason == "length"
    assert len(choice.logprobs.top_logprobs) == 8
    assert all(len(t) == 20 for t in choice.logprobs.top_logprobs)
    assert resp.usage.completion_tokens == 8
    assert resp.usage.prompt_tokens_details.cached_tokens == 0


def test_http_results_equal_the_python_api(llama_tiny: Path, client: openai.OpenAI) -> None:
    prompt = list(range(20, 70))
    ref = LLM(str(llama_tiny), enable_prefix_caching=False).generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=8, logprobs=20, ignore_eos=True)
    )[0]
    resp = complete(client, prompt)
    assert top20(resp) == [[(t, struct.pack("<d", v)) for t, v in top] for top in ref.logprobs]


def test_invariance_over_http_cold_warm_shared_prefix_and_concurrent(server: Server, client: openai.OpenAI) -> None:
    prompt = f"{DOC} Question: what is w7?"
    cold = complete(client, prompt)
    warm = complete(client, prompt)
    assert warm.usage.prompt_tokens_details.cached_tokens > 0
    assert top20(warm) == top20(cold)
    # another request sharing the prefix, ending mid-block, warms the cache first
    other = complete(client, f"{DOC} Question: which")
    assert other.usage.prompt_tokens_details.cached_tokens > 0
    salted = complete(client, prompt, extra={"cache_salt": "fresh"})
    assert salted.usage.prompt_tokens_details.cached_tokens == 0
    assert top20(salted) == top20(cold)

    async def concurrent() -> list[openai.types.Completion]:
        aclient = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
        noise = [
            aclient.completions.create(
                model="tiny", prompt=f"noise {i} " * (i + 1), max_tokens=5 + i, temperature=1.0, seed=i
            )
            for i in range(8)
        ]
        target = aclient.completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=8,
            temperature=0.0,
            logprobs=20,
            extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True},
        )
        return await asyncio.gather(target, *noise)

    among = asyncio.run(concurrent())[0]
    assert top20(among) == top20(cold)


def test_streaming_with_logprobs_and_usage(client: openai.OpenAI) -> None:
    prompt = "Stream this please:"
    full = complete(client, prompt, max_tokens=10)
    stream = client.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=10,
        temperature=0.0,
        logprobs=20,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True},
    )
    text, tops, usage = "", [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.text
            if choice.logprobs is not None:
                tops.extend(choice.logprobs.top_logprobs)
    assert text == full.choices[0].text
    assert tops == full.choices[0].logprobs.top_logprobs
    assert usage is not None and usage.completion_tokens == 10
    assert usage.prompt_tokens_details.cached_tokens >= 0


def test_chat_completions_with_top_logprobs_and_stream(client: openai.OpenAI) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    resp = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=6, temperature=0.0, logprobs=True, top_logprobs=20
    )
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens
    assert all(len(c.top_logprobs) == 20 for c in content)
    assert resp.usage.prompt_tokens_details.cached_tokens == 0
    stream = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=6,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
    )
    parts, roles, usage = [], [], None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            roles.append(choice.delta.role)
            parts.append(choice.delta.content or "")
    assert roles[0] == "assistant"
    assert "".join(parts) == resp.choices[0].message.content
    assert usage.prompt_tokens_details.cached_tokens > 0  # the same prompt was just served


def test_n_echo_stop_and_batched_prompts(client: openai.OpenAI) -> None:
    resp = client.completions.create(model="tiny", prompt="Pick:", max_tokens=6, temperature=1.0, seed=5, n=3)
    assert [c.index for c in resp.choices] == [0, 1, 2]
    again = client.completions.create(model="tiny", prompt="Pick:", max_tokens=6, temperature=1.0, seed=5, n=3)
    assert [c.text for c in again.choices] == [c.text for c in resp.choices]
    batch = client.completions.create(model="tiny", prompt=["one", "two"], max_tokens=3, temperature=0.0, n=2)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    echo = client.completions.create(
        model="tiny", prompt="Echo me", max_tokens=3, temperature=0.0, echo=True, logprobs=2
    )
    assert echo.choices[0].text.startswith("Echo me")
    assert echo.choices[0].logprobs.token_logprobs[0] is None
    base = complete(client, "Stop test", max_tokens=12).choices[0].text
    stop = base[3:6]
    if stop.strip():
        stopped = complete(client, "Stop test", max_tokens=12, stop=[stop]).choices[0]
        assert stopped.finish_reason == "stop" and stopped.text == base[: base.find(stop)]


def test_client_disconnect_aborts_and_frees_blocks(server: Server) -> None:
    before = server.metrics().get('kvwarden:request_success_total{finished_reason="abort"}', 0.0)
    body = {"model": "tiny", "prompt": "long " * 40, "max_tokens": 3000, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as resp:
        assert resp.status_code == 200
        for i, line in enumerate(resp.iter_lines()):
            if line.startswith("data: {"):
                request_id = json.loads(line[6:])["id"]
            if i > 6:
                break  # leave: the connection closes mid-generation
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        m = server.metrics()
        if m['kvwarden:request_success_total{finished_reason="abort"}'] > before and m["kvwarden:kv_blocks_used"] == 0:
            break
        time.sleep(0.2)
    m = server.metrics()
    assert m['kvwarden:request_success_total{finished_reason="abort"}'] == before + 1
    assert m["kvwarden:kv_blocks_used"] == 0
    assert m["kvwarden:num_requests_running"] == 0
    # logged as a non-streamed request the client leaves is: 499, with the tokens it had (#63 item 15)
    line = access_line(server, request_id)
    assert "POST /v1/completions 499" in line and "(client disconnected, after 200 was sent)" in line, line
    assert re.search(r"prompt=\d+ output=\d+ ", line), line
    logged = {x for x in list(server.log) if "POST /v1/completions 499" in x}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json={**body, "stream": False}, timeout=1.0)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not {x for x in list(server.log) if "POST /v1/completions 499" in x} - logged:
        time.sleep(0.1)
    (plain,) = {x for x in list(server.log) if "POST /v1/completions 499" in x} - logged
    assert "(client disconnected)" in plain and re.search(r"prompt=\d+ ", plain), plain


def access_line(server: Server, request_id: str) -> str:
    deadline = time.monotonic() + 10  # the line is written once the response's last byte is sent
    while time.monotonic() < deadline:
        found = [line for line in list(server.log) if request_id in line and "kvwarden.access" in line]
        if found:
            assert len(found) == 1, found
            return found[0]
        time.sleep(0.05)
    raise AssertionError(f"no access-log line for {request_id}")


def test_metrics_expose_cache_queue_and_latency(server: Server, client: openai.OpenAI) -> None:
    complete(client, f"{DOC} metrics check")
    complete(client, f"{DOC} metrics check")
    m = server.metrics()
    for name in (
        "kvwarden:prefix_cache_queries_total",
        'kvwarden:prefix_cache_hits_total{tier="device"}',
        'kvwarden:prefix_cache_hits_total{tier="host"}',
        "kvwarden:prompt_tokens_total",
        "kvwarden:generation_tokens_total",
        "kvwarden:num_requests_running",
        "kvwarden:num_requests_waiting",
        "kvwarden:kv_blocks_used",
        "kvwarden:kv_blocks_free",
        "kvwarden:time_to_first_token_seconds_count",
        "kvwarden:inter_token_latency_seconds_count",
    ):
        assert name in m, name
    hits = m['kvwarden:prefix_cache_hits_total{tier="device"}']
    assert hits > 0 and m['kvwarden:prefix_cache_hits_total{tier="host"}'] == 0  # no host tier configured
    assert m["kvwarden:prefix_cache_queries_total"] >= hits
    assert m["kvwarden:time_to_first_token_seconds_count"] > 0
    # the pool's size as a prefix cache: every block's tokens; the bytes behind it
    info = next(k for k in m if k.startswith("kvwarden:cache_config_info{"))
    block_size = int(re.search(r'block_size="(\d+)"', info).group(1))  # type: ignore[union-attr]
    blocks = m["kvwarden:kv_blocks_used"] + m["kvwarden:kv_blocks_free"]
    assert m["kvwarden:prefix_cache_capacity_tokens"] == blocks * block_size > 0
    assert m["kvwarden:kv_cache_bytes"] >= m["kvwarden:prefix_cache_capacity_tokens"] * 2  # K and V, >= 1 byte each


def test_tokenize_and_detokenize_in_vllms_shapes(server: Server, client: openai.OpenAI) -> None:
    text = "Hello there, engineers"
    tok = httpx.post(f"{server.url}/tokenize", json={"model": "tiny", "prompt": text, "return_token_strs": True})
    body = tok.json()
    assert tok.status_code == 200 and set(body) == {"count", "max_model_len", "tokens", "token_strs"}
    assert body["count"] == len(body["tokens"]) == len(body["token_strs"]) and body["max_model_len"] > 0
    # the ids are exactly what the completions endpoint feeds the engine
    assert complete(client, text, max_tokens=1).usage.prompt_tokens == body["count"]
    same = complete(client, body["tokens"], max_tokens=4)
    assert top20(same) == top20(complete(client, text, max_tokens=4))
    back = httpx.post(f"{server.url}/detokenize", json={"tokens": body["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": text}
    chat = httpx.post(f"{server.url}/tokenize", json={"messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 200 and chat.json()["count"] > 1
    for bad, param in (
        ({"tokens": [10**9]}, "tokens"),
        ({"tokens": "abc"}, "tokens"),
    ):
        resp = httpx.post(f"{server.url}/detokenize", json=bad)
        assert resp.status_code in (400, 422) and resp.json()["error"]["param"] == param, resp.text
    neither = httpx.post(f"{server.url}/tokenize", json={"model": "tiny"})
    assert neither.status_code == 400 and neither.json()["error"]["param"] == "prompt"
    wrong_model = httpx.post(f"{server.url}/tokenize", json={"model": "nope", "prompt": "x"})
    assert wrong_model.status_code == 404


def test_access_log_has_one_line_per_request_with_tokens(server: Server, client: openai.OpenAI) -> None:
    resp = complete(client, f"{DOC} access log", max_tokens=5)
    chunks = list(client.completions.create(model="tiny", prompt=f"{DOC} access log", max_tokens=3, stream=True))

    plain = access_line(server, resp.id)
    assert "POST /v1/completions 200" in plain and "output=5" in plain and "latency=" in plain
    cached = resp.usage.prompt_tokens_details.cached_tokens
    assert f"prompt={resp.usage.prompt_tokens}" in plain and f"cached={cached}" in plain
    streamed = access_line(server, chunks[0].id)
    assert "POST /v1/completions 200" in streamed and "output=3" in streamed
    assert f"prompt={resp.usage.prompt_tokens}" in streamed  # the same prompt
    assert not any("GET /health" in line or "GET /metrics" in line for line in server.log)


def test_metrics_carry_the_engine_configuration(server: Server) -> None:
    text = httpx.get(f"{server.url}/metrics").text
    cache = next(line for line in text.splitlines() if line.startswith("kvwarden:cache_config_info{"))
    sched = next(line for line in text.splitlines() if line.startswith("kvwarden:scheduler_config_info{"))
    assert 'block_size="8"' in cache and 'enable_prefix_caching="True"' in cache
    assert 'max_num_batched_tokens="64"' in sched and 'numerics="canonical"' in sched
    assert 'kernels="compiled"' in sched  # the CPU's compiled kernels, built by make install
    assert "compiled kernels" in "\n".join(server.log)  # and the start-up line says so
