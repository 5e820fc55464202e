"""The guard's parts on their own: monitors, configuration, and what it changes in requests and chunks."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvwarden.engine.faults import Faults
from kvwarden.guard.assemble import assemble
from kvwarden.guard.chunks import for_client, observe, prepare
from kvwarden.guard.config import AcceptanceConfig, GarbageConfig, MonitorsConfig, RepetitionConfig, load_config
from kvwarden.guard.monitors import ChoiceWatch, check, check_acceptance, check_garbage, loop_period


def watch(n: int, length: float | None = None, rate: float | None = None) -> ChoiceWatch:
    return ChoiceWatch(num_tokens=n, tokens=list(range(n)), logprobs=[-1.0] * n, accept_length=length, accept_rate=rate)


def test_the_acceptance_rule_is_z_ais() -> None:
    cfg = AcceptanceConfig()
    assert check_acceptance(watch(128, 1.0, 0.0), cfg) is None  # "more than 128 tokens"
    assert check_acceptance(watch(129, 1.39, 0.1), cfg).reason == "acceptance"
    assert check_acceptance(watch(129, 1.4, 0.96), cfg) is None  # both bounds are strict
    assert "loop" in check_acceptance(watch(500, 3.9, 0.97), cfg).detail
    assert check_acceptance(watch(500), cfg) is None  # a backend that reports nothing is not judged
    assert check_acceptance(watch(500, 1.0, 0.0), AcceptanceConfig(enabled=False)) is None


@given(
    st.lists(st.integers(0, 5), min_size=1, max_size=8),
    st.integers(0, 30),
    st.lists(st.integers(0, 5), max_size=10),
)
def test_loop_period_finds_the_shortest_repeating_unit(unit: list[int], extra: int, prefix: list[int]) -> None:
    window, max_period = 32, 8
    tokens = prefix + (unit * 64)[: window + extra]
    period = loop_period(tokens, window, max_period)
    assert period is not None and period <= len(unit)
    tail = tokens[-window:]
    assert all(tail[i] == tail[i - period] for i in range(period, window))
    assert loop_period(tokens[: window - 1], window, max_period) is None  # too short to judge


def test_no_loop_in_text_that_does_not_repeat() -> None:
    cfg = RepetitionConfig()
    assert loop_period(list(range(200)), cfg.window, cfg.max_period) is None
    almost = [1, 2, 3, 4] * 16
    almost[-5] = 9  # one token off inside the window
    assert loop_period(almost, 64, 16) is None


def test_garbage_is_a_low_mean_logprob_over_the_window() -> None:
    cfg = GarbageConfig(window=4, min_mean_logprob=-5.0)
    w = ChoiceWatch(logprobs=[-0.1, -0.2, -0.3, -9.0])
    assert check_garbage(w, cfg) is None  # mean of the last 4: -2.4
    w.logprobs += [-9.0, -9.0]
    assert check_garbage(w, cfg).reason == "garbage"  # -6.8
    assert check_garbage(ChoiceWatch(logprobs=[-20.0] * 3), cfg) is None  # not before a whole window


def test_monitors_report_in_a_fixed_order() -> None:
    w = ChoiceWatch(num_tokens=200, tokens=[7] * 200, logprobs=[-20.0] * 200, accept_length=1.0, accept_rate=0.0)
    assert check(w, MonitorsConfig()).reason == "acceptance"
    off = MonitorsConfig(acceptance=AcceptanceConfig(enabled=False))
    assert check(w, off).reason == "repetition"
    assert MonitorsConfig().min_tokens == 128


def test_requests_are_streamed_with_logprobs_and_answers_stripped_back() -> None:
    up = prepare({"model": "m", "prompt": "p"}, "completions", want_logprobs=True)
    assert up.body["stream"] is True and up.body["logprobs"] == 0 and up.body["stream_options"]["include_usage"]
    assert up.added_logprobs and not up.client_streams
    asked = prepare({"logprobs": 3, "stream": True, "stream_options": {"include_usage": True}}, "completions", True)
    assert not asked.added_logprobs and not asked.added_usage and asked.body["logprobs"] == 3
    chat = prepare({"messages": [], "stream": True, "top_logprobs": 2}, "chat", want_logprobs=True)
    assert chat.body["logprobs"] is True and "top_logprobs" not in chat.body and chat.added_usage
    chunk = {
        "choices": [{"index": 0, "delta": {"content": "a"}, "logprobs": {"content": [{"token": "a", "logprob": -1}]}}]
    }
    assert for_client(chunk, chat)["choices"][0]["logprobs"] is None
    assert for_client({"choices": [], "usage": {"completion_tokens": 1}}, chat) is None


def test_chunks_feed_the_watches() -> None:
    watches: dict[int, ChoiceWatch] = {}
    lp = {"tokens": ["a", "b"], "token_logprobs": [-1.0, -2.0], "top_logprobs": [None, None]}
    spec = {"num_drafts": 2, "accept_length": 1.5, "accept_rate": 0.25}
    observe({"choices": [{"index": 1, "text": "ab", "logprobs": lp, "spec_decoding": spec}]}, watches, "completions")
    observe({"choices": [{"index": 1, "text": "c", "spec_accept_length": 2.0}]}, watches, "completions")
    w = watches[1]
    assert w.num_tokens == 3 and w.tokens == ["a", "b", "c"] and w.logprobs == [-1.0, -2.0]
    assert w.accept_length == 2.0 and w.accept_rate is None  # SGLang's spelling, no rate given


def test_assembled_answers_have_the_non_streaming_shape() -> None:
    head = {"id": "x", "created": 1, "model": "m"}
    chunks = [
        {**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]},
        {**head, "choices": [{"index": 0, "delta": {"content": "hi"}, "logprobs": {"content": [{"token": "hi"}]}}]},
        {**head, "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]},
        {**head, "choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}},
    ]
    body = assemble(chunks, "chat")
    assert body["object"] == "chat.completion" and body["usage"]["total_tokens"] == 2
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "hi"} and choice["finish_reason"] == "length"
    assert choice["logprobs"] == {"content": [{"token": "hi"}]}


def test_config_errors_name_the_key(tmp_path: Path) -> None:
    toml = tmp_path / "guard.toml"
    cases = {
        "backends = ['http://a']\nmax_retrys = 1\n": "max_retrys: unknown key",
        "backends = ['http://a']\n[monitors.acceptance]\nmin_accept_lenght = 1\n": "acceptance.min_accept_lenght",
        "backends = ['http://a']\n[monitors.garbage]\nwindow = 'big'\n": "monitors.garbage.window: expected int",
        "backends = ['http://a']\n[monitors.vibes]\n": "monitors.vibes: unknown monitor",
        "backends = ['ftp://a']\n": "--backend 'ftp://a'",
        "backends = ['http://a']\n[canary]\ntop_logprobs = 50\n": "canary.top_logprobs",
        "backends = ['http://a'\n": "not valid TOML",
    }
    for text, expected in cases.items():
        toml.write_text(text)
        with pytest.raises(ValueError, match=re.escape(expected)):
            load_config(toml)
    toml.write_text("backends = ['http://a']\nmax_retries = 5\n[monitors.acceptance]\nmin_tokens = 64\n")
    cfg = load_config(toml, max_retries=1, port=None)
    assert cfg.max_retries == 1 and cfg.monitors.acceptance.min_tokens == 64 and cfg.hold_back == 64
    assert cfg.port == 8100 and cfg.host == "127.0.0.1"  # flags left out keep the file's / the defaults


def test_the_cli_names_the_flag() -> None:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "kvwarden.cli", "guard", *args], capture_output=True, text=True)

    done = run()
    assert done.returncode == 2 and "--backend" in done.stderr
    done = run("--backend", "http://127.0.0.1:1", "--max-retries", "-1")
    assert done.returncode == 2 and "max_retries" in done.stderr


def test_fault_rates_are_checked() -> None:
    assert Faults.parse(["kv-corruption=0.5", "fault-seed=3"]).describe() == {"kv-corruption": 0.5, "fault-seed": 3}
    with pytest.raises(ValueError, match=re.escape("--inject-fault repetition=1.5")):
        Faults.parse(["repetition=1.5"])
    with pytest.raises(ValueError, match="kv-corruption=FLOAT"):
        Faults.parse(["kv-corupt=1"])
    assert not Faults().touches_requests and Faults(repetition=0.1).touches_requests


def test_injected_faults_break_exactly_the_requests_drawn(llama_tiny: Path) -> None:
    from kvwarden import LLM, SamplingParams
    from kvwarden.engine.faults import REPETITION_PERIOD, FaultInjector

    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    prompt = "The committee met on Tuesday to review the quarterly budget and the new hiring plan"
    llm = LLM(str(llama_tiny))
    clean = llm.generate([prompt], params)[0].token_ids
    engine = llm.engine
    engine.faults = FaultInjector(Faults(kv_corruption=1.0))
    corrupted = llm.generate([prompt], params)[0].token_ids
    assert corrupted[0] == clean[0] and corrupted != clean  # the first token comes from the clean prefill
    assert engine.faults.num_corrupted == 1
    engine.check_integrity()
    # The garbage left the prefix cache: the next clean request recomputes the prompt and gets the clean answer.
    engine.faults = None
    assert llm.generate([prompt], params)[0].token_ids == clean
    engine.faults = FaultInjector(Faults(repetition=1.0))
    looped = llm.generate([prompt], params)[0].token_ids
    ids = engine.tokenize(prompt) + looped
    assert all(ids[i] == ids[i - REPETITION_PERIOD] for i in range(len(ids) - len(looped), len(ids)))
    engine.faults = FaultInjector(Faults(kv_corruption=0.0, repetition=0.0))
    assert llm.generate([prompt], params)[0].token_ids == clean
    assert engine.pool.num_free_blocks == engine.num_blocks
