"""Where a step's time goes: one prefill chunk and one decode step, kernel by kernel, beside their ceilings.

For each phase the kernels of one eager step (canonical numerics) are timed by
the profiler and grouped (GEMMs, attention, norms, ...); beside each group its
two ceilings: the bytes it must move over the copy bandwidth measured in this
run, and its FLOPs over the GPU's dense bf16 matrix rate. The decode step is
also timed as a CUDA-graph replay (CUDA events), which is what serving runs.

    kvwarden bench gpu_profile                      # on a GPU: qwen3-0.6b
    kvwarden bench gpu_profile --model builtin:qwen3_next-0.6b    # the hybrid (256-token blocks)
    kvwarden bench gpu_profile --device cpu --dtype float32 --model builtin:llama-tiny --chunk 256 --batch 4
    kvwarden bench gpu_profile --model builtin:glm_moe_dsa-0.6b --batch 1 --context 4096   # sparse attention

Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from typing import Any

import torch

from kvwarden.bench.floor import block_size_for, copy_bandwidth, model_bytes, sync, vocab_of

PEAK_BF16_FLOPS = 989e12  # H200 SXM dense bf16 tensor-core rate (the data sheet's figure without sparsity)
GROUPS = (
    ("GEMM", ("_linear_kernel", "gemm", "cutlass", "sm90_xmma", "ampere", "aten::mm", "aten::addmm")),
    ("attention", ("_attention",)),
    # sparse attention (GLM-5, DeepSeek-V3.2): the indexer's scores, the deterministic top-k, latent attention
    ("sparse: indexer scores", ("_index_scores",)),
    ("sparse: top-k", ("_radix_select", "_split_count", "_split_compact")),
    ("sparse: latent attention", ("_latent_attention",)),
    ("recurrent scan", ("_gated_delta", "_gdn_", "_ring_write", "_mamba2")),
    ("conv", ("_conv_kernel", "_window_kernel")),
    ("MoE experts", ("_gate_up", "_down_kernel", "_combine")),
    ("MoE routing", ("_route", "_dispatch", "sort", "radix")),
    ("sampler rows", ("_long_row", "_row_reduce", "topk")),
    ("norm", ("_rms_norm",)),
    ("rope", ("_rope",)),
    ("activation", ("_silu_mul", "_unary")),
    ("KV write", ("index",)),
)


def group_of(name: str) -> str:
    low = name.lower()
    return next((g for g, keys in GROUPS if any(k.lower() in low for k in keys)), "other")


def kernel_times(step: Any, device: str, top: int = 12) -> tuple[dict[str, tuple[float, int]], list]:
    """Seconds and launches per kernel group of one call of ``step`` (profiler, device time), and the
    ``top`` kernels by time as ``(name, seconds, launches)``."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=acts) as prof:
        step()
        sync(device)
    out: dict[str, tuple[float, int]] = {}
    named: list[tuple[str, float, int]] = []
    for evt in prof.key_averages():
        t = getattr(evt, "self_device_time_total", 0) if device == "cuda" else evt.self_cpu_time_total
        if device == "cuda" and getattr(evt, "device_type", None) is not None and "CUDA" not in str(evt.device_type):
            continue
        if t <= 0 or (device != "cuda" and evt.key.startswith(("aten::to", "aten::copy", "aten::empty"))):
            continue
        g = group_of(evt.key)
        s, n = out.get(g, (0.0, 0))
        out[g] = (s + t / 1e6, n + evt.count)
        named.append((evt.key[:70], t / 1e6, evt.count))
    return out, sorted(named, key=lambda x: -x[1])[:top]


def ceilings(phase: dict[str, Any], params: int, head: int, kv_per_token: int, bw: float) -> dict[str, tuple]:
    """(seconds from bytes, seconds from FLOPs) per group for a step of ``rows`` rows over ``keys`` keys."""
    rows, sampled, keys, pairs = phase["rows"], phase["sampled"], phase["keys"], phase["pairs"]
    width = 2  # bf16 weights and activations
    body = params - head
    gemm_bytes = (body + head) * width + rows * phase["act_per_row"] * width  # weights + activations
    gemm_flops = 2 * rows * body + 2 * sampled * head
    attn_bytes = keys * kv_per_token
    attn_flops = pairs * phase["attn_flops_per_pair"]
    return {
        "GEMM": (gemm_bytes / bw, gemm_flops / PEAK_BF16_FLOPS),
        "attention": (attn_bytes / bw, attn_flops / PEAK_BF16_FLOPS),
    }


