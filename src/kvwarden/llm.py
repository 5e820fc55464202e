"""``LLM``: the offline Python API (batched ``generate`` over the stepping engine)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from rich.progress import Progress

from kvwarden.config import (
    CacheConfig,
    EngineConfig,
    NumericsConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    scheduler_limits,
)
from kvwarden.engine.llm_engine import LLMEngine
from kvwarden.engine.outputs import RequestOutput
from kvwarden.engine.prompt_ids import Prompt
from kvwarden.engine.sampling_params import SamplingParams


class LLM:
    """Load a model once and generate for batches of prompts.

    Requests in one :meth:`generate` call run concurrently (continuously batched);
    successive calls share the prefix cache.

    Args:
        model: a Hugging Face directory, a ``.gguf`` file, ``"smollm2"`` or
            ``"builtin:<arch>-<preset>"``.
        dtype: ``"float32"`` or ``"bfloat16"``.
        load_format: ``"auto"`` (the folder's safetensors, FP8 block-quantized ones included) or ``"dummy"``
            (seeded random weights of ``config.json``'s shapes, drawn on the device: a benchmark of a
            model's real size without its checkpoint; ``seed`` seeds them).
        block_size: tokens per KV block.
        enable_prefix_caching: reuse full blocks across requests.
        max_num_batched_tokens: token budget per engine step (default: 512 on the CPU, 8,192 on a GPU).
        max_num_seqs: most concurrent requests (default: 32 on the CPU, 256 on a GPU).
        num_blocks / kv_cache_memory: KV pool size (blocks, or bytes to derive it).
        max_model_len: cap on prompt + output length.
        numerics: ``"canonical"`` (invariant) or ``"shape-dependent"`` (vendor-style).
        chunking: ``"kvwarden"`` or a legacy hybrid rule.
        speculative_config: vLLM's dict, e.g. ``{"method": "ngram",
            "num_speculative_tokens": 3}``; methods ``"mtp"``, ``"draft"`` (with
            ``"model"``), ``"ngram"`` (``"prompt_lookup_min"`` / ``"prompt_lookup_max"``);
            ``"acceptance": "rejection"`` trades invariance for acceptance.
            ``None`` (default): no speculation.
        seed: seeds the per-request seeds of unseeded sampling requests.
        device: ``"auto"`` (the GPU when PyTorch sees one, else the CPU),
            ``"cpu"`` or ``"cuda"``.
        gpu_memory_utilization: on a GPU, the share of its memory the engine may
            use; the KV pool gets what weights and activations leave (vLLM's knob).
            ``num_blocks`` overrides it; on the CPU ``kv_cache_memory`` applies.
        kernels: ``"auto"`` (Triton on a GPU; on the CPU the compiled kernels,
            built once per machine, or PyTorch's with a logged reason when they
            cannot be built), ``"compiled"`` (the CPU's compiled kernels or a
            ``ValueError`` saying why not), ``"torch"`` (the CPU's PyTorch
            kernels), or ``"triton"`` to run the GPU kernels on the CPU under
            Triton's interpreter (``TRITON_INTERPRET=1``; slow, for tests).
        host_cache_bytes: the host tier (0 = off): blocks evicted from the device
            pool are written back to this much host memory (pinned on a GPU) and
            loaded back layer by layer on a prefix hit, with the same logits.
        unsafe_host_load: testing only: read host-loaded blocks without waiting
            for their copy (re-creates a known race; changes the logits).
        unsafe_indexer_load: testing only: sparse attention's indexer reads its
            host-loaded keys without waiting (the latent KV still waits): the
            race of GLM-5's host-cache incident, on the indexer alone.
        unsafe_topk: testing only: sparse attention (GLM-5) selects keys as the
            kernel of a known incident did (bfloat16 scores, ties in partition
            arrival order; the answer then depends on the batch).
        enforce_eager: run every step eagerly; by default a GPU replays pure
            decode steps from CUDA graphs (same logits, less host time).
        cuda_graphs: ``"auto"`` / ``"off"`` / ``"emulate"`` (tests; see
            ``EngineConfig``); ``enforce_eager=True`` means ``"off"``.
        async_scheduling: launch the next decode step before the host reads
            this one's tokens (graph-replayed steps whose tokens are chosen on
            the device; see ``engine/overlap.py``); the same logits either way.
        context_parallel_size: processes of this host a long step's rows are
            split across (workers started here, stopped by :meth:`close`; CPU
            only so far); with canonical numerics the logits are bitwise those
            of one rank. Attention-only models.
        context_parallel_min_tokens: the shortest step that is split; shorter
            ones run on this process and their K/V is copied to the workers.
        layer_split: each rank stores only every n-th attention layer's cache
            (n times the prefix-cache capacity); a layer's owner broadcasts
            the step's context before its attention, the next layer prefetched.
        unsafe_layer_split: testing only: read the broadcast buffer without
            waiting for the broadcast (a race; changes the logits).
        layer_split_delay_ms: testing only: each layer broadcast starts this late.
        tensor_parallel_size: processes of this host each holding a share of every layer (heads, MLP
            columns, vocabulary; workers started here, stopped by :meth:`close`; CPU only so far); the
            logits are bitwise those of one rank. Dense and MoE attention models.
        enable_expert_parallel: with ``tensor_parallel_size``: a MoE model's experts sharded whole across
            the ranks (required for MoE models).

    Use it as a context manager (or call :meth:`close`) when it starts workers.
    """

    def __init__(
        self,
        model: str,
        dtype: str = "float32",
        load_format: str = "auto",
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        max_num_batched_tokens: int | None = None,
        max_num_seqs: int | None = None,
        num_blocks: int | None = None,
        kv_cache_memory: int = 512 * 1024 * 1024,
        max_model_len: int | None = None,
        numerics: str = "canonical",
        chunking: str = "kvwarden",
        speculative_config: dict | None = None,
        seed: int = 0,
        device: str = "auto",
        gpu_memory_utilization: float = 0.9,
        kernels: str = "auto",
        host_cache_bytes: int = 0,
        unsafe_host_load: bool = False,
        unsafe_indexer_load: bool = False,
        unsafe_topk: bool = False,
        recurrent_scan: str = "token",
        enforce_eager: bool = False,
        cuda_graphs: str = "auto",
        async_scheduling: bool = True,
        context_parallel_size: int = 1,
        context_parallel_min_tokens: int = 256,
        layer_split: bool = False,
        unsafe_layer_split: bool = False,
        layer_split_delay_ms: float = 0.0,
        tensor_parallel_size: int = 1,
        enable_expert_parallel: bool = False,
    ) -> None:
        max_num_batched_tokens, max_num_seqs = scheduler_limits(device, max_num_batched_tokens, max_num_seqs)
        config = EngineConfig(
            model=model,
            dtype=dtype,  # type: ignore[arg-type]
            load_format=load_format,
            max_model_len=max_model_len,
            seed=seed,
            device=device,
            cache=CacheConfig(
                block_size=block_size,
                num_blocks=num_blocks,
                memory_bytes=kv_cache_memory,
                enable_prefix_caching=enable_prefix_caching,
                gpu_memory_utilization=gpu_memory_utilization,
                host_cache_bytes=host_cache_bytes,
                unsafe_host_load=unsafe_host_load,
                unsafe_indexer_load=unsafe_indexer_load,
            ),
            scheduler=SchedulerConfig(
                max_num_batched_tokens=max_num_batched_tokens,
                max_num_seqs=max_num_seqs,
                chunking=chunking,  # type: ignore[arg-type]
                async_scheduling=async_scheduling,
            ),
            numerics=NumericsConfig(
                mode=numerics,  # type: ignore[arg-type]
                kernels=kernels,
                recurrent_scan=recurrent_scan,
                unsafe_topk=unsafe_topk,
            ),
            speculative=SpeculativeConfig.from_dict(speculative_config),
            cuda_graphs="off" if enforce_eager else cuda_graphs,
            parallel=ParallelConfig(
                context_parallel_size,
                context_parallel_min_tokens,
                layer_split,
                unsafe_layer_split,
                layer_split_delay_ms,
                tensor_parallel_size,
                enable_expert_parallel,
            ),
        )
        self.engine = LLMEngine(config)

    def close(self) -> None:
        """Stop the context-parallel workers, if any (idempotent; also done at interpreter exit)."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        cache_salt: str | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in prompt order.

        Raises:
            ValueError: for a bad prompt or parameter; nothing is queued then.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        if params is None or isinstance(params, SamplingParams):
            per_prompt = [params or SamplingParams()] * len(prompts)
        else:
            per_prompt = list(params)
            if len(per_prompt) != len(prompts):
                raise ValueError(f"params: {len(per_prompt)} given for {len(prompts)} prompts")
        for p in prompts:  # validate all before queueing any
            self.engine.tokenize(p)
        ids = [
            self.engine.add_request(p, sp, cache_salt=cache_salt, final_only=True)
            for p, sp in zip(prompts, per_prompt, strict=True)
        ]
        pending = set(ids)
        done: dict[str, RequestOutput] = {}
        with Progress(disable=not use_tqdm, transient=True) as progress:
            task = progress.add_task("generating", total=len(ids))
            while pending:
                for out in self.engine.step():
                    if out.finished and out.request_id in pending:
                        pending.discard(out.request_id)
                        done[out.request_id] = out
                        progress.advance(task)
        return [done[i] for i in ids]

    def score(self, prompt: Prompt) -> torch.Tensor:
        """Float32 logits ``[len(prompt), vocab]`` at every prompt position.

        Computed through the normal engine path (chunked under the token budget,
        batched with whatever else is queued), never from the prefix cache.
        """
        rid = self.engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0), capture_logits=True)
        while True:
            for out in self.engine.step():
                if out.request_id == rid and out.finished:
                    assert out.prompt_logits is not None
                    return out.prompt_logits
