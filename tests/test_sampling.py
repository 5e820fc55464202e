"""Sampler: greedy, seeded sampling, top-k/top-p, logprob lists, stops, prompt logprobs."""

from __future__ import annotations

import math
import random
from collections import Counter
from pathlib import Path

import pytest
import torch

from kvwarden import LLM, SamplingParams
from kvwarden.engine.randomness import draw_from
from kvwarden.engine.row_math import RowMath, draw_rows, sampling_probs
from kvwarden.engine.sampler import step_tops, top_logprobs
from tolerance import assert_within, log_softmax_bound, unit_roundoff
from util import exact, random_tokens


@pytest.fixture(scope="module")
def llm(llama_tiny: Path) -> LLM:
    return LLM(str(llama_tiny))


PROMPT = list(range(40, 90))


def test_top_logprobs_descending_with_ties_broken_by_token_id() -> None:
    row = torch.tensor([-2.0, -1.0, -3.0, -1.0, -0.5, -1.0])
    assert top_logprobs(row, 5) == [(4, -0.5), (1, -1.0), (3, -1.0), (5, -1.0), (0, -2.0)]
    assert top_logprobs(row, 2) == [(4, -0.5), (1, -1.0)]  # a tie at the boundary keeps the lower id


@pytest.mark.parametrize("k", [0, 1, 3, 20])
def test_step_tops_equal_each_row_alone(k: int) -> None:
    # Rows drawn from a few values so ties cross the k-th place in some rows and not in others.
    gen = torch.Generator().manual_seed(k)
    logits = torch.randint(0, 6, (9, 50), generator=gen).float() * 0.5
    logits[3] = 1.0  # one row all ties
    tops = step_tops(logits, k, RowMath())
    for i, row in enumerate(logits):
        alone = torch.log_softmax(row.view(1, -1), dim=-1)[0]
        assert torch.equal(tops[i].logprobs, alone)
        assert tops[i].top == top_logprobs(alone, k)