def summarize(figures: dict[str, Any]) -> list[tuple[str, str]]:
    """One (label, value) pair per line of the GPU script's summary: the decode step's ms, eager and graph."""
    modes = [m for m in ("eager", "graph") if f"decode_step_s_{m}" in figures]
    ms = " ".join(str(round(figures[f"decode_step_s_{m}"] * 1e3, 2)) for m in modes)
    return [(f"decode step ms ({', '.join(modes)})", ms)] if modes else []


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="builtin:qwen3-0.6b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--chunk", type=int, default=2048, help="prefill chunk (one request's prompt)")
    p.add_argument("--batch", type=int, default=64, help="decode batch")
    p.add_argument("--context", type=int, default=512, help="decode requests' prompt length")
    args = p.parse_args()
    from kvwarden import LLM, SamplingParams

    bw = copy_bandwidth(args.device)
    _, kv_per_token = model_bytes(args.model)
    vocab = min(vocab_of(args.model), 8192)
    rng = random.Random(0)
    share = 0.3 if args.device == "cuda" else 0.9
    common = dict(
        device=args.device,
        dtype=args.dtype,
        enable_prefix_caching=False,
        gpu_memory_utilization=share,
        block_size=block_size_for(args.model),
    )
    result: dict[str, Any] = {"bench": "gpu_profile", "model": args.model, "copy_bandwidth_gb_s": bw / 1e9}
    for graphs in (False, True):
        llm = LLM(args.model, max_num_seqs=max(256, args.batch), max_num_batched_tokens=max(args.chunk, 8192),
                  enforce_eager=not graphs, **common)  # fmt: skip
        core = llm.engine
        m = core.loaded.model
        params = sum(t.numel() for layer in m.layers for t in _weights(layer)) + m.lm_head.numel()
        cfg = m.cfg
        attn_pair = 4 * cfg.num_attention_heads * cfg.head_dim * len(cfg.attention_layers)
        # every GEMM reads its input rows and writes its output rows: about 12 hidden widths per layer
        act = 12 * cfg.hidden_size * cfg.num_hidden_layers
        llm.generate([[5] * 40] * 2, SamplingParams(max_tokens=3))  # compile the kernels
        if not graphs:  # the prefill chunk, eager
            core.add_request([rng.randrange(3, vocab) for _ in range(args.chunk)], SamplingParams(max_tokens=1))
            phase = {"rows": args.chunk, "sampled": 1, "keys": args.chunk, "pairs": args.chunk * (args.chunk + 1) // 2}
            phase["attn_flops_per_pair"], phase["act_per_row"] = attn_pair, act
            phase["kernels"], phase["top"] = kernel_times(core.step, args.device)
            phase["ceilings"] = ceilings(phase, params, m.lm_head.numel(), kv_per_token, bw)
            result["prefill_chunk"] = phase
        for _ in range(args.batch):
            core.add_request([rng.randrange(3, vocab) for _ in range(args.context)],
                             SamplingParams(max_tokens=64, ignore_eos=True))  # fmt: skip
        while (
            any(r.num_computed_tokens < r.num_prompt_tokens for r in core.scheduler.running) or core.scheduler.waiting
        ):
            core.step()
        ctx = sum(r.num_tokens for r in core.scheduler.running)
        if not graphs:
            phase = {
                "rows": args.batch,
                "sampled": args.batch,
                "keys": ctx,
                "pairs": ctx,
                "attn_flops_per_pair": attn_pair,
                "act_per_row": act,
            }
            phase["kernels"], phase["top"] = kernel_times(core.step, args.device)
            phase["ceilings"] = ceilings(phase, params, m.lm_head.numel(), kv_per_token, bw)
            result["decode_step"] = phase
        times = []
        for _ in range(8):  # whole steps, host work included (graph replays when graphs is True)
            sync(args.device)
            t0 = time.perf_counter()
            core.step()
            sync(args.device)
            times.append(time.perf_counter() - t0)
        result["decode_step_s_" + ("graph" if graphs else "eager")] = sorted(times)[len(times) // 2]
        while core.has_unfinished_requests():
            for r in list(core.scheduler.running) + list(core.scheduler.waiting):
                core.abort(r.request_id)
        del llm, core
    print(render(result, bw))
    print(json.dumps(result))


def _weights(layer: Any) -> list[torch.Tensor]:
    found = []
    for obj in (layer.mixer, layer.ffn):
        for name, value in vars(obj).items():
            # 3-D: stacked experts (all counted: an upper bound of what a step reads)
            if name.startswith("w") and isinstance(value, torch.Tensor) and value.dim() in (2, 3):
                found.append(value)
    return found


def render(result: dict[str, Any], bw: float) -> str:
    lines = []
    for key, title in (("prefill_chunk", "prefill chunk"), ("decode_step", "decode step")):
        phase = result.get(key)
        if phase is None:
            continue
        total = sum(t for t, _ in phase["kernels"].values())
        lines.append(f"\n{title}: {phase['rows']} rows over {phase['keys']} keys; kernels {total * 1e3:.2f} ms")
        lines.append("| group | launches | ms | share | bytes / bandwidth ms | FLOPs / peak ms |")
        lines.append("|---|---|---|---|---|---|")
        for g, (t, n) in sorted(phase["kernels"].items(), key=lambda kv: -kv[1][0]):
            c = phase["ceilings"].get(g)
            ceil = f"{c[0] * 1e3:.3f} | {c[1] * 1e3:.3f}" if c else "- | -"
            lines.append(f"| {g} | {n} | {t * 1e3:.3f} | {t / total:.0%} | {ceil} |")
        lines.append(f"the {len(phase.get('top', []))} costliest kernels of the {title}:")
        for name, t, n in phase.get("top", []):
            lines.append(f"  {t * 1e3:8.3f} ms  {n:5d} x  {name}")
    for mode in ("eager", "graph"):
        if f"decode_step_s_{mode}" in result:
            lines.append(f"decode step, {mode}, whole step: {result[f'decode_step_s_{mode}'] * 1e3:.2f} ms")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
