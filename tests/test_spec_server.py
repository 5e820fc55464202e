"""Speculative decoding over HTTP: per-choice statistics in every streamed chunk, totals, metrics, errors."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from server_util import Server, running_server

SPEC = {"method": "draft", "num_speculative_tokens": 3}
FIELDS = {"num_drafts", "num_draft_tokens", "num_accepted_tokens", "accept_length", "accept_rate"}


@pytest.fixture(scope="module")
def server(qwen3_next_tiny: Path) -> Iterator[Server]:
    spec = {**SPEC, "model": str(qwen3_next_tiny)}  # the model as its own draft: every greedy draft is accepted
    with running_server(str(qwen3_next_tiny), "--speculative-config", json.dumps(spec)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_every_streamed_chunk_carries_cumulative_spec_statistics(server: Server, client: openai.OpenAI) -> None:
    stream = client.completions.create(
        model=server.model,
        prompt="The history of the printing press",
        max_tokens=24,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    seen, usage = [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
        for choice in chunk.choices:
            stats = choice.model_extra["spec_decoding"]
            assert set(stats) == FIELDS
            seen.append(stats)
    assert len(seen) >= 2, "several chunks"
    drafts = [s["num_draft_tokens"] for s in seen]
    assert drafts == sorted(drafts), "cumulative: never decreases"
    final = seen[-1]
    assert final["num_accepted_tokens"] == final["num_draft_tokens"] > 0
    assert final["accept_rate"] == 1.0 and final["accept_length"] > 1.0
    assert usage is not None and usage["spec_decoding"]["num_accepted_tokens"] == final["num_accepted_tokens"]


def test_non_streaming_chat_and_metrics_report_acceptance(server: Server, client: openai.OpenAI) -> None:
    before = server.metrics()
    resp = client.chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": "Tell me about rivers."}],
        max_tokens=16,
        temperature=0.0,
    )
    stats = resp.choices[0].model_extra["spec_decoding"]
    assert set(stats) == FIELDS and stats["num_drafts"] > 0
    assert resp.usage.model_extra["spec_decoding"]["num_drafts"] == stats["num_drafts"]
    after = server.metrics()
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        key = f"kvwarden:spec_decode_{name}_total"
        assert after[key] - before.get(key, 0.0) == stats[name], key
    per_pos = {k: v for k, v in after.items() if k.startswith("kvwarden:spec_decode_num_accepted_tokens_per_pos")}
    assert per_pos['kvwarden:spec_decode_num_accepted_tokens_per_pos_total{position="0"}'] > 0
    assert sum(per_pos.values()) == after["kvwarden:spec_decode_num_accepted_tokens_total"]
    info = next(k for k in after if k.startswith("kvwarden:scheduler_config_info"))
    assert 'num_speculative_tokens="3"' in info and 'speculative_method="draft"' in info


def test_speculation_off_sends_no_statistics(qwen3_next_tiny: Path) -> None:
    with running_server(str(qwen3_next_tiny)) as s:
        body = {"model": s.model, "prompt": "rivers", "max_tokens": 3}
        resp = httpx.post(f"{s.url}/v1/completions", json=body, timeout=60).json()
    assert "spec_decoding" not in resp["choices"][0] and "spec_decoding" not in resp["usage"]


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("{not json", "not JSON"),
        ('{"method": "medusa", "num_speculative_tokens": 2}', "speculative_config.method"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "speculative_config.num_speculative_tokens"),
        ('{"method": "draft", "num_speculative_tokens": 2}', "speculative_config.model"),
    ],
)
def test_bad_speculative_config_flag_is_a_cli_error_naming_the_flag(value: str, says: str) -> None:
    cmd = [sys.executable, "-m", "kvwarden.cli", "serve", "builtin:llama-tiny", "--speculative-config", value]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2
    assert "--speculative-config" in done.stderr and says in done.stderr
