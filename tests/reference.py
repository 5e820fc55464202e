"""transformers as the numerical reference: random HF checkpoints and the agreement check."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from kvwarden import LLM, SamplingParams
from tolerance import assert_within, model_tolerance

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


def model_tol(model_dir: Path, logits: torch.Tensor, context: int, log_softmax: bool = True) -> float:
    """The float32 rounding bound for this checkpoint's shape and the reference ``logits``' magnitude."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return model_tolerance(config, logits.abs().max().item(), context=context, log_softmax=log_softmax)


def assert_agrees(
    model_dir: Path, prompt: list[int], *, budgets: tuple[int, ...], logprobs: bool, max_new: int = 10
) -> None:
    """kvwarden vs transformers in float32: every prompt position (under each chunk budget), greedy tokens.

    Compares logits (``logprobs=False``) or log-softmax values within the float32 rounding bound of the
    model's shape and the reference logits' magnitude (``tolerance.model_tolerance``).
    """
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])

    def view(x: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(x.float(), dim=-1) if logprobs else x.float()

    with torch.no_grad():
        logits = hf(ids).logits[0].float()
    ref = view(logits)
    tol = model_tol(model_dir, logits, len(prompt), log_softmax=logprobs)
    llm = None
    for budget in budgets:
        llm = LLM(str(model_dir), block_size=16, max_num_batched_tokens=budget)
        ours = view(llm.score(prompt))
        assert ours.shape == ref.shape
        assert_within(ours, ref, tol, f"budget {budget}, {'logprobs' if logprobs else 'logits'}")
    with torch.no_grad():
        hf_greedy = hf.generate(ids, max_new_tokens=max_new, do_sample=False, eos_token_id=None)[0, len(prompt) :]
    assert llm is not None
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True))[0]
    assert out.token_ids == hf_greedy.tolist()


@dataclass
class TieCount:
    """Selections made by a reference's sparse-attention indexers: rows, and rows whose ``k``-th best score
    was equal to a score left out (where ``torch.topk``'s choice among equal scores decided the set)."""

    rows: int = 0
    tied_rows: int = 0


@contextmanager
def canonical_indexer_ties(model: torch.nn.Module, canonical: bool = True) -> Iterator[TieCount]:
    """Within the block, the DSA indexers of a transformers ``model`` select their top-k with equal scores
    going to the lower position (kvwarden's documented rule) instead of ``torch.topk``'s unspecified choice;
    ``canonical=False`` keeps ``torch.topk`` and only counts. Everything else in the model is untouched:
    ``Tensor.topk`` is replaced only while an indexer's forward runs, the scores are the reference's own.

    Why this is needed: a key whose every indexer head has a non-positive dot product scores exactly
    ``0`` (the heads are summed through a ReLU), and with few heads such keys are common (one in 2**H with
    H heads): when the ``k``-th best score is such a zero, several selections are equally right and the
    reference picks one by its sort's internals. docs/sparse-attention.md has the measurement.
    """
    counts = TieCount()
    inside = [False]
    original = torch.Tensor.topk

    def topk(self: torch.Tensor, k: int, dim: int = -1, largest: bool = True, sorted: bool = True) -> object:
        if not inside[0] or not largest or dim not in (-1, self.dim() - 1):
            return original(self, k, dim, largest, sorted)
        flat = self.reshape(-1, self.shape[-1])
        kth = original(flat, k, -1).values[:, -1:]
        above = (flat > kth).sum(-1)
        tied = (flat == kth).sum(-1) > (k - above)  # more equal scores than places left for them
        counts.rows += flat.shape[0]
        counts.tied_rows += int((tied & torch.isfinite(kth[:, 0])).sum())
        if not canonical:
            return original(self, k, dim, largest, sorted)
        ranked = torch.sort(self, dim=-1, descending=True, stable=True)  # equal scores keep position order
        return torch.return_types.topk((ranked.values[..., :k], ranked.indices[..., :k]))

    def enter(*_: object) -> None:
        inside[0] = True

    def leave(*_: object) -> None:
        inside[0] = False

    indexers = [m for m in model.modules() if type(m).__name__.endswith("Indexer")]
    assert indexers, f"{type(model).__name__} has no DSA indexer"
    hooks = [h for m in indexers for h in (m.register_forward_pre_hook(enter), m.register_forward_hook(leave))]
    torch.Tensor.topk = topk  # type: ignore[method-assign]
    try:
        yield counts
    finally:
        torch.Tensor.topk = original  # type: ignore[method-assign]
        for h in hooks:
            h.remove()
