"""The predictor reproduces docs/production-story.md §1 and explains its verdicts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvwarden.probe.predict import predict_pair, search_a_lengths

INCIDENT = {"rule": "vllm-align", "block_size": 1600, "num_spec_tokens": 2}


def test_a_3196_makes_b_unstable_but_its_first_run_is_clean() -> None:
    p = predict_pair(INCIDENT["rule"], 1600, 3196, 4000, 3100, num_spec_tokens=2)
    assert not p.repeats_stable and p.history_dependent and p.first_run_alike_clean
    assert p.a_saved_state_at == {1600: False}
    assert p.b_cached_tokens[0] == 0 and p.b_cached_tokens[1] == 1600
    assert "A ran as tokens 0-3196 in one chunk and saved no state" in p.explanation
    assert "state from [B run 1: tokens 0-1600 in one chunk]" in p.explanation


def test_a_3205_saves_the_state_and_is_stable() -> None:
    p = predict_pair("vllm-align", 1600, 3205, 4000, 3100, num_spec_tokens=2)
    assert p.repeats_stable and not p.history_dependent
    assert p.a_saved_state_at == {1600: True}


def test_a_4689_with_a_short_document_is_stable_and_a_long_one_breaks_at_3200() -> None:
    short = predict_pair("vllm-align", 1600, 4689, 4000, 3100, num_spec_tokens=2)
    assert short.repeats_stable and not short.history_dependent
    assert short.a_saved_state_at == {1600: True}
    long = predict_pair("vllm-align", 1600, 4689, 5000, 3500, num_spec_tokens=2)
    assert not long.repeats_stable
    assert long.a_saved_state_at == {1600: True, 3200: False}
    assert long.b_cached_tokens[1:] == [3200, 3200]


@pytest.mark.parametrize("a_len", [3196, 3205, 4689])
def test_the_fix_and_kvwarden_are_always_stable(a_len: int) -> None:
    for rule in ("vllm-align-fixed", "kvwarden"):
        p = predict_pair(rule, 1600, a_len, 5000, min(a_len, 3500), num_spec_tokens=2)
        assert p.repeats_stable and not p.history_dependent, rule


def test_without_speculation_the_pull_back_moves() -> None:
    # last = 3196 - 1596 = 1600 without the pull-back: A's chunk stops there and saves the state.
    assert predict_pair("vllm-align", 1600, 3196, 4000, 3100).repeats_stable


def test_search_finds_the_flip_at_the_boundary() -> None:
    flips = search_a_lengths("vllm-align", 1600, 4000, 3100, 2, a_range=(3150, 3250))
    assert flips == [(3150, 3199, False, True), (3200, 3250, True, False)]


def test_a_budget_below_a_block_is_reported() -> None:
    with pytest.raises(ValueError, match="cannot schedule"):
        predict_pair("vllm-align", 16, 100, 120, 50, max_num_batched_tokens=8)


def test_cli_json_text_pairs_and_flag_errors(tmp_path: Path, llama_tiny: Path) -> None:
    cmd = [sys.executable, "-m", "kvwarden.cli", "predict", "--rule", "vllm-align", "--block-size", "1600"]
    cmd += ["--num-spec-tokens", "2", "--pair", "3196:4000:3100", "--pair", "3205:4000:3100", "--json"]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    assert done.returncode == 1, done.stderr  # one pair predicted UNSTABLE: 1, as probe's unstable arm
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert [x["repeats_stable"] for x in lines] == [False, True]
    assert [x["history_dependent"] for x in lines] == [True, False]
    assert all(x["explanation"] for x in lines)
    (tmp_path / "a.txt").write_text("The lease for unit 4B starts in March. " * 20 + "Who pays?")
    (tmp_path / "b.txt").write_text("The lease for unit 4B starts in March. " * 20 + "What is the rent?" * 5)
    texts = [sys.executable, "-m", "kvwarden.cli", "predict", "--rule", "vllm-align", "--block-size", "16"]
    texts += ["--texts", f"{tmp_path / 'a.txt'}:{tmp_path / 'b.txt'}", "--tokenizer", str(llama_tiny), "--json"]
    done = subprocess.run(texts, capture_output=True, text=True, check=False)
    out = json.loads(done.stdout)
    assert done.returncode == (0 if out["repeats_stable"] else 1), done.stderr
    assert 0 < out["shared"] < out["a_len"] < out["b_len"]
    bad = subprocess.run([*cmd[:-5], "--pair", "10:x:3"], capture_output=True, text=True, check=False)
    assert bad.returncode == 2 and "--pair" in bad.stderr
    bad = subprocess.run([*cmd[:-5], "--pair", "10:20:30"], capture_output=True, text=True, check=False)
    assert bad.returncode == 2 and "shared length 30" in bad.stderr
