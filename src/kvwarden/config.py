"""Engine configuration: frozen, layered dataclasses passed explicitly to every part.

The layers are:

* :class:`NumericsConfig` - how kernels reduce (the invariance contract lives here).
* :class:`CacheConfig` - paged KV cache and prefix cache.
* :class:`SchedulerConfig` - batching, chunked prefill, chunking rule.
* :class:`SpeculativeConfig` - speculative decoding (proposer, draft length, acceptance).
* :class:`ParallelConfig` - context, tensor and expert parallelism (in :mod:`kvwarden.config_parallel`).
* :class:`EngineConfig` - the above plus model directory, dtype and seed.

No part of kvwarden reads configuration from globals or environment variables.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from kvwarden.config_parallel import ParallelConfig

NumericsMode = Literal["canonical", "shape-dependent"]
ChunkingRule = Literal["kvwarden", "legacy-align", "legacy-align-fixed"]
DType = Literal["float32", "bfloat16"]

__all__ = [
    "CacheConfig",
    "EngineConfig",
    "NumericsConfig",
    "ParallelConfig",
    "SchedulerConfig",
    "SpeculativeConfig",
]

NUMERICS_MODES: tuple[str, ...] = ("canonical", "shape-dependent")
DEVICES: tuple[str, ...] = ("auto", "cpu", "cuda")
CHUNKING_RULES: tuple[str, ...] = ("kvwarden", "legacy-align", "legacy-align-fixed")
DTYPES: tuple[str, ...] = ("float32", "bfloat16")
LOAD_FORMATS: tuple[str, ...] = ("auto", "safetensors", "dummy")
CUDA_GRAPH_MODES: tuple[str, ...] = ("auto", "off", "emulate")
KERNEL_SOURCES: tuple[str, ...] = ("auto", "compiled", "torch", "triton")


@dataclass(frozen=True)
class NumericsConfig:
    """How the model's reductions are ordered.

    Attributes:
        mode: ``"canonical"`` makes every number a function of absolute token
            positions only (kvwarden's contract). ``"shape-dependent"`` calls the
            library kernels on whatever shape the scheduler produced, as vendor
            engines do: faster, but results depend on batch and chunk shape.
        row_tile: canonical GEMMs see a multiple of this many rows (zero
            padded; a multiple of 4, the BLAS library's row group), and long-row
            reductions run on tiles of exactly this many rows.
        key_tile: keys per ``P @ V`` tile of the canonical CPU attention; tiles
            are aligned to absolute key position 0 and summed in a fixed tree, so
            the reduction over keys never depends on the chunk. Prefill queries
            are cut into tiles of as many positions.
        pointwise_chunk: the longest row (elements) a canonical row-wise op
            (norm, log-softmax) takes in one call; torch splits a lone longer
            row across threads, so longer rows run on tiles of ``row_tile``
            rows. (Element-wise kernels pad to SIMD blocks on their own.)
        scan_chunk: tokens per chunk of the canonical recurrent scan (gated delta
            rule, Mamba2 SSD); the grid is fixed to absolute positions and the
            block size must be a multiple of it.
        kernels: ``"auto"`` - the Triton kernels on a GPU; on the CPU the compiled
            kernels (:mod:`kvwarden.layers.cpu_kernels`, built once per machine)
            for canonical numerics, or PyTorch with a logged reason when they
            cannot be built; ``"compiled"`` - the CPU's compiled kernels or an
            error saying why not; ``"torch"`` - the CPU's PyTorch kernels;
            ``"triton"`` - the Triton kernels on the CPU too, which needs Triton's
            interpreter (``TRITON_INTERPRET=1``): how CI runs the GPU kernels
            through the whole engine without a GPU.
        recurrent_scan: the canonical GPU backend's recurrent scans (Qwen3-Next's gated delta rule, Mamba2's
            SSD). ``"token"`` (default) - token by token (the cheaper decode step); ``"chunked"`` - chunks of
            ``scan_chunk`` on the absolute position grid on tensor cores (faster prefill: long prompts; a
            decode step recomputes its chunk; the block size a multiple of the chunk). Both are invariant;
            their bits differ, so instances that share states (disaggregated serving) use the same one.
            The CPU's PyTorch path is always chunked and the fast path always token by token; the Triton
            kernels under the CPU interpreter (``kernels="triton"``) follow it.
        unsafe_topk: TESTING ONLY. Sparse attention's key selection (GLM-5's indexer) on bfloat16 scores
            with ties kept in the order parallel partitions happen to finish, as the kernel behind the
            seed incident hands out slots: the selection, and the answer, then depend on the step's
            shape. ``numerics="shape-dependent"`` always selects this way.
    """

    mode: NumericsMode = "canonical"
    row_tile: int = 16
    key_tile: int = 64
    pointwise_chunk: int = 16384
    scan_chunk: int = 16
    kernels: str = "auto"
    recurrent_scan: str = "token"
    unsafe_topk: bool = False

    def __post_init__(self) -> None:
        if self.mode not in NUMERICS_MODES:
            raise ValueError(f"numerics: unknown mode {self.mode!r}; expected one of {NUMERICS_MODES}")
        for name in ("row_tile", "key_tile", "pointwise_chunk", "scan_chunk"):
            if getattr(self, name) < 1:
                raise ValueError(f"numerics.{name} must be >= 1")
        if self.row_tile % 4:
            raise ValueError("numerics.row_tile must be a multiple of 4 (GEMM rows come in groups of 4)")
        if self.pointwise_chunk > 32768:
            # torch splits a lone row longer than its parallel grain across threads
            raise ValueError("numerics.pointwise_chunk must be <= 32768 (torch's parallel grain)")
        if self.kernels not in KERNEL_SOURCES:
            raise ValueError(f"numerics.kernels: unknown {self.kernels!r}; expected one of {KERNEL_SOURCES}")
        if self.kernels == "compiled" and self.mode != "canonical":
            raise ValueError("numerics.kernels: 'compiled' is canonical numerics' CPU backend, not shape-dependent's")
        if self.recurrent_scan not in ("chunked", "token"):
            raise ValueError(f"numerics.recurrent_scan: unknown {self.recurrent_scan!r}; expected 'chunked' or 'token'")


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache.

    Attributes:
        block_size: tokens per KV block (and per prefix-cache entry).
        num_blocks: blocks in the pool; ``None`` derives it from ``memory_bytes``.
        memory_bytes: KV memory budget used when ``num_blocks`` is ``None``.
        enable_prefix_caching: reuse full blocks across requests by content hash.
        gpu_memory_utilization: on a GPU, the share of the device's memory the
            engine may use in all (weights, activations, KV pool); the KV pool
            (and recurrent-state pool) gets what is left, as in vLLM. Ignored
            when ``num_blocks`` is given, and on the CPU (``memory_bytes``).
        host_cache_bytes: the host tier: blocks evicted from the device pool
            are written back to this much host memory (pinned on a GPU) and
            loaded back layer by layer on a prefix hit; 0 turns it off.
        unsafe_host_load: testing only: read host-loaded blocks without waiting
            for their copy (the race of engines that forgot the wait).
        unsafe_indexer_load: testing only, sparse attention (GLM-5 / DeepSeek-V3.2):
            the indexer reads its host-loaded key cache without waiting for the
            copy while the latent KV still waits - the race of GLM-5's HiCache
            incident, where the indexer read its own cache before the load had
            landed (a wrong selection, then other logits).
    """

    block_size: int = 16
    num_blocks: int | None = None
    memory_bytes: int = 512 * 1024 * 1024
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.9
    host_cache_bytes: int = 0
    unsafe_host_load: bool = False
    unsafe_indexer_load: bool = False

    def __post_init__(self) -> None:
        if self.host_cache_bytes < 0:
            raise ValueError(f"host_cache_bytes must be >= 0, got {self.host_cache_bytes}")
        if self.unsafe_indexer_load and not self.host_cache_bytes:
            raise ValueError("unsafe_indexer_load: needs a host tier (host_cache_bytes > 0): it races its loads")
        if self.block_size < 1:
            raise ValueError("block_size must be >= 1")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ValueError("num_blocks must be >= 2")
        if self.memory_bytes < 1:
            raise ValueError("kv cache memory must be > 0 bytes")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching with chunked prefill.

    Attributes:
        max_num_batched_tokens: token budget of one engine step (all requests).
        max_num_seqs: most requests running at once.
        chunking: the rule that cuts prefill into chunks. ``"kvwarden"`` takes as
            much as the budget allows; the legacy rules re-create vLLM's
            hybrid align-mode scheduling (see ``docs/architecture.md``); their
            pull-back of one block follows from speculative decoding being on.
        async_scheduling: launch the next decode step before the host reads this
            step's tokens, where the step replays a CUDA graph and its tokens are
            chosen on the device (``engine/overlap.py``); the same numbers either way.
    """

    max_num_batched_tokens: int = 512
    max_num_seqs: int = 32
    chunking: ChunkingRule = "kvwarden"
    async_scheduling: bool = True

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.chunking not in CHUNKING_RULES:
            raise ValueError(f"chunking: unknown rule {self.chunking!r}; expected one of {CHUNKING_RULES}")


SPEC_METHODS: tuple[str, ...] = ("mtp", "draft", "ngram")
SPEC_ACCEPTANCE: tuple[str, ...] = ("match", "rejection")
SPEC_FIELDS: tuple[str, ...] = (
    "method",
    "num_speculative_tokens",
    "model",
    "prompt_lookup_min",
    "prompt_lookup_max",
    "acceptance",
)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, spelled as vLLM's ``speculative_config`` dict.

    Attributes:
        method: ``"mtp"`` (the checkpoint's multi-token-prediction head),
            ``"draft"`` (a separate small model, ``model``) or ``"ngram"``
            (prompt lookup over the request's own tokens).
        num_speculative_tokens: draft tokens proposed per step (k >= 1); the
            target scores the k + 1 positions in one step.
        model: the draft model (``method="draft"`` only): any name
            :func:`kvwarden.models.sources.resolve_model` accepts, sharing the
            target's tokenizer.
        prompt_lookup_min / prompt_lookup_max: n-gram lengths tried, longest first.
        acceptance: ``"match"`` (default; lossless and invariant: a draft token
            is accepted iff it equals the token the target chooses at that
            position, greedy or seeded, so the output equals speculation off bit
            for bit) or ``"rejection"`` (standard rejection sampling: more
            tokens accepted, the same distribution, but *not* the same tokens
            as speculation off; not invariant).
    """

    method: str
    num_speculative_tokens: int
    model: str | None = None
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 3
    acceptance: str = "match"

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ValueError(f"speculative_config.method: unknown {self.method!r}; expected one of {SPEC_METHODS}")
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"speculative_config.num_speculative_tokens: must be an integer >= 1, got {k!r}")
        if self.method == "draft" and not self.model:
            raise ValueError("speculative_config.model: method 'draft' needs the draft model (a path or name)")
        if self.method != "draft" and self.model is not None:
            raise ValueError(f"speculative_config.model: only method 'draft' takes a model, not {self.method!r}")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"speculative_config.{name}: must be an integer >= 1, got {v!r}")
        if lo > hi:
            raise ValueError(f"speculative_config.prompt_lookup_min: {lo} is larger than prompt_lookup_max {hi}")
        if self.acceptance not in SPEC_ACCEPTANCE:
            raise ValueError(
                f"speculative_config.acceptance: unknown {self.acceptance!r}; expected one of {SPEC_ACCEPTANCE}"
            )

    @classmethod
    def from_dict(cls, spec: object) -> SpeculativeConfig | None:
        """Parse vLLM's dict (``None`` or ``{}``: speculation off); errors name the field."""
        if spec is None or isinstance(spec, SpeculativeConfig):
            return spec  # type: ignore[return-value]
        if not isinstance(spec, dict):
            raise ValueError(f"speculative_config: expected a JSON object, got {type(spec).__name__}")
        if not spec:
            return None
        unknown = sorted(set(spec) - set(SPEC_FIELDS))
        if unknown:
            raise ValueError(f"speculative_config.{unknown[0]}: unknown field; known fields: {list(SPEC_FIELDS)}")
        for name in ("method", "num_speculative_tokens"):
            if name not in spec:
                raise ValueError(f"speculative_config.{name}: required")
        return cls(**spec)


