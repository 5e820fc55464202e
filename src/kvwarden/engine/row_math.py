"""How a backend reduces and draws a sampler's rows: :class:`RowMath` and the seeded draws.

NOTE(invariance): a row's log-softmax never sees batch partners: on the CPU
each row is reduced alone, as a ``[1, vocab]`` tensor (torch splits a single
long row across threads differently from a batch of rows), or by the compiled
kernels, which reduce every row alone in one fixed order; on a GPU the
canonical Triton row kernel runs one program per row in a fixed order, so all
of a step's rows go in one launch. :func:`row_math_for` picks the backend.

Seeded sampling uses counter-based randomness (``engine/randomness.py``): the
uniform number of token ``i`` at position ``p`` is a hash of ``(seed, p, i)``,
turned into an exponential race ``argmax(prob / E)`` with ``E = -log(u)``.
:func:`draw_ids` draws many temperature-only rows at once, each the token its
row drawn alone gets (on a GPU in one kernel, ``layers/kernels/draw.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvwarden.engine.device_copy import upload
from kvwarden.engine.randomness import draw_from, draw_key, noise_from_keys, signed64
from kvwarden.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvwarden.layers.cpu_kernels.library import CpuKernels


class RowMath:
    """The row reductions the sampler needs, on ``[1, n]`` float32 rows (PyTorch: the CPU path)."""

    def log_softmax(self, row: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(row, dim=-1)

    def log_softmax_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Log-softmax of each row of ``[R, n]``, every row reduced exactly as :meth:`log_softmax` alone."""
        out = torch.empty_like(rows)
        for i in range(rows.shape[0]):
            out[i : i + 1] = self.log_softmax(rows[i : i + 1])
        return out

    def softmax(self, row: torch.Tensor) -> torch.Tensor:
        return torch.softmax(row, dim=-1)

    def cumsum(self, row: torch.Tensor) -> torch.Tensor:
        return torch.cumsum(row, dim=-1)

    def draw(self, row: torch.Tensor, params: SamplingParams, seed: int, position: int) -> int:
        """The seeded draw for one row of logits ``[vocab]`` (temperature, top-k, top-p)."""
        return draw_from(sampling_probs(row, params, self), seed, position)

    def draw_rows(
        self, logits: torch.Tensor, temperatures: list[float], seeds: list[int], positions: list[int]
    ) -> list[int] | None:
        """Temperature-only seeded draws for rows of ``[R, vocab]`` at once, each the token :meth:`draw` gives
        its row alone; None where this backend draws row by row (PyTorch on the CPU: an element's SIMD body
        and scalar tail may differ, so a batch could change a row's bits)."""
        ids = self.draw_ids(logits, temperatures, seeds, positions)
        return None if ids is None else ids.tolist()

    def draw_ids(
        self, logits: torch.Tensor, temperatures: list[float], seeds: list[int], positions: list[int]
    ) -> torch.Tensor | None:
        """:meth:`draw_rows` as a tensor on the logits' device, before any host read (None: row by row)."""
        return None


class TritonRowMath(RowMath):
    """The same reductions as the canonical Triton row kernels (one program per row, fixed order)."""

    def __init__(self) -> None:
        from kvwarden.layers.kernels import rows  # Triton: only where a GPU is used

        self.rows = rows

    def log_softmax(self, row: torch.Tensor) -> torch.Tensor:
        return self.rows.log_softmax(row)

    def log_softmax_rows(self, rows: torch.Tensor) -> torch.Tensor:
        # NOTE(invariance): one program per row, the same reduction order as a [1, n] launch.
        return self.rows.log_softmax(rows)

    def softmax(self, row: torch.Tensor) -> torch.Tensor:
        return self.rows.softmax(row)

    def cumsum(self, row: torch.Tensor) -> torch.Tensor:
        return self.rows.cumsum(row)

    def draw_ids(
        self, logits: torch.Tensor, temperatures: list[float], seeds: list[int], positions: list[int]
    ) -> torch.Tensor | None:
        # a GPU's element-wise kernels compute each element alike wherever it sits; the interpreter on the CPU
        # runs PyTorch's CPU kernels (see RowMath.draw_rows), so it keeps the one-row path
        return draw_ids(logits, temperatures, seeds, positions, self) if logits.is_cuda else None


