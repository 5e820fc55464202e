"""The flags every command that builds an engine shares, and the CLI's help format.

Kept apart from ``cli.py`` so that command modules import these without
importing the command line that imports them.
"""

from __future__ import annotations

import argparse

from kvwarden.config import CHUNKING_RULES, DEVICES, DTYPES, KERNEL_SOURCES, LOAD_FORMATS, NUMERICS_MODES


def add_engine_args(p: argparse.ArgumentParser, model: bool = True) -> None:
    """Flags shared by every command that builds an engine."""
    if model:
        p.add_argument("model", help="model dir, .gguf file, 'smollm2' or 'builtin:<arch>-<preset>'")
    p.add_argument("--dtype", choices=DTYPES, default="float32", help="weights and activations")
    p.add_argument(
        "--load-format",
        choices=LOAD_FORMATS,
        default="auto",
        help="auto: the folder's safetensors (FP8 block-quantized ones too); dummy: seeded random weights of "
        "config.json's shapes drawn on the device (benchmarks without the checkpoint; needs config.json and "
        "a tokenizer only)",
    )
    p.add_argument("--block-size", type=_positive, default=16, help="tokens per KV block and prefix-cache entry")
    p.add_argument(
        "--max-num-batched-tokens",
        type=_positive,
        default=None,
        help="token budget of one engine step, all requests (default: 512 on the CPU, 8192 on a GPU)",
    )
    p.add_argument(
        "--max-num-seqs", type=_positive, default=None, help="most requests running at once (default: 32 CPU, 256 GPU)"
    )
    p.add_argument(
        "--max-model-len", type=_positive, default=None, help="cap on prompt + output tokens (default: the model's)"
    )
    p.add_argument("--num-blocks", type=_positive, default=None, help="KV blocks in the pool (default: --kv-cache-mib)")
    p.add_argument("--kv-cache-mib", type=_positive, default=512, help="KV cache memory when --num-blocks is not given")
    p.add_argument("--no-prefix-caching", action="store_true", help="do not reuse cached blocks across requests")
    p.add_argument(
        "--host-cache-bytes",
        type=_bytes,
        default=0,
        metavar="N",
        help="host tier: blocks evicted from the device pool go to N bytes of host memory (0 = off; 4G, 512M ok)",
    )
    p.add_argument(
        "--unsafe-host-load",
        action="store_true",
        help="TESTING ONLY: read host-loaded blocks without waiting for the copy (re-creates a known race)",
    )
    p.add_argument(
        "--unsafe-indexer-load",
        action="store_true",
        help="TESTING ONLY, sparse attention: the indexer reads its host-loaded keys without waiting for the copy "
        "while the latent KV waits (GLM-5's host-cache race, on the indexer alone; needs --host-cache-bytes)",
    )
    p.add_argument(
        "--unsafe-topk",
        action="store_true",
        help="TESTING ONLY: sparse attention (GLM-5) selects keys on bfloat16 scores with ties in partition "
        "arrival order (re-creates a known incident: answers depend on the batch)",
    )
    p.add_argument(
        "--recurrent-scan",
        choices=("chunked", "token"),
        default="token",
        help="canonical numerics on a GPU, recurrent layers (gated DeltaNet, Mamba2): token - token by token "
        "(default, cheaper decode); chunked - chunks of 16 on the absolute position grid on tensor cores (faster "
        "prefill of long prompts; --block-size a multiple of 16). Both invariant",
    )
    p.add_argument(
        "--kernels",
        choices=KERNEL_SOURCES,
        default="auto",
        help="canonical numerics' kernels: auto - Triton on a GPU, on the CPU the compiled kernels (built once "
        "per machine; PyTorch's, with a logged reason, when they cannot be built); compiled - the CPU's compiled "
        "kernels or an error; torch - the CPU's PyTorch kernels; triton - the GPU kernels on the CPU "
        "(needs TRITON_INTERPRET=1, tests only)",
    )
    p.add_argument(
        "--numerics",
        choices=NUMERICS_MODES,
        default="canonical",
        help="canonical: logits independent of batch and chunking; shape-dependent: vendor-style, faster",
    )
    p.add_argument(
        "--chunking",
        choices=CHUNKING_RULES,
        default="kvwarden",
        help="prefill chunking rule; legacy-align re-creates vLLM's hybrid align mode",
    )
    p.add_argument(
        "--speculative-config",
        type=speculative_json,
        default=None,
        metavar="JSON",
        help='speculative decoding, as vLLM spells it: \'{"method": "ngram", "num_speculative_tokens": 3}\' '
        '(methods: mtp, draft with "model", ngram with "prompt_lookup_min"/"prompt_lookup_max"; '
        '"acceptance": "rejection" is not invariant)',
    )
    p.add_argument("--seed", type=int, default=0, help="seeds the per-request seeds of unseeded sampling requests")
    p.add_argument("--device", choices=DEVICES, default="auto", help="auto: the GPU when there is one, else the CPU")
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="GPU only: share of the device's memory for weights, activations and the KV pool",
    )
    p.add_argument(
        "--context-parallel-size",
        type=_positive,
        default=1,
        metavar="N",
        help="split a long step's rows across N processes of this host (CPU, gloo on loopback); with canonical "
        "numerics the logits are bitwise those of 1. Attention-only models",
    )
    p.add_argument(
        "--context-parallel-min-tokens",
        type=_positive,
        default=256,
        metavar="T",
        help="with --context-parallel-size: steps of at least T rows are split; shorter ones run on rank 0",
    )
    p.add_argument(
        "--layer-split",
        action="store_true",
        help="with --context-parallel-size N: each rank stores every N-th layer's KV cache (N times the "
        "prefix-cache capacity); a layer's owner broadcasts it before its attention, the next one prefetched",
    )
    p.add_argument(
        "--unsafe-layer-split",
        action="store_true",
        help="TESTING ONLY, with --layer-split: read a layer's broadcast buffer without waiting for the "
        "broadcast (re-creates the race of an engine without the wait)",
    )
    p.add_argument(
        "--tensor-parallel-size",
        type=_positive,
        default=1,
        metavar="N",
        help="shard every layer's weights and KV heads across N processes of this host (CPU, gloo on "
        "loopback); the logits are bitwise those of 1 (docs/parallelism.md). Attention models: dense, MoE, GLM-5 / "
        "DeepSeek-V3.2",
    )
    p.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        help="with --tensor-parallel-size: shard a MoE model's experts whole across the ranks (required for MoE)",
    )
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        help="GPU only: run decode steps eagerly instead of replaying CUDA graphs (same logits, slower)",
    )
    p.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="GPU decode graphs: launch the next decode step before reading this step's tokens, so the host's "
        "per-request work overlaps the GPU (same logits); --no-async-scheduling runs steps one after another",
    )


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every flag's help line ends with its default, when it has a meaningful one."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.required or action.default in (None, False, [], argparse.SUPPRESS):
            return action.help
        return super()._get_help_string(action)


