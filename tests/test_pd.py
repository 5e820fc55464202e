"""Disaggregated prefill/decode: real prefill and decode servers on loopback, KV moved through NIXL.

(l) the disaggregated answer equals the single server's bit for bit (dense and
hybrid, greedy and seeded, streaming and not, with prefix hits on either
side); bad input gets clear errors and loses no block; the abort handshake is
what keeps a campaign of random aborts corruption-free, and the unsafe switch
shows the race it prevents.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from kvwarden.bench.pd_campaign import CampaignConfig, pool_idle, references, run_campaign
from kvwarden.probe.client import parse_logprobs
from server_util import Server, running_guard, running_server

QUIET = ("--disable-log-requests",)


@pytest.fixture(scope="module", params=["llama-tiny", "qwen3_next-tiny"])
def trio(request: pytest.FixtureRequest) -> Iterator[tuple[Server, Server, Server]]:
    """(single server, prefill instance, decode instance) of one model."""
    model = f"builtin:{request.param}"
    with (
        running_server(model, *QUIET) as single,
        running_server(model, "--role", "prefill", *QUIET) as prefill,
        running_server(model, "--role", "decode", *QUIET) as decode,
    ):
        yield single, prefill, decode


def stats(server: Server) -> dict[str, Any]:
    return httpx.get(f"{server.url}/pd/v1/stats", timeout=10).json()


def wait_idle(*servers: Server) -> None:
    """Until no instance holds a block for any request (10 s at most), then assert it."""
    deadline = time.monotonic() + 10
    while True:
        all_stats = [stats(s) for s in servers]
        idle = [pool_idle(s) for s in all_stats]
        if all(idle) or time.monotonic() > deadline:
            assert all(idle), all_stats
            return
        time.sleep(0.1)


def via(prefill: Server, body: dict[str, Any]) -> dict[str, Any]:
    """``body`` with the prefill instance that computes its prompt."""
    return {**body, "kv_transfer_params": {"prefill_url": prefill.url}}


def tops_of(choice: Any) -> tuple[list[Any], list[Any]]:
    return parse_logprobs(choice.logprobs.model_dump())


def test_sparse_attention_caches_travel_together() -> None:
    """GLM-5's two caches (the latent rows and the indexer keys, one layer's K and V tensors) move in the same
    blocks: the decode instance's selection over transferred indexer keys, and its attention over
    transferred latent rows, give the single server's logprobs, also when both sides hit their prefix
    caches. The tiny preset selects 8 keys, so every prompt here really prunes."""
    model = "builtin:glm_moe_dsa-tiny"
    with (
        running_server(model, *QUIET) as single,
        running_server(model, "--role", "prefill", *QUIET) as prefill,
        running_server(model, "--role", "decode", *QUIET) as decode,
    ):
        one = openai.OpenAI(base_url=f"{single.url}/v1", api_key="x")
        two = openai.OpenAI(base_url=f"{decode.url}/v1", api_key="x")
        for prompt in (list(range(3, 20)), list(range(40, 90)), list(range(40, 70)) + [9] * 7):
            for round_ in range(2):
                kwargs: dict[str, Any] = {"model": decode.model, "prompt": prompt, "max_tokens": 8, "logprobs": 20}
                kwargs.update(temperature=0.0, extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True})
                want = one.completions.create(**kwargs)
                body = {**kwargs["extra_body"], "kv_transfer_params": {"prefill_url": prefill.url}}
                got = two.completions.create(**{**kwargs, "extra_body": body})
                assert tops_of(got.choices[0]) == tops_of(want.choices[0]), (prompt, round_)
        assert stats(decode)["done"] >= 3 and stats(decode)["failed"] == 0  # each first round took the transfer
        wait_idle(prefill, decode)


@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 0.9, "seed": 7}], ids=["greedy", "seeded"])
def test_disaggregated_equals_single_server(trio: tuple[Server, Server, Server], sampling: dict[str, Any]) -> None:
    single, prefill, decode = trio
    one = openai.OpenAI(base_url=f"{single.url}/v1", api_key="x")
    two = openai.OpenAI(base_url=f"{decode.url}/v1", api_key="x")
    pd = {"kv_transfer_params": {"prefill_url": prefill.url}}
    # lengths around block edges (16), a two-token prompt, and a shared prefix that hits on the second pass
    prompts = [[5, 9], list(range(3, 20)), list(range(40, 73)), list(range(100, 190)), list(range(100, 150)) + [7] * 9]
    for prompt in prompts:
        for round_ in range(2):  # the second round hits the prefix caches of both instances
            kwargs: dict[str, Any] = {"model": decode.model, "prompt": prompt, "max_tokens": 10, "logprobs": 20}
            kwargs.update(sampling, extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True})
            want = one.completions.create(**kwargs)
            got = two.completions.create(**{**kwargs, "extra_body": {**kwargs["extra_body"], **pd}})
            assert tops_of(got.choices[0]) == tops_of(want.choices[0]), (prompt, round_)
            assert got.choices[0].text == want.choices[0].text
            assert got.usage.prompt_tokens == want.usage.prompt_tokens
            if round_ == 1 and len(prompt) > 17:  # cached tokens are reported as a single server would
                assert got.usage.prompt_tokens_details.cached_tokens == want.usage.prompt_tokens_details.cached_tokens
    # streaming and chat go the same way
    stream = two.completions.create(
        model=decode.model, prompt=prompts[3], max_tokens=8, stream=True, extra_body=pd, **sampling
    )
    text = "".join(c.choices[0].text for c in stream if c.choices)
    assert (
        text == one.completions.create(model=decode.model, prompt=prompts[3], max_tokens=8, **sampling).choices[0].text
    )
    chat = {"model": decode.model, "messages": [{"role": "user", "content": "a disaggregated hello"}], "max_tokens": 8}
    want_chat = one.chat.completions.create(**chat, **sampling).choices[0].message.content
    assert two.chat.completions.create(**chat, **sampling, extra_body=pd).choices[0].message.content == want_chat
    assert stats(decode)["done"] >= len(prompts) and stats(decode)["failed"] == 0
    wait_idle(prefill, decode)


def test_guard_routes_to_prefill_and_decode(trio: tuple[Server, Server, Server]) -> None:
    """``kvwarden guard --prefill URL --decode URL``: one endpoint, the single server's answers."""
    single, prefill, decode = trio
    with running_guard([], "--decode", decode.url, "--prefill", prefill.url, "--canary-interval", "0") as guard:
        before = stats(decode)["done"]
        for prompt in ([9, 8, 7, 6, 5], list(range(200, 260))):
            body = {"model": decode.model, "prompt": prompt, "max_tokens": 8, "logprobs": 5, "temperature": 0.0}
            want = httpx.post(f"{single.url}/v1/completions", json=body, timeout=60).json()
            got = httpx.post(f"{guard.url}/v1/completions", json=body, timeout=60).json()
            for key in ("tokens", "token_logprobs", "top_logprobs"):  # text_offset is the guard's own
                assert got["choices"][0]["logprobs"][key] == want["choices"][0]["logprobs"][key], key
        assert stats(decode)["done"] == before + 2  # both prompts went through the prefill instance
    wait_idle(prefill, decode)


