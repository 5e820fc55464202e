"""How much the engine may hold: the KV pool's bytes (and the recurrent-state snapshots that live with its
blocks), and the longest context it serves."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from kvwarden.cache.state_pool import StatePool
from kvwarden.cache.state_spec import RecurrentLayerSpec, ring_bytes, scan_scratch_bytes
from kvwarden.config import EngineConfig
from kvwarden.engine.model_runner import kv_bytes_per_block
from kvwarden.models.config import ModelConfig

if TYPE_CHECKING:
    from kvwarden.models.decoder import DecoderModel

log = logging.getLogger(__name__)

GRID_CHUNKS = (16, 32, 64)  # kernels/recurrent_grid.CHUNKS (Triton is not imported on the CPU)


def context_limit(max_model_len: int | None, cfg: ModelConfig) -> int:
    """The longest context served: ``max_model_len`` (default: the model's), never past what the model
    supports, nor past its sliding window.

    Raises:
        ValueError: naming ``max_model_len`` when it asks for more than the model's positions or a sliding
            window (as vLLM refuses it: a silently shorter context would cut requests the user sized for it).
    """
    if max_model_len is not None and max_model_len > cfg.max_position_embeddings:
        raise ValueError(
            f"max_model_len: {max_model_len} is more than the model supports (max_position_embeddings "
            f"{cfg.max_position_embeddings}); leave it out to serve the model's own length"
        )
    limit = min(max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
    window = cfg.sliding_window
    if window is None or limit <= window:
        return limit
    # NOTE: with every sequence within the window, full causal attention is exactly the sliding one;
    # kvwarden has no sliding-window kernel, so longer contexts are refused rather than served wrongly.
    if max_model_len:
        raise ValueError(
            f"max_model_len: {max_model_len} exceeds the model's sliding_window ({window}); kvwarden "
            f"serves sliding-window models up to the window, where attention is exact: use {window} or less"
        )
    log.info("max_model_len: %d (the model's sliding_window; longer contexts are refused)", window)
    return window


def check_scan_chunk(
    specs: list[RecurrentLayerSpec], scan_mode: str, block_size: int, chunk: int, step_tokens: int, drafts: int
) -> None:
    """A chunked scan needs every block boundary on its grid (the prefix cache saves states there); the GPU's
    chunked scan needs a chunk its tensor-core dots take, at most ``65,535`` grid chunks per request in a step
    (a launch grid's limit), and verify steps of at most ``chunk`` rows: the return to a kept token reads the
    pending rows before it from the ring, which keeps a step's last ``chunk`` rows only.

    Raises:
        ValueError: naming ``block_size``, ``numerics.scan_chunk``, ``max_num_batched_tokens`` or
            ``num_speculative_tokens``.
    """
    if not specs or scan_mode not in ("chunked", "grid"):
        return
    if scan_mode == "grid":
        if chunk not in GRID_CHUNKS:
            raise ValueError(
                f"numerics.scan_chunk: {chunk} is not a chunk of the GPU's chunked scan; use one of {GRID_CHUNKS}"
            )
        if step_tokens // chunk + 2 > 65535:
            raise ValueError(
                f"max_num_batched_tokens: {step_tokens} is more than the chunked scan takes in one step "
                f"({(65535 - 2) * chunk} with chunks of {chunk})"
            )
        if drafts + 1 > chunk:
            raise ValueError(
                f"num_speculative_tokens: {drafts} drafts make verify steps of {drafts + 1} rows; the chunked "
                f"recurrent scan returns to a kept token only within {chunk} rows: use at most {chunk - 1} "
                "drafts, or recurrent_scan='token'"
            )
    if block_size % chunk:
        raise ValueError(
            f"block_size: {block_size} must be a multiple of the recurrent scan chunk "
            f"({chunk}) so every block boundary is a scan grid point"
        )


def num_cache_blocks(
    config: EngineConfig, device: str, cfg: ModelConfig, model: DecoderModel, mtp_weight_bytes: int = 0
) -> int:
    """Blocks of the KV pool that :func:`cache_budget` holds, at what one block costs in every cache.

    ``mtp_weight_bytes``: the MTP head's weights, which MTP speculation moves to the device after the pool is
    sized (GLM-5's head is a whole routed-expert layer): held back from a GPU budget."""
    specs = model.recurrent_specs()
    block_size = config.cache.block_size
    # A recurrent-state snapshot lives with its block: count it in the per-block budget.
    kv_block = kv_bytes_per_block(model, block_size)
    par = config.parallel
    if par.layer_split:  # each rank stores every n-th layer: the busiest rank's share sets the pool
        layers = max(model.num_attention_layers, 1)
        kv_block = kv_block * -(-layers // par.context_parallel_size) // layers
    per_block = kv_block + (StatePool.snapshot_bytes(specs) if specs else 0)
    if config.speculative is not None and config.speculative.method == "mtp":
        # NOTE: the MTP head's attention layer has a KV cache with the pool's slots (spec/mtp.py): count it,
        # or a GPU pool sized to gpu_memory_utilization leaves no room for it (seen on an H200: OOM).
        per_block += kv_bytes_per_block(model, block_size) // max(model.num_attention_layers, 1)
    budget = cache_budget(config, device, cfg, specs)
    if device == "cuda" and config.speculative is not None and config.speculative.method == "mtp":
        budget -= mtp_weight_bytes
    return max(2, budget // per_block)


def cache_budget(config: EngineConfig, device: str, cfg: ModelConfig, specs: list[RecurrentLayerSpec]) -> int:
    """Bytes for the KV pool.

    On the CPU: ``memory_bytes``. On a GPU, as vLLM does: the share
    ``gpu_memory_utilization`` of the device's memory, minus what is in use
    now (weights, other processes), minus the working states of
    ``max_num_seqs`` requests (twice: speculation checkpoints them) and an
    estimate of one step's activations.

    Raises:
        ValueError: naming ``gpu_memory_utilization`` when nothing is left.
    """
    if device != "cuda":
        return config.cache.memory_bytes
    import gc

    import torch

    gc.collect()  # an engine dropped just before this one still holds its pool in the allocator's cache
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    sched = config.scheduler
    working = sched.max_num_seqs * StatePool.snapshot_bytes(specs) * 2 if specs else 0
    chunk = config.numerics.scan_chunk
    numerics = config.numerics
    if specs and numerics.mode == "canonical" and numerics.recurrent_scan == "chunked":  # its rings, its scratch
        working += (sched.max_num_seqs + 1) * ring_bytes(specs, chunk)
        working += scan_scratch_bytes(specs, chunk, sched.max_num_batched_tokens, sched.max_num_seqs)
    width = max(cfg.hidden_size, cfg.intermediate_size, 1)
    # per token of the step: a few hidden-sized float32 buffers plus the widest projection, and the
    # sampled rows' float32 logits; doubled for allocator slack
    activations = 2 * sched.max_num_batched_tokens * 4 * (8 * cfg.hidden_size + 4 * width)
    activations += 2 * sched.max_num_seqs * 4 * cfg.vocab_size
    if cfg.mla is not None:  # sparse attention: a step's float32 index scores, one row per token over its context
        # (and the top-k's working rows beside them), at most the step's tokens x the longest context served
        activations += 2 * sched.max_num_batched_tokens * 4 * context_limit(config.max_model_len, cfg)
        # the top-k's list of up to 2 x index_topk int32 columns a row (layers/kernels/topk.py)
        activations += sched.max_num_batched_tokens * 4 * 2 * cfg.mla.index_topk
    from kvwarden.layers.kernels.attention import PARALLEL_MAX_BYTES  # Triton: CUDA only

    activations += PARALLEL_MAX_BYTES  # attention's split states (a long context's decode, in or out of graphs)
    budget = int(total * config.cache.gpu_memory_utilization) - (total - free) - working - activations
    if budget <= 0:
        raise ValueError(
            f"gpu_memory_utilization: {config.cache.gpu_memory_utilization} leaves no memory for the KV "
            f"cache ({(total - free) / 2**30:.1f} GiB in use of {total / 2**30:.1f} GiB)"
        )
    return budget
