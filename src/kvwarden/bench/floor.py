"""What the GPU benches set their figures against: the device's copy bandwidth, a model's weight and
KV-cache bytes, its vocabulary and block size, the seeded workload, and the workload's time at that
bandwidth (the floor no engine beats)."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import torch

from kvwarden.bench import workloads


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(device: str) -> float:
    """Bytes per second of a large device-to-device copy (read + write counted), median of 10."""
    n = (1 << 30) // 2 if device == "cuda" else (1 << 26)
    src = torch.randn(n, dtype=torch.float16 if device == "cuda" else torch.float32, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(11):
        sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(device)
        times.append(time.perf_counter() - t0)
    return 2 * src.numel() * src.element_size() / sorted(times[1:])[5]


def model_config(model: str) -> dict[str, Any]:
    """The model's Hugging Face config: its config.json, or for a GGUF file what transformers reads from it."""
    from kvwarden.models.sources import resolve_model

    path = resolve_model(model)
    if path.suffix == ".gguf":
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name).to_dict()
    return json.loads((path / "config.json").read_text())


def model_bytes(model: str) -> tuple[int, int]:
    """(bytes of weights a decode step reads, KV bytes per token) from the checkpoint and its config."""
    from kvwarden.models.sources import resolve_model

    path = resolve_model(model)
    cfg = model_config(model)
    if path.suffix == ".gguf":  # dequantized on load: the device holds bfloat16 weights
        from gguf import GGUFReader

        total, width = 2 * sum(int(t.n_elements) for t in GGUFReader(str(path)).tensors), 2
    else:
        total = _safetensors_bytes(path, cfg)
        width = 2 if cfg.get("torch_dtype", "bfloat16") in ("bfloat16", "float16") else 4
    if not cfg.get("tie_word_embeddings", False):  # the embedding table is looked up, not read whole
        total -= cfg["vocab_size"] * cfg["hidden_size"] * width
    layer_types = cfg.get("layer_types")
    layers = cfg["num_hidden_layers"]
    attn = sum(1 for t in layer_types if t in ("full_attention", "attention")) if layer_types else layers
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_per_token = attn * 2 * cfg["num_key_value_heads"] * head_dim * 2  # bf16 K and V
    return total, kv_per_token


def _safetensors_bytes(path: Path, cfg: dict[str, Any]) -> int:
    """Bytes of the checkpoint's tensors, the MTP head's left out (a decode step without speculation never reads
    it; GLM-5-style heads carry their own embedding and LM head)."""
    from safetensors import safe_open

    from kvwarden.models.config import ModelConfig
    from kvwarden.models.loader import is_mtp_tensor

    mc = ModelConfig.from_dict(cfg)
    sizes = {"F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4}
    total = 0
    for f in path.glob("*.safetensors"):
        with safe_open(str(f), "pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                if not is_mtp_tensor(mc, name):
                    part = handle.get_slice(name)
                    total += math.prod(part.get_shape()) * sizes.get(part.get_dtype(), 4)
    return total


def vocab_of(model: str) -> int:
    return model_config(model)["vocab_size"]


def workload(n: int, lo: int, hi: int, vocab: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """nano-vllm's shape: prompts and outputs both uniform in [lo, hi] (``kvwarden.bench.workloads.uniform``)."""
    return [(list(r.prompt), r.max_tokens) for r in workloads.uniform(n, (lo, hi), (lo, hi), vocab, seed)]


def floor_seconds(reqs: list[tuple[list[int], int]], weights: int, kv_per_token: int, bw: float, seqs: int) -> float:
    """Decode steps of the workload with ``seqs`` running at once, each reading the weights and every KV."""
    pending = sorted(((len(p), n) for p, n in reqs), key=lambda r: -r[1])
    running: list[list[int]] = []  # [context, left]
    total = 0.0
    while pending or running:
        while pending and len(running) < seqs:
            ctx, n = pending.pop()
            running.append([ctx, n])
        total += (weights + kv_per_token * sum(ctx for ctx, _ in running)) / bw
        for r in running:
            r[0] += 1
            r[1] -= 1
        running = [r for r in running if r[1] > 0]
    return total


def block_size_for(model: str) -> int:
    """16 for dense models; 256 for hybrids, whose every block carries a boundary state (18 MB per block on
    qwen3_next-0.6b against 3 MB of KV at 256 tokens): as vLLM raises a hybrid's block size to its state's page."""
    types = model_config(model).get("layer_types") or []
    return 256 if any(t in ("linear_attention", "mamba") for t in types) else 16