def test_bad_input_is_refused_and_loses_nothing(trio: tuple[Server, Server, Server], tmp_path: Path) -> None:
    single, prefill, decode = trio
    body = {"model": decode.model, "prompt": [5, 6, 7, 8], "max_tokens": 2}
    # a server that is not a decode instance refuses kv_transfer_params by name
    r = httpx.post(f"{single.url}/v1/completions", json={**body, "kv_transfer_params": {"prefill_url": prefill.url}})
    assert r.status_code == 400 and "kv_transfer_params" in r.json()["error"]["message"]
    r = httpx.post(f"{decode.url}/v1/completions", json={**body, "kv_transfer_params": {"url": prefill.url}})
    assert r.status_code in (400, 422) and "kv_transfer_params" in r.json()["error"]["param"]
    # an unreachable prefill instance: 502 naming it; the blocks come back
    dead = "http://127.0.0.1:9"
    r = httpx.post(f"{decode.url}/v1/completions", json={**body, "kv_transfer_params": {"prefill_url": dead}})
    assert r.status_code == 502 and dead in r.json()["error"]["message"], r.text
    # the control protocol validates its messages
    r = httpx.post(f"{prefill.url}/pd/v1/prefill", json={"transfer_id": "x", "token_ids": [1]})
    assert r.status_code == 422
    # the decode instance still serves; nothing is held anywhere
    ok = httpx.post(f"{decode.url}/v1/completions", json={**body, "kv_transfer_params": {"prefill_url": prefill.url}})
    assert ok.status_code == 200
    wait_idle(prefill, decode)