@dataclass(frozen=True)
class EngineConfig:
    """Everything an engine needs; built once by :class:`kvwarden.LLM`.

    ``device``: ``"cpu"``, ``"cuda"`` (the first GPU), or ``"auto"`` (the GPU when
    there is one, else the CPU); see :func:`resolve_device`.

    ``cuda_graphs``: ``"auto"`` replays pure decode steps from CUDA graphs on a
    GPU when the model allows it (see :mod:`kvwarden.engine.cuda_graphs`);
    ``"off"`` runs every step eagerly (vLLM's ``enforce_eager``); ``"emulate"``
    runs the graphs' padded static-buffer step without capturing (tests of it
    on the CPU, with the Triton kernels under the interpreter).
    """

    model: str
    dtype: DType = "float32"
    load_format: str = "auto"  # "dummy": seeded random weights of config.json's shapes (models/weight_source.py)
    max_model_len: int | None = None
    seed: int = 0
    device: str = "auto"
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    numerics: NumericsConfig = field(default_factory=NumericsConfig)
    speculative: SpeculativeConfig | None = None
    cuda_graphs: str = "auto"
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def __post_init__(self) -> None:
        if self.cuda_graphs not in CUDA_GRAPH_MODES:
            raise ValueError(f"cuda_graphs: unknown {self.cuda_graphs!r}; expected one of {CUDA_GRAPH_MODES}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: unknown {self.dtype!r}; expected one of {DTYPES}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format: unknown {self.load_format!r}; expected one of {LOAD_FORMATS}")
        if self.device not in DEVICES:
            raise ValueError(f"device: unknown {self.device!r}; expected one of {DEVICES}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError("max_model_len must be >= 1")


# Scheduler limits by device when a caller leaves them unset (LLM, the CLI): (token budget of a step, most
# running requests). The CPU's are this project's measured defaults for two cores; a GPU's follow vLLM's
# (8,192 batched tokens and 256 sequences): a 512-token budget there would cut every long prompt into
# 512-token steps, and 32 sequences would queue half of a concurrency-64 load. Neither changes an answer.
DEVICE_LIMITS: dict[str, tuple[int, int]] = {"cpu": (512, 32), "cuda": (8192, 256)}


def scheduler_limits(device: str, max_num_batched_tokens: int | None, max_num_seqs: int | None) -> tuple[int, int]:
    """``(max_num_batched_tokens, max_num_seqs)``: the given ones, the device's default for any left ``None``."""
    tokens, seqs = DEVICE_LIMITS[resolve_device(device)]
    return (
        tokens if max_num_batched_tokens is None else max_num_batched_tokens,
        seqs if max_num_seqs is None else max_num_seqs,
    )


def resolve_device(device: str) -> str:
    """``"cpu"`` or ``"cuda"`` for a configured device; a clear error when CUDA is asked for and absent."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: 'cuda' was requested but PyTorch sees no CUDA device (use --device cpu)")
    return device