class CompiledRowMath(RowMath):
    """The log-softmax of the compiled CPU kernels (``layers/cpu_kernels``): every row of a step in one call,
    each reduced alone in one fixed order, so a row's bits are those of the one-row call."""

    def __init__(self, kernels: CpuKernels) -> None:
        self.kernels = kernels

    def log_softmax(self, row: torch.Tensor) -> torch.Tensor:
        return self.log_softmax_rows(row)

    def log_softmax_rows(self, rows: torch.Tensor) -> torch.Tensor:
        if rows.dtype != torch.float32 or rows.device.type != "cpu":
            return super().log_softmax_rows(rows)
        return self.kernels.log_softmax(rows if rows.stride(-1) == 1 else rows.contiguous())

    def draw(self, row: torch.Tensor, params: SamplingParams, seed: int, position: int) -> int:
        # NOTE(invariance): which kernel draws is a function of the request's own parameters, never of the step
        if not batchable(params) or row.dtype != torch.float32:
            return super().draw(row, params, seed, position)
        return self.kernels.draw(row.view(1, -1), [params.temperature], [draw_key(seed, position)])[0]

    def draw_ids(
        self, logits: torch.Tensor, temperatures: list[float], seeds: list[int], positions: list[int]
    ) -> torch.Tensor | None:
        if logits.dtype != torch.float32:
            return None
        keys = [draw_key(seed, pos) for seed, pos in zip(seeds, positions, strict=True)]
        rows = logits if logits.stride(-1) == 1 else logits.contiguous()
        return torch.tensor(self.kernels.draw(rows, temperatures, keys), dtype=torch.long)


def row_math_for(device: str, kernels: CpuKernels | None = None) -> RowMath:
    """The sampler's row reductions for a device (``"cpu"``: PyTorch, or the compiled kernels when the
    engine computes with them; ``"cuda"``: Triton, which on a CPU means Triton's interpreter)."""
    if device == "cuda":
        return TritonRowMath()
    return CompiledRowMath(kernels) if kernels is not None else RowMath()


def batchable(params: SamplingParams) -> bool:
    """Seeded sampling with temperature only (no grammar mask): :func:`draw_rows` draws it for many rows at once."""
    return not params.greedy and params.top_k <= 0 and params.top_p >= 1.0 and params.structured_outputs is None


def draw_rows(
    logits: torch.Tensor, temperatures: list[float], seeds: list[int], positions: list[int], math: RowMath
) -> list[int]:
    """:func:`draw_ids`, read to the host."""
    return draw_ids(logits, temperatures, seeds, positions, math).tolist()


def draw_ids(
    logits: torch.Tensor, temperatures: list[float], seeds: list[int], positions: list[int], math: RowMath
) -> torch.Tensor:
    """Seeded draws for rows of ``[R, vocab]`` at once: per row exactly ``draw_from(sampling_probs(...))``.

    NOTE(invariance): the same per-element operations as the one-row path - division by the float32
    temperature, the row-wise softmax (one program per row on a GPU), the counter hash of
    ``(seed, position, id)``, ``-log(u)`` and the exact maximum with ties to the lowest id - on a
    GPU, whose element-wise kernels compute each element by the same function wherever it sits.
    (On the CPU the engine keeps the one-row path: SIMD bodies and scalar tails may differ there.)
    """
    temps = upload(temperatures, logits.dtype, logits.device)[:, None]
    probs = math.softmax(logits / temps)
    keys = [signed64(draw_key(seed, pos)) for seed, pos in zip(seeds, positions, strict=True)]
    key = upload(keys, torch.int64, logits.device)[:, None]
    if probs.is_cuda and probs.dtype == torch.float32:
        from kvwarden.layers.kernels.draw import draw_tokens  # Triton: GPU only

        return draw_tokens(probs, key.view(-1))  # the same bits, without [rows, vocab] temporaries
    noise = noise_from_keys(key, logits.shape[1], logits.device)
    ratio = probs.double() / noise
    best = ratio == ratio.amax(dim=-1, keepdim=True)
    return best.to(torch.int8).argmax(dim=-1)  # the first (lowest) id reaching the maximum


def sampling_probs(logits: torch.Tensor, params: SamplingParams, math: RowMath) -> torch.Tensor:
    """The distribution a seeded request samples from: temperature, then top-k, then top-p."""
    # A float32 divisor, as draw_rows uses: the same rounding of the temperature on every path.
    scaled = logits / torch.tensor(params.temperature, dtype=logits.dtype, device=logits.device)
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