def test_prefill_of_another_model_is_refused() -> None:
    with (
        running_server("builtin:llama-tiny", "--role", "prefill", *QUIET) as prefill,
        running_server("builtin:qwen3_next-tiny", "--role", "decode", *QUIET) as decode,
    ):
        body = {"model": decode.model, "prompt": list(range(5, 40)), "max_tokens": 2}
        r = httpx.post(
            f"{decode.url}/v1/completions", json={**body, "kv_transfer_params": {"prefill_url": prefill.url}}
        )
        assert r.status_code == 502 and "layout" in r.json()["error"]["message"], r.text
        wait_idle(prefill, decode)


def test_transfer_timeout_fails_the_request_and_reclaims_after_the_handshake() -> None:
    model = "builtin:llama-tiny"
    with (
        running_server(model, "--role", "prefill", "--inject-fault", "transfer-delay=4000", *QUIET) as prefill,
        running_server(model, "--role", "decode", "--pd-transfer-timeout", "1.0", *QUIET) as decode,
    ):
        body = {"model": model, "prompt": list(range(5, 60)), "max_tokens": 4}
        r = httpx.post(
            f"{decode.url}/v1/completions", json={**body, "kv_transfer_params": {"prefill_url": prefill.url}}
        )
        assert r.status_code == 504 and "--pd-transfer-timeout" in r.json()["error"]["message"], r.text
        held = stats(decode)["detached_blocks"]
        assert held > 0, "blocks freed before the prefill instance said it was safe"
        wait_idle(prefill, decode)
        counters = stats(decode)
        assert counters["handshakes"] == 1 and counters["aborts_during"] == 1
        assert stats(prefill)["aborts_received"] == 1


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--unsafe-pd-abort"], "--unsafe-pd-abort"),
        (["--inject-fault", "transfer-delay=5"], "transfer-delay"),
        (["--role", "decode", "--speculative-config", '{"method": "ngram"}'], "--speculative-config"),
        (["--role", "decode", "--pd-transfer-timeout", "0"], "--pd-transfer-timeout"),
    ],
)
def test_role_flags_are_checked(flags: list[str], named: str) -> None:
    cmd = [sys.executable, "-m", "kvwarden.cli", "serve", "builtin:llama-tiny", "--port", "0", *flags]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and named in done.stderr, done.stderr


def campaign(unsafe: bool, cfg: CampaignConfig) -> Any:
    model = "builtin:llama-tiny"
    decode_args = ["--role", "decode", "--num-blocks", "48", *(["--unsafe-pd-abort"] if unsafe else [])]
    with (
        running_server(model, *QUIET) as single,
        running_server(model, "--role", "prefill", "--inject-fault", "transfer-delay=150", *QUIET) as prefill,
        running_server(model, *decode_args, *QUIET) as decode,
    ):
        refs = asyncio.run(references(single.url, model, cfg))
        return asyncio.run(run_campaign(decode.url, prefill.url, model, refs, cfg))


def test_abort_handshake_keeps_every_answer_exact(measure: Any) -> None:
    """Aborts at random moments (before, during, after transfers): no corruption, both pools back to baseline."""
    result = campaign(unsafe=False, cfg=CampaignConfig(requests=200))
    measure("pd abort campaign, with the handshake", **result.summary())
    assert result.failed == 0, result.errors
    assert result.completed > 50 and result.abandoned > 50
    assert result.decode["aborts_during"] > 0 and result.decode["handshakes"] == result.decode["aborts_during"]
    assert result.corrupted == 0, result.corruptions
    assert result.pools_at_baseline, (result.decode, result.prefill)


def test_unsafe_abort_recreates_the_race(measure: Any) -> None:
    """Without the handshake, late writes land in blocks that already belong to other requests."""
    result = campaign(unsafe=True, cfg=CampaignConfig(requests=200))
    measure("pd abort campaign, --unsafe-pd-abort", **result.summary())
    assert result.decode["unsafe_frees"] > 0
    assert result.corrupted > 0, "the unsafe switch no longer re-creates the race: the campaign cannot fail"
