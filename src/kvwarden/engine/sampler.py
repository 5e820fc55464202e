"""Logprobs, top-k lists and token choice, one row at a time.

NOTE(invariance): every row is processed alone, as a ``[1, vocab]`` tensor, so
its log-softmax, sort and sampling never see batch partners. The random draw for
seeded sampling comes from a generator seeded by (request seed, output index),
so it does not depend on what else ran, on preemption, or on how many draws
earlier steps made.

Logprobs are the model's raw distribution (before temperature, top-k, top-p),
as vLLM reports by default; fingerprints therefore do not depend on sampling
parameters.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from kvwarden.engine.request import TopLogprobs
from kvwarden.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class Sample:
    token_id: int
    logprob: float
    top: TopLogprobs


def top_logprobs(logprobs: torch.Tensor, k: int) -> list[tuple[int, float]]:
    """The ``k`` largest (id, logprob) pairs of one row, descending, ties by token id.

    Exact without sorting the vocabulary: every id whose value reaches the k-th
    largest value is a candidate (all ties included), and the candidates are
    sorted stably by value, so equal values keep ascending ids.
    """
    kk = max(k, 1)
    threshold = torch.topk(logprobs, kk).values[-1]
    candidates = torch.nonzero(logprobs >= threshold).view(-1)  # ascending ids
    order = torch.sort(logprobs[candidates], descending=True, stable=True).indices
    ids = candidates[order][:kk]
    return list(zip(ids.tolist(), logprobs[ids].tolist(), strict=True))


def sample_row(logits: torch.Tensor, params: SamplingParams, seed: int, step: int) -> Sample:
    """Choose the next token from one row of float32 logits ``[vocab]``."""
    row = logits.view(1, -1)
    logprobs = torch.log_softmax(row, dim=-1)[0]
    top = top_logprobs(logprobs, params.logprobs or 0)
    token = top[0][0] if params.greedy else _draw(row[0], params, seed, step)
    return Sample(token_id=token, logprob=float(logprobs[token]), top=top[: params.logprobs or 0])


def prompt_logprob_rows(logits: torch.Tensor, next_tokens: list[int], k: int) -> list[TopLogprobs]:
    """Top-k lists for prompt positions; the actual next token is always included."""
    out = []
    for i, token in enumerate(next_tokens):
        logprobs = torch.log_softmax(logits[i].view(1, -1), dim=-1)[0]
        top = top_logprobs(logprobs, k)[:k]
        if all(t != token for t, _ in top):
            top.append((token, float(logprobs[token])))
        out.append(top)
    return out


def _draw(logits: torch.Tensor, params: SamplingParams, seed: int, step: int) -> int:
    scaled = logits / params.temperature
    keep = torch.ones_like(scaled, dtype=torch.bool)
    needs_order = (0 < params.top_k < scaled.numel()) or params.top_p < 1.0
    order = torch.sort(scaled, descending=True, stable=True).indices if needs_order else None
    if order is not None and 0 < params.top_k < scaled.numel():
        keep[order[params.top_k :]] = False
    if order is not None and params.top_p < 1.0:
        sorted_probs = torch.softmax(scaled[order].view(1, -1), dim=-1)[0]
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        mass_before = torch.cumsum(sorted_probs, dim=0) - sorted_probs
        keep[order[mass_before >= params.top_p]] = False
    scaled = scaled.masked_fill(~keep, float("-inf"))
    probs = torch.softmax(scaled.view(1, -1), dim=-1)[0]
    gen = torch.Generator().manual_seed(_step_seed(seed, step))
    # Exponential race: argmax(p / E) with E ~ Exp(1) draws exactly from p.
    noise = torch.empty_like(probs).exponential_(generator=gen)
    return int(torch.argmax(probs / noise))


def _step_seed(seed: int, step: int) -> int:
    digest = hashlib.sha256(f"kvwarden-sample:{seed}:{step}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)