def test_draw_rows_equal_each_row_drawn_alone() -> None:
    """The step's seeded draws (a GPU engine draws every temperature-only row at once) against the
    one-row draw, at temperatures, seeds and positions that differ per row."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 4096, generator=gen) * 3
    logits[3] = logits[0]
    temps, seeds, positions = [0.6, 1.0, 1.7, 0.6, 0.3, 2.0], [1, 2, 3, 1, 99, 5], [10, 11, 0, 10, 7, 123456]
    got = draw_rows(logits, temps, seeds, positions, RowMath())
    for i in range(6):
        params = SamplingParams(temperature=temps[i], seed=seeds[i])
        assert got[i] == draw_from(sampling_probs(logits[i], params, RowMath()), seeds[i], positions[i]), i
    assert got[0] == got[3]  # same row, seed and position: same draw


def test_the_fused_draw_kernel_draws_what_the_element_wise_ops_draw() -> None:
    """``kernels/draw.py`` (a GPU engine's batched draws; Triton's interpreter on the CPU) against the
    PyTorch ops it replaces: the same token per row, over several tiles and a ragged last one."""
    from kvwarden.engine.randomness import draw_key, noise_from_keys, signed64
    from kvwarden.layers.kernels.draw import draw_tokens

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(7, 2500, generator=gen) * 4
    logits[2] = logits[1]
    probs = torch.softmax(logits / 0.7, dim=-1).to(dev)
    keys = [draw_key(s, p) for s, p in [(1, 9), (2, 10), (2, 10), (3, 0), (7, 123456), (8, 1 << 40), (9, 3)]]
    key = torch.tensor([signed64(k) for k in keys], dtype=torch.int64, device=dev)
    ratio = probs.double() / noise_from_keys(key[:, None], probs.shape[1], dev)
    want = (ratio == ratio.amax(dim=-1, keepdim=True)).to(torch.int8).argmax(dim=-1)
    got = draw_tokens(probs, key)
    assert got.tolist() == want.tolist()
    assert got[1] == got[2]  # the same row and key: the same token
    assert draw_tokens(probs[4:5], key[4:5]).tolist() == [got[4].item()]  # alone as in the batch


def test_greedy_lists_are_consistent(llm: LLM) -> None:
    out = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=8, logprobs=20, ignore_eos=True))[0]
    assert len(out.logprobs) == len(out.token_ids) == 8
    for token, top, lp in zip(out.token_ids, out.logprobs, out.sampled_logprobs, strict=True):
        assert len(top) == 20
        assert top[0] == (token, lp)
        values = [v for _, v in top]
        assert values == sorted(values, reverse=True)
        # each value a float32 rounding of the exact log-probability (|v| u off): exp moves by that relative
        slack = math.fsum(math.exp(v) * 2 * unit_roundoff(torch.float32) * (abs(v) + 1) for v in values)
        assert math.fsum(math.exp(v) for v in values) <= 1.0 + slack


def test_seeded_sampling_is_reproducible_and_seed_dependent(llm: LLM) -> None:
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=12, ignore_eos=True, logprobs=2) for s in (1, 1, 2)]
    a, b, c = llm.generate([PROMPT] * 3, params)
    assert a.token_ids == b.token_ids and exact(a.logprobs) == exact(b.logprobs)
    assert a.token_ids != c.token_ids


def test_top_k_1_and_tiny_top_p_are_greedy(llm: LLM) -> None:
    greedy = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))[0]
    k1 = llm.generate([PROMPT], SamplingParams(temperature=1.5, top_k=1, seed=3, max_tokens=10, ignore_eos=True))[0]
    p0 = llm.generate([PROMPT], SamplingParams(temperature=1.5, top_p=1e-6, seed=3, max_tokens=10, ignore_eos=True))[0]
    assert k1.token_ids == greedy.token_ids == p0.token_ids


def test_sampling_frequencies_follow_the_distribution(llm: LLM) -> None:
    n = 400
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=1, logprobs=3) for s in range(n)]
    outs = llm.generate([PROMPT] * n, params)
    top = outs[0].logprobs[0]
    counts = Counter(o.token_ids[0] for o in outs)
    for token, lp in top:
        p = math.exp(lp)
        sigma = math.sqrt(p * (1 - p) / n)
        assert abs(counts[token] / n - p) <= 5 * sigma, (token, counts[token], p)  # 5 sigma: false alarm < 6e-7


def test_top_k_restricts_the_support(llm: LLM) -> None:
    params = [SamplingParams(temperature=2.0, top_k=3, seed=s, max_tokens=1, logprobs=3) for s in range(60)]
    outs = llm.generate([PROMPT] * 60, params)
    allowed = {t for t, _ in outs[0].logprobs[0]}
    assert {o.token_ids[0] for o in outs} <= allowed


def test_stop_strings_stop_token_ids_and_length(llm: LLM) -> None:
    base = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))[0]
    assert base.finish_reason == "length" and len(base.token_ids) == 16
    stop_id = base.token_ids[4]
    by_id = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=[stop_id]))[0]
    assert by_id.finish_reason == "stop" and by_id.stop_reason == stop_id
    assert by_id.token_ids == base.token_ids[: base.token_ids.index(stop_id) + 1]
    text = base.text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    if stop.strip():
        out = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=16, stop=[stop], ignore_eos=True))[0]
        assert out.finish_reason == "stop" and out.stop_reason == stop
        assert out.text == text[: text.find(stop)]
        keep = SamplingParams(
            temperature=0.0, max_tokens=16, stop=[stop], ignore_eos=True, include_stop_str_in_output=True
        )
        assert llm.generate([PROMPT], keep)[0].text == text[: text.find(stop) + len(stop)]


def test_prompt_logprobs_match_full_forward_and_any_chunking(llama_tiny: Path) -> None:
    rng = random.Random(1)
    prompt = random_tokens(rng, 70, 1000)
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=5)
    whole = LLM(str(llama_tiny))
    logits = whole.score(prompt)
    ref = whole.generate([prompt], params)[0]
    assert ref.prompt_logprobs[0] is None and len(ref.prompt_logprobs) == len(prompt)
    # the engine's own row reduction on its own device (the compiled log-softmax on the CPU, Triton's on a
    # GPU), bitwise; PyTorch's within rounding
    lp = whole.engine.row_math.log_softmax_rows(logits.to(whole.engine.ops.device)).cpu()
    # two float32 evaluations (ours, PyTorch's), each within log_softmax_bound of the exact value
    assert_within(lp, torch.log_softmax(logits, dim=-1), 2 * log_softmax_bound(logits), "prompt log-softmax")
    for j in range(1, len(prompt)):
        entry = dict(ref.prompt_logprobs[j])
        assert entry[prompt[j]] == lp[j - 1, prompt[j]].item()
    chunked = LLM(str(llama_tiny), max_num_batched_tokens=16, block_size=4).generate([prompt], params)[0]
    assert exact(chunked.prompt_logprobs[1:]) == exact(ref.prompt_logprobs[1:])
    # prompt logprobs need every position: no prefix hit even when the cache is warm
    assert whole.generate([prompt], params)[0].num_cached_tokens == 0
