"""Parallel configuration: context parallelism, its layer split, tensor and expert parallelism.

Part of the engine's layered configuration (:mod:`kvwarden.config` re-exports it); frozen, checked on
construction, errors naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ParallelConfig:
    """Context parallelism: one step's rows split over several processes of one host.

    Attributes:
        context_parallel_size: ranks (processes of this host, gloo on loopback; CPU only so far). Rank 0 is
            the engine's own process (scheduler, sampler, server); ranks 1.. are workers that hold a copy of
            the weights and of the KV cache and compute their share of a long step's rows.
        context_parallel_min_tokens: steps with at least this many rows are split across the ranks; a
            shorter step (decode, a short chunk) runs on rank 0 alone and its new K/V rows are then
            copied to the other ranks, so every rank's cache stays a full copy.
        layer_split: each rank stores only every ``context_parallel_size``-th attention layer's cache (so
            the pool holds that many times the tokens); a layer's owner broadcasts the step's context of
            it before its attention, the next layer's prefetched while the current one computes. Every
            step then runs on all ranks (a short one with its rows on rank 0).
        unsafe_layer_split: TESTING ONLY: read a layer's broadcast buffer without waiting for the
            broadcast (the race an engine without the wait has; other logits).
        layer_split_delay_ms: TESTING ONLY: each broadcast starts this late (with the unsafe switch,
            the race then shows on every step).
        tensor_parallel_size: ranks (processes of this host, gloo; CPU only so far) each holding a share of
            every layer's weights and KV heads, every step run on all of them; the answer is bitwise that of
            one rank (``models/tensor_shard.py`` says why). Rank 0 samples.
        enable_expert_parallel: MoE layers sharded by whole experts across the tensor-parallel ranks
            (required for MoE models there).
    """

    context_parallel_size: int = 1
    context_parallel_min_tokens: int = 256
    layer_split: bool = False
    unsafe_layer_split: bool = False
    layer_split_delay_ms: float = 0.0
    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False

    def __post_init__(self) -> None:
        t = self.tensor_parallel_size
        if isinstance(t, bool) or not isinstance(t, int) or t < 1:
            raise ValueError(f"tensor_parallel_size: must be an integer >= 1, got {t!r}")
        if self.enable_expert_parallel and t < 2:
            raise ValueError("enable_expert_parallel: needs tensor_parallel_size >= 2 (experts are shared among ranks)")
        n = self.context_parallel_size
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"context_parallel_size: must be an integer >= 1, got {n!r}")
        m = self.context_parallel_min_tokens
        if isinstance(m, bool) or not isinstance(m, int) or m < n:
            raise ValueError(
                f"context_parallel_min_tokens: must be an integer >= context_parallel_size ({n}) so every rank "
                f"has rows, got {m!r}"
            )
        if self.layer_split and n < 2:
            raise ValueError("layer_split: needs context_parallel_size >= 2 (the layers are shared among the ranks)")
        if (self.unsafe_layer_split or self.layer_split_delay_ms) and not self.layer_split:
            raise ValueError("unsafe_layer_split / layer_split_delay_ms: need layer_split")
        if self.layer_split_delay_ms < 0:
            raise ValueError(f"layer_split_delay_ms: must be >= 0, got {self.layer_split_delay_ms}")

    @property
    def enabled(self) -> bool:
        """Context parallelism (tensor parallelism has its own: :attr:`tensor_parallel`)."""
        return self.context_parallel_size > 1

    @property
    def tensor_parallel(self) -> bool:
        return self.tensor_parallel_size > 1