def engine_kwargs(args: argparse.Namespace) -> dict[str, object]:
    """``LLM(...)`` keyword arguments from :func:`add_engine_args` flags."""
    return {
        "dtype": args.dtype,
        "load_format": args.load_format,
        "block_size": args.block_size,
        "enable_prefix_caching": not args.no_prefix_caching,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_num_seqs": args.max_num_seqs,
        "max_model_len": args.max_model_len,
        "num_blocks": args.num_blocks,
        "kv_cache_memory": args.kv_cache_mib * 1024 * 1024,
        "numerics": args.numerics,
        "chunking": args.chunking,
        "speculative_config": args.speculative_config,
        "seed": args.seed,
        "device": args.device,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "host_cache_bytes": args.host_cache_bytes,
        "unsafe_host_load": args.unsafe_host_load,
        "unsafe_indexer_load": args.unsafe_indexer_load,
        "unsafe_topk": args.unsafe_topk,
        "recurrent_scan": args.recurrent_scan,
        "kernels": args.kernels,
        "enforce_eager": args.enforce_eager,
        "async_scheduling": args.async_scheduling,
        "context_parallel_size": args.context_parallel_size,
        "context_parallel_min_tokens": args.context_parallel_min_tokens,
        "layer_split": args.layer_split,
        "unsafe_layer_split": args.unsafe_layer_split,
        "tensor_parallel_size": args.tensor_parallel_size,
        "enable_expert_parallel": args.enable_expert_parallel,
        # testing only: `kvwarden serve --inject-fault layer-split-delay=MS` (other commands have no faults)
        "layer_split_delay_ms": float(getattr(getattr(args, "faults", None), "layer_split_delay", None) or 0.0),
    }


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _bytes(text: str) -> int:
    """``N`` bytes, or with a K/M/G suffix (powers of 1024)."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    scale = units.get(text[-1:].upper(), 1)
    digits = text[:-1] if scale != 1 else text
    try:
        value = int(float(digits) * scale)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected bytes like 1073741824, 512M or 4G, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def speculative_json(text: str) -> dict:
    """``--speculative-config``: a JSON object, checked as the engine will check it."""
    import json

    from kvwarden.config import SpeculativeConfig

    try:
        spec = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e.msg} at character {e.pos}): {text!r}") from None
    try:
        SpeculativeConfig.from_dict(spec)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return spec
