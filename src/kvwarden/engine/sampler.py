"""Logprobs, top-k lists and token choice, one row at a time.

NOTE(invariance): every row is processed alone, as a ``[1, vocab]`` tensor, so
its log-softmax, selection and sampling never see batch partners; on a GPU the
row reductions are the canonical Triton row kernels (:class:`RowMath` is the
seam). Selections (top-k, sorting) are exact and ties are broken by token id,
so they are functions of the values alone.

Seeded sampling uses counter-based randomness: the uniform number of token
``i`` at position ``p`` is a hash of ``(seed, p, i)`` - integer arithmetic,
exact on every device - turned into an exponential race ``argmax(prob / E)``
with ``E = -log(u)``, which draws exactly from ``prob``. No generator carries
state between steps or requests, so the draw for position ``p`` depends on
nothing but the seed, the position and that row's distribution: not on batch
partners, preemption, earlier draws or speculative decoding.

Logprobs are the model's raw distribution (before temperature, top-k, top-p),
as vLLM reports by default; fingerprints therefore do not depend on sampling
parameters.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvwarden.engine.request import TopLogprobs
from kvwarden.engine.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class Sample:
    token_id: int
    logprob: float
    top: TopLogprobs


class RowMath:
    """The row reductions the sampler needs, on ``[1, n]`` float32 rows (PyTorch: the CPU path)."""

    def log_softmax(self, row: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(row, dim=-1)

    def softmax(self, row: torch.Tensor) -> torch.Tensor:
        return torch.softmax(row, dim=-1)

    def cumsum(self, row: torch.Tensor) -> torch.Tensor:
        return torch.cumsum(row, dim=-1)


class TritonRowMath(RowMath):
    """The same reductions as the canonical Triton row kernels (one program per row, fixed order)."""

    def __init__(self) -> None:
        from kvwarden.layers.kernels import rows  # Triton: only where a GPU is used

        self.rows = rows

    def log_softmax(self, row: torch.Tensor) -> torch.Tensor:
        return self.rows.log_softmax(row)

    def softmax(self, row: torch.Tensor) -> torch.Tensor:
        return self.rows.softmax(row)

    def cumsum(self, row: torch.Tensor) -> torch.Tensor:
        return self.rows.cumsum(row)


def row_math_for(device: str) -> RowMath:
    """The sampler's row reductions for a device (``"cpu"``: PyTorch; ``"cuda"``: Triton, which on a
    CPU means Triton's interpreter)."""
    return TritonRowMath() if device == "cuda" else RowMath()


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


def sample_row(
    logits: torch.Tensor, params: SamplingParams, seed: int, position: int, math: RowMath | None = None
) -> Sample:
    """Choose the token at ``position`` from one row of float32 logits ``[vocab]``."""
    math = math or RowMath()
    row = logits.view(1, -1)
    logprobs = math.log_softmax(row)[0]
    top = top_logprobs(logprobs, params.logprobs or 0)
    token = top[0][0] if params.greedy else _draw(row[0], params, seed, position, math)
    return Sample(token_id=token, logprob=float(logprobs[token]), top=top[: params.logprobs or 0])


def prompt_logprob_rows(
    logits: torch.Tensor, next_tokens: list[int], k: int, math: RowMath | None = None
) -> list[TopLogprobs]:
    """Top-k lists for prompt positions; the actual next token is always included."""
    math = math or RowMath()
    out = []
    for i, token in enumerate(next_tokens):
        logprobs = math.log_softmax(logits[i].view(1, -1))[0]
        top = top_logprobs(logprobs, k)[:k]
        if all(t != token for t, _ in top):
            top.append((token, float(logprobs[token])))
        out.append(top)
    return out


def _draw(logits: torch.Tensor, params: SamplingParams, seed: int, position: int, math: RowMath) -> int:
    return draw_from(sampling_probs(logits, params, math), seed, position)


def sampling_probs(logits: torch.Tensor, params: SamplingParams, math: RowMath) -> torch.Tensor:
    """The distribution a seeded request samples from: temperature, then top-k, then top-p."""
    scaled = logits / params.temperature
    keep = torch.ones_like(scaled, dtype=torch.bool)
    needs_order = (0 < params.top_k < scaled.numel()) or params.top_p < 1.0
    order = torch.sort(scaled, descending=True, stable=True).indices if needs_order else None
    if order is not None and 0 < params.top_k < scaled.numel():
        keep[order[params.top_k :]] = False
    if order is not None and params.top_p < 1.0:
        sorted_probs = math.softmax(scaled[order].view(1, -1))
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        mass_before = (math.cumsum(sorted_probs) - sorted_probs)[0]
        keep[order[mass_before >= params.top_p]] = False
    scaled = scaled.masked_fill(~keep, float("-inf"))
    return math.softmax(scaled.view(1, -1))[0]


def draw_from(probs: torch.Tensor, seed: int, position: int, stream: int = 0) -> int:
    """One draw from ``probs`` keyed by ``(seed, position, stream)`` alone.

    Exponential race: argmax(p / E) with E ~ Exp(1) draws exactly from p. The
    maximum is exact; among equal ratios the lowest id wins. ``stream`` > 0
    gives independent draws for the same position (rejection sampling's
    residual); the default stream is the one plain decoding uses.
    """
    key = position if stream == 0 else position ^ (stream << 56)
    ratio = probs.double() / exponential_noise(seed, key, probs.numel(), probs.device)
    return int(torch.nonzero(ratio == ratio.max())[0, 0])


def uniform(seed: int, position: int, stream: int) -> float:
    """One uniform number in (0, 1) keyed by ``(seed, position, stream)``."""
    return float(torch.exp(-exponential_noise(seed, position ^ (stream << 56), 1, "cpu"))[0])  # E = -log(u)


def exponential_noise(seed: int, position: int, n: int, device: torch.device | str) -> torch.Tensor:
    """``-log(u)`` for ``u`` uniform in (0, 1), one per token id, a pure function of (seed, position, id)."""
    key = _splitmix(_splitmix(seed & _MASK64) ^ (position & _MASK64))
    ids = torch.arange(n, dtype=torch.int64, device=device)
    bits = _mix_tensor(ids * _signed(0x9E3779B97F4A7C15) + _signed(key))
    u = ((bits >> 11) & ((1 << 53) - 1)).double().add_(0.5).mul_(2.0**-53)  # 53 random bits, never 0 or 1
    return -torch.log(u)


def _signed(value: int) -> int:
    """A 64-bit pattern as the int64 torch stores it."""
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


def _splitmix(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _mix_tensor(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser on int64 tensors (wrapping multiplication, logical shifts)."""
    z = (z ^ _lsr(z, 30)) * _signed(0xBF58476D1CE4E5B9)
    z = (z ^ _lsr(z, 27)) * _signed(0x94D049BB133111EB)
    return z ^ _lsr(z, 31)


def _lsr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's ``>>`` on int64 is arithmetic)."""
    return (z >> s) & ((1 << (64 - s)) - 1)
