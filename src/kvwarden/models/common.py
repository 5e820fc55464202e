"""Types shared by the model blocks: the step's inputs and weight lookup."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from kvwarden.cache.state_pool import StatePool
from kvwarden.layers.attention import AttentionPlan
from kvwarden.layers.recurrent_plan import RecurrentMeta
from kvwarden.models.config import ModelConfig
from kvwarden.models.quant import BlockFp8, as_tensor, cat_rows, stack

# A layer's weight: a tensor, or FP8 blocks that a block_fp8 backend's GEMMs dequantize per tile.
Weight = torch.Tensor | BlockFp8
WeightGetter = Callable[[str], Any]


class TraceSink(Protocol):
    """Receives activations when a step is traced (see :mod:`kvwarden.probe.tracer`)."""

    def record(self, name: str, rows: torch.Tensor, seqs: Any) -> None: ...

    def record_context(self, name: str, request_id: str, rows: torch.Tensor) -> None: ...

    def record_at(self, name: str, request_id: str, pos: int, value: torch.Tensor) -> None: ...


@dataclass(frozen=True)
class SeqSlice:
    """One request's rows in the step: positions ``[start, start + num_tokens)``."""

    request_id: str
    row_start: int
    num_tokens: int
    start: int


@dataclass
class ForwardBatch:
    """Inputs of one model step (built by the model runner).

    Attributes:
        input_ids: ``[rows]`` tokens of every request's chunk, concatenated.
        positions: ``[rows]`` absolute position of each token in its request.
        slot_mapping: ``[rows]`` flat KV-cache slot each token's K/V is written to.
        plan: attention tiling for the step.
        seqs: the requests in the batch, in row order.
        states: recurrent working states (hybrid models).
        block_size: KV block size (recurrent states are captured at block boundaries).
        scan_chunk: the canonical scan's chunk size (divides ``block_size``).
        tracer: when set, hooked activations of the step are recorded into it.
        recurrent: the batched recurrent kernels' addressing (GPU backends), else None (per-request walk).
        token_states: in a verify graph, each recurrent layer appends ``(conv inputs, scan states)`` of
            every token (:func:`kvwarden.models.recurrent_batched.keep_token_states`); else None.
        dsa_selection: sparse attention's ``(cache slots [rows, k], visible [rows, k])`` from the step's last
            full indexer layer (``models/mla_block.py``); the layers that share it read it.
        dsa_keys: on the GPU backends, every query's key table ``(slots [requests, context], request of
            each row [rows])``, built once per step by the first full indexer layer.
        dsa_rope: ``(cos, sin)``: the rotary table's rows of the step's positions in the model's dtype,
            gathered once per step by the first MLA layer and read by the others.
        kv_exchange: under context parallelism, called by every attention layer between writing its rows'
            K/V and reading the cache: the other ranks' rows of the step land in this rank's cache.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    plan: AttentionPlan
    seqs: list[SeqSlice] = field(default_factory=list)
    states: StatePool | None = None
    block_size: int = 16
    scan_chunk: int = 16
    tracer: TraceSink | None = None
    recurrent: RecurrentMeta | None = None
    token_states: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    # DSA (GLM-5): the last full indexer layer's selection, read by the shared layers after it
    dsa_selection: tuple[torch.Tensor, torch.Tensor] | None = None
    dsa_keys: tuple[torch.Tensor, torch.Tensor] | None = None
    dsa_rope: tuple[torch.Tensor, torch.Tensor] | None = None
    kv_exchange: Callable[[tuple[torch.Tensor, torch.Tensor]], None] | None = None

    def exchange_kv(self, kv: tuple[torch.Tensor, torch.Tensor]) -> None:
        """The step's other rows' K/V into this rank's cache (context parallelism; else nothing)."""
        if self.kv_exchange is not None:
            self.kv_exchange(kv)

    def trace(self, name: str, rows: torch.Tensor) -> None:
        if self.tracer is not None:
            self.tracer.record(name, rows, self.seqs)


def fuse(weights: list[Weight], biases: list[torch.Tensor | None]) -> tuple[Weight, torch.Tensor | None]:
    """Projections of one input stacked into one weight (and bias: zeros where a part has none). FP8 weights
    stay FP8 when every part ends on a block boundary (``quant.cat_rows``), else all are dequantized."""
    fused: Weight | None = None
    if all(isinstance(w, BlockFp8) for w in weights):
        fused = cat_rows(weights)  # type: ignore[arg-type]
    if fused is None:
        fused = torch.cat([as_tensor(w) for w in weights], dim=0)
    if all(b is None for b in biases):
        return fused, None
    like = next(b for b in biases if b is not None)
    parts = [b if b is not None else like.new_zeros(w.shape[0]) for w, b in zip(weights, biases, strict=True)]
    return fused, torch.cat(parts)


def stack_experts(weights: list[Weight]) -> Weight:
    """Experts' weights stacked ``[E, N, K]``: FP8 when every one is (``quant.stack``), else dense."""
    if all(isinstance(w, BlockFp8) for w in weights):
        return stack(weights)  # type: ignore[arg-type]
    return torch.stack([as_tensor(w) for w in weights])


def require(get: WeightGetter, name: str) -> torch.Tensor:
    tensor = get(name)
    if tensor is None:
        raise ValueError(f"checkpoint: missing tensor {name!r}")
    return tensor


def norm_weight(cfg: ModelConfig, get: WeightGetter, name: str) -> torch.Tensor:
    """RMSNorm weight as applied: Qwen3-Next stores ``w`` and scales by ``1 + w``.

    Qwen3-Next's norm multiplies in float32 and rounds once (``(x * (1 + w)).to(dtype)``, where
    Llama rounds the normalised row first): its weight stays float32, which ``rms_norm`` reads as
    that convention.
    """
    w = require(get, name)
    return 1.0 + w.float() if cfg.norm_offset else w
