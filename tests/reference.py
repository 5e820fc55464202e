"""transformers as the numerical reference: random HF checkpoints and the agreement check."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from kvwarden import LLM, SamplingParams

Init = Callable[[str, torch.Tensor, torch.Generator], torch.Tensor]


def hybrid_init(name: str, p: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Weights for hybrid checkpoints: A_log keeps decays in a stable range, matrices scaled by fan-in,
    vectors (norms, biases) near one."""
    if name.endswith("A_log"):
        return torch.log(1.0 + 4.0 * torch.rand(p.shape, generator=gen))
    if p.dim() > 1:
        return torch.randn(p.shape, generator=gen) * 0.7 / p.shape[-1] ** 0.5
    return 1.0 + torch.randn(p.shape, generator=gen) * 0.1


def save_random_checkpoint(config: object, out: Path, tokenizer_dir: Path, init: Init, seed: int = 1) -> Path:
    """A transformers model of ``config`` with weights from ``init(name, param, generator)``,
    saved with ``save_pretrained`` beside our tokenizer files."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(init(name, p, gen))
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, out / name)
    return out


def assert_agrees(
    model_dir: Path, prompt: list[int], *, budgets: tuple[int, ...], tol: float, logprobs: bool, max_new: int = 10
) -> None:
    """kvwarden vs transformers in float32: every prompt position (under each chunk budget), greedy tokens.

    Compares logits (``logprobs=False``) or log-softmax values within ``tol``.
    """
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])

    def view(x: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(x.float(), dim=-1) if logprobs else x.float()

    with torch.no_grad():
        ref = view(hf(ids).logits[0])
    llm = None
    for budget in budgets:
        llm = LLM(str(model_dir), block_size=16, max_num_batched_tokens=budget)
        ours = view(llm.score(prompt))
        assert ours.shape == ref.shape
        delta = (ours - ref).abs().max().item()
        assert delta <= tol, f"budget {budget}: max |{'logprob' if logprobs else 'logit'} delta| {delta}"
    with torch.no_grad():
        hf_greedy = hf.generate(ids, max_new_tokens=max_new, do_sample=False, eos_token_id=None)[0, len(prompt) :]
    assert llm is not None
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True))[0]
    assert out.token_ids == hf_greedy.tolist()
