"""Bad input gets a ValueError naming the field and disturbs nothing else."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvwarden import LLM, SamplingParams
from util import assert_same

GOOD = list(range(10, 60))
PARAMS = SamplingParams(temperature=0.0, max_tokens=12, logprobs=20, ignore_eos=True)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"prompt_logprobs": 99}, "prompt_logprobs"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"seed": "x"}, "seed"),
        ({"stop": [""]}, "stop"),
        ({"frobnicate": 1}, "frobnicate"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.fixture()
def llm(llama_tiny: Path) -> LLM:
    return LLM(str(llama_tiny), block_size=8, max_model_len=256)


@pytest.mark.parametrize(
    ("prompt", "match"),
    [
        ("", "prompt: must not be empty"),
        ([], "prompt: must not be empty"),
        ([5, 99999], "prompt: token id 99999 is outside the vocabulary"),
        ([5, -1], "prompt: token id -1"),
        (list(range(3, 300)), "maximum context length is 256 tokens; the prompt has 297"),
        ([1.5, 2], "prompt: token ids must be integers"),
        (12, "prompt: expected a string or a list"),
    ],
)
def test_bad_prompts_name_the_field_and_disturb_nothing(llm: LLM, prompt: object, match: str) -> None:
    engine = llm.engine
    baseline = engine.pool.num_free_blocks
    ref = llm.generate([GOOD], PARAMS)[0]
    # a request is in flight when the bad one arrives
    rid = engine.add_request(GOOD, PARAMS)
    engine.step()
    with pytest.raises(ValueError, match=match):
        engine.add_request(prompt, PARAMS)  # type: ignore[arg-type]
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs[out.request_id] = out
    assert_same(ref, outs[rid], "request in flight beside a rejected one")
    engine.check_integrity()
    assert engine.pool.num_free_blocks == baseline


def test_generate_validates_every_prompt_before_queueing_any(llm: LLM) -> None:
    with pytest.raises(ValueError, match="prompt"):
        llm.generate([GOOD, [5, 10**9]], PARAMS)
    assert not llm.engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="params: 1 given for 2 prompts"):
        llm.generate([GOOD, GOOD], [PARAMS])


def test_aborted_requests_return_their_blocks(llm: LLM) -> None:
    engine = llm.engine
    baseline = engine.pool.num_free_blocks
    ref = llm.generate([GOOD], PARAMS)[0]
    keep = engine.add_request(GOOD, PARAMS)
    doomed = [engine.add_request(list(range(100, 100 + n)), PARAMS) for n in (30, 45, 70)]
    for _ in range(3):
        engine.step()
    assert engine.pool.num_free_blocks < baseline
    for rid in doomed:
        aborted = engine.abort(rid)
        assert aborted is not None and aborted.finish_reason == "abort"
        engine.check_integrity()
    assert engine.abort(doomed[0]) is None and engine.abort("no-such-request") is None
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs[out.request_id] = out
    assert_same(ref, outs[keep], "survivor of aborts")
    assert engine.pool.num_free_blocks == baseline


def test_duplicate_request_id_and_bad_salt(llm: LLM) -> None:
    engine = llm.engine
    engine.add_request(GOOD, PARAMS, request_id="x")
    with pytest.raises(ValueError, match="request_id"):
        engine.add_request(GOOD, PARAMS, request_id="x")
    with pytest.raises(ValueError, match="cache_salt"):
        engine.add_request(GOOD, PARAMS, cache_salt="")
    engine.abort("x")
    engine.check_integrity()


def test_unsupported_checkpoint_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}')
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel.*not supported"):
        LLM(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="not a model directory"):
        LLM(str(tmp_path / "missing"))
