"""Overlapped scheduling (``engine/overlap.py``): the next decode step launched before the host reads this
step's tokens gives every request the numbers of steps run one after another.

With a GPU the decode graphs are captured and the early step really overlaps the host; without one the
same code runs the graphs' static-buffer step uncaptured (``cuda_graphs="emulate"``) on the Triton kernels
under the interpreter, so CI checks the bookkeeping: which steps go ahead, rows of requests that ended
meanwhile dropped, blocks returned, aborts and arrivals between steps.
"""

from __future__ import annotations

import random
from functools import partial
from pathlib import Path

import torch

from kvwarden import LLM, SamplingParams
from kvwarden.engine.llm_engine import LLMEngine
from util import random_tokens

GPU = torch.cuda.is_available()
BLOCK = 8


def _make(model: Path, **kw: object) -> LLM:
    backend = {"device": "cuda", "dtype": "bfloat16"} if GPU else {"device": "cpu", "kernels": "triton"}
    graphs = "auto" if GPU else "emulate"
    args = dict(block_size=BLOCK, max_num_batched_tokens=64, num_blocks=256, max_num_seqs=8, cuda_graphs=graphs)
    return partial(LLM, str(model), **backend, **args)(**kw)


def _prompts() -> list[list[int]]:
    rng = random.Random(11)
    return [random_tokens(rng, n, 1000) for n in (5, 19, 11, 30, 8)]


def _params(stop_token: int | None = None) -> list[SamplingParams]:
    """Greedy and (on a GPU) seeded temperature-only rows, chosen on the device, ending at different steps.
    (The interpreter draws seeded rows one by one on the host: a step with one runs serially there.)"""
    out = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (6, 3, 9, 5, 7)]
    if GPU:
        out[2] = SamplingParams(temperature=0.8, seed=5, max_tokens=9, ignore_eos=True)
        out[4] = SamplingParams(temperature=1.1, seed=6, max_tokens=7, ignore_eos=True)
    if stop_token is not None:  # request 0 stops on a token the host sees only after the next step is queued
        out[0] = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, stop_token_ids=(stop_token,))
    return out


def _summary(outs: list) -> list[tuple]:
    return [(o.token_ids, o.sampled_logprobs, o.finish_reason, o.text) for o in outs]


def _overlap(llm: LLM):
    overlap = llm.engine.overlap
    assert overlap is not None, "async scheduling is on by default where decode steps replay graphs"
    return overlap


def test_steps_launched_ahead_give_the_numbers_of_serial_steps(llama_tiny: Path) -> None:
    prompts = _prompts()
    serial = _make(llama_tiny, async_scheduling=False)
    assert serial.engine.overlap is None
    base = serial.generate(prompts, _params())
    stop_token = base[0].token_ids[2]
    want = {"plain": _summary(base), "stop": _summary(serial.generate(prompts, _params(stop_token)))}
    assert want["stop"][0][2] == "stop" and len(want["stop"][0][0]) == 3

    llm = _make(llama_tiny)
    overlap = _overlap(llm)
    for name, params in (("plain", _params()), ("stop", _params(stop_token))):
        dropped = overlap.dropped_rows
        assert _summary(llm.generate(prompts, params)) == want[name], name
        if name == "stop":  # request 0 rode in the step launched before its stop token was read
            assert overlap.dropped_rows > dropped
    assert overlap.launched > 0
    engine = llm.engine
    assert engine._ahead is None  # nothing is left on the device once every request ended
    engine.check_integrity()
    assert engine.pool.num_free_blocks == engine.num_blocks  # every block returned (prefix-cached ones too)


def test_logprobs_and_top_k_rows_run_serially_with_the_same_numbers(llama_tiny: Path) -> None:
    """Rows whose token or lists are made on the host keep the serial loop; a batch mixing them too."""
    prompts = _prompts()[:3]
    params = [
        SamplingParams(temperature=0.0, max_tokens=4, logprobs=3, ignore_eos=True),
        SamplingParams(temperature=0.9, top_k=20, seed=2, max_tokens=4, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
    ]
    llm = _make(llama_tiny)
    got = llm.generate(prompts, params)
    assert _overlap(llm).launched == 0
    want = _make(llama_tiny, async_scheduling=False).generate(prompts, params)
    assert [(o.token_ids, o.logprobs) for o in got] == [(o.token_ids, o.logprobs) for o in want]


def _drive(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams], abort_at: int | None) -> dict:
    """Step an engine by hand: request 3 arrives at step 2; request 1 is aborted at step ``abort_at`` (when
    a step is launched ahead with it, if any is)."""
    pairs = enumerate(zip(prompts, params, strict=True))
    ids = [engine.add_request(p, sp, request_id=f"r{i}") for i, (p, sp) in pairs if i != 3]
    done: dict[str, tuple] = {}
    step = 0
    while engine.has_unfinished_requests():
        if step == 2:
            engine.add_request(prompts[3], params[3], request_id="r3")
        if step == abort_at:
            ahead = engine._ahead
            assert ahead is not None and any(c.request.request_id == "r1" for c in ahead.chunks)
            out = engine.abort("r1")
            assert out is not None
            done["r1"] = (out.token_ids, out.sampled_logprobs, out.finish_reason)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = (out.token_ids, out.sampled_logprobs, out.finish_reason)
        step += 1
    assert set(done) == {*ids, "r3"}
    return done


def test_an_abort_and_an_arrival_between_overlapped_steps(llama_tiny: Path) -> None:
    prompts = _prompts()[:4]
    params = [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True) for _ in prompts]
    want = _drive(_make(llama_tiny, async_scheduling=False).engine, prompts, params, abort_at=None)
    llm = _make(llama_tiny)
    engine = llm.engine
    # find a step with r1 in a step launched ahead: after the arrival's prefill, decode goes ahead again
    got = _drive(engine, prompts, params, abort_at=6)
    assert got["r1"][2] == "abort"
    assert {k: v for k, v in got.items() if k != "r1"} == {k: v for k, v in want.items() if k != "r1"}
    assert got["r1"][0] == want["r1"][0][: len(got["r1"][0])]  # what it had produced before the abort
    assert _overlap(llm).dropped_rows > 0  # its row in the step already on the device was dropped
    engine.check_integrity()
    assert engine.pool.num_free_blocks == engine.num_blocks


def test_the_flag_reaches_the_engine_config() -> None:
    from kvwarden.cli import build_parser
    from kvwarden.commands.engine_args import engine_kwargs

    parser = build_parser()
    assert engine_kwargs(parser.parse_args(["serve", "m"]))["async_scheduling"] is True
    assert engine_kwargs(parser.parse_args(["serve", "m", "--no-async-scheduling"]))["async_scheduling"] is False
