"""Where a CPU step's time goes: one prefill chunk and one decode step, by operator and by engine part.

For each engine (``--engines``: canonical numerics on the compiled kernels,
canonical on PyTorch's kernels, shape-dependent; CPU, float32), one engine
runs a prefill chunk of ``--chunk`` tokens, then a decode step of ``--batch``
requests. Each step is measured three ways: wall time (best of ``--repeats``); the PyTorch operators
it ran (``torch.profiler``, self CPU time, grouped: GEMM, attention products,
softmax/exp, norms, copies and indexing, other); and the Python time of the
engine's own parts (``cProfile``, self time by package: scheduler and block
tables, model runner, layers, models, sampler, cache). The operator time is
inside the Python time of the layer that called it, so the two tables answer
different questions: what the arithmetic costs, and what the host adds.

    kvwarden bench cpu_profile                             # llama-small, every engine
    kvwarden bench cpu_profile --model smollm2 --chunk 256 --batch 8

Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import random
import time
from collections.abc import Callable
from typing import Any

import torch

OP_GROUPS = (
    ("GEMM (mm, addmm, linear)", ("aten::mm", "aten::addmm", "aten::linear", "aten::matmul")),
    ("attention products (bmm, baddbmm)", ("aten::bmm", "aten::baddbmm")),
    ("exp / softmax / log-softmax", ("aten::exp", "softmax", "aten::amax", "aten::max", "logsumexp")),
    ("norms and reductions", ("aten::sum", "aten::mean", "aten::rsqrt", "aten::sqrt", "aten::pow", "aten::div")),
    ("copies, cat, index", ("copy", "aten::cat", "index", "aten::gather", "aten::scatter", "aten::clone", "aten::to")),
    ("element-wise", ("aten::mul", "aten::add", "aten::sub", "aten::silu", "aten::neg", "aten::sigmoid")),
)
# engine name -> (numerics mode, kernel source)
ENGINES = {
    "canonical": ("canonical", "compiled"),
    "canonical-torch": ("canonical", "torch"),
    "shape-dependent": ("shape-dependent", "auto"),
}
TOP_OPS = 8  # single operators listed per step (name, ms, calls)
PARTS = (
    ("scheduler + block tables", ("engine/scheduler", "engine/chunking", "cache/")),
    ("model runner (step tensors)", ("engine/model_runner",)),
    (
        "sampler + stop",
        ("engine/sampler", "engine/row_math", "engine/step_sampling", "engine/stop", "engine/spec/verify"),
    ),
    ("engine bookkeeping", ("engine/llm_engine", "engine/outputs", "engine/request")),
    ("layers (numerics, attention)", ("layers/",)),
    ("models (decoder, blocks)", ("models/",)),
    ("torch (Python side)", ("torch/",)),
)


def group(name: str, groups: tuple[tuple[str, tuple[str, ...]], ...]) -> str:
    return next((g for g, keys in groups if any(k in name for k in keys)), "other")


def op_table(step: Callable[[], Any]) -> tuple[dict[str, float], list[tuple[str, float, int]]]:
    """Self CPU seconds per operator group of one call, and the costliest operators (name, ms, calls)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    out: dict[str, float] = {}
    top = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:TOP_OPS]
    for evt in prof.key_averages():
        if evt.self_cpu_time_total > 0:
            g = group(evt.key, OP_GROUPS)
            out[g] = out.get(g, 0.0) + evt.self_cpu_time_total / 1e6
    return out, [(e.key, round(e.self_cpu_time_total / 1e3, 2), e.count) for e in top]


def part_table(step: Callable[[], Any]) -> dict[str, float]:
    """Self seconds per engine part of one call (cProfile: Python frames and the C calls they make)."""
    prof = cProfile.Profile()
    prof.enable()
    step()
    prof.disable()
    out: dict[str, float] = {}
    for (path, _, _), (_, _, tottime, _, _) in pstats.Stats(prof).stats.items():  # type: ignore[attr-defined]
        if path == "~":  # built-in calls: torch's C operators, list and dict methods
            g = "C calls (torch operators, builtins)"
        else:
            g = group(path.replace("\\", "/"), PARTS) if "kvwarden" in path or "torch" in path else "other Python"
        out[g] = out.get(g, 0.0) + tottime
    return out


def best_of(step: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return min(times)


def phase(llm: Any, kind: str, args: argparse.Namespace, rng: random.Random) -> dict[str, Any]:
    """Set up the engine so that its next step is the phase, then measure that step."""
    from kvwarden import SamplingParams

    core = llm.engine
    vocab = min(core.model_config.vocab_size, 8000)
    params = SamplingParams(temperature=0.0, max_tokens=10_000, ignore_eos=True)

    def fresh() -> None:
        for rid in list(core.requests):
            core.abort(rid)
        if kind == "prefill":
            core.add_request([rng.randrange(3, vocab) for _ in range(args.chunk + 1)], params)
        else:
            for _ in range(args.batch):
                core.add_request([rng.randrange(3, vocab) for _ in range(args.context)], params)
            while any(r.num_computed_tokens < r.num_prompt_tokens for r in core.requests.values()):
                core.step()  # prefill everyone: the next step decodes one token per request

    fresh()
    runs = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        core.step()
        runs.append(time.perf_counter() - t0)
        fresh()
    ops, top = op_table(core.step)
    fresh()
    parts = part_table(core.step)
    for rid in list(core.requests):
        core.abort(rid)
    return {"phase": kind, "step_s": min(runs), "ops": ops, "parts": parts, "top_ops": top}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="builtin:llama-small")
    p.add_argument(
        "--engines",
        default="canonical,canonical-torch,shape-dependent",
        help="comma-separated: canonical (the compiled CPU kernels), canonical-torch (canonical numerics on "
        "PyTorch's kernels), shape-dependent (library calls)",
    )
    p.add_argument("--chunk", type=int, default=512, help="prefill chunk tokens (one request)")
    p.add_argument("--batch", type=int, default=16, help="requests in the decode step")
    p.add_argument("--context", type=int, default=256, help="prompt tokens of each decoding request")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    from kvwarden import LLM

    rows = []
    for engine in args.engines.split(","):
        if engine not in ENGINES:
            p.error(f"--engines: unknown {engine!r}; expected some of {', '.join(ENGINES)}")
        numerics, kernels = ENGINES[engine]
        llm = LLM(args.model, device="cpu", dtype="float32", numerics=numerics, kernels=kernels,
                  max_num_batched_tokens=max(args.chunk, args.batch), max_num_seqs=max(args.batch, 1))  # fmt: skip
        for kind in ("prefill", "decode"):
            row = phase(llm, kind, args, random.Random(args.seed))
            row["numerics"] = engine
            rows.append(row)
        del llm
    print(table(rows, args))
    print(json.dumps({"bench": "cpu_profile", "model": args.model, "threads": torch.get_num_threads(),
                      "chunk": args.chunk, "batch": args.batch, "context": args.context, "rows": rows}))  # fmt: skip


def table(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    lines = [f"{args.model}, {torch.get_num_threads()} threads: prefill chunk of {args.chunk} tokens; "
             f"decode step of {args.batch} requests over {args.context}-token contexts"]  # fmt: skip
    for key, title in (("ops", "operators (self CPU)"), ("parts", "engine parts (Python self time, cProfile)")):
        lines += ["", f"| {title} | " + " | ".join(f"{r['numerics']} {r['phase']} ms" for r in rows) + " |"]
        lines.append("|---|" + "---|" * len(rows))
        names = sorted({g for r in rows for g in r[key]}, key=lambda g: -max(r[key].get(g, 0) for r in rows))
        for g in names:
            lines.append(f"| {g} | " + " | ".join(f"{r[key].get(g, 0.0) * 1e3:.1f}" for r in rows) + " |")
    lines += ["", "| step wall time (best of repeats) | " + " | ".join(f"{r['step_s'] * 1e3:.1f}" for r in rows) + " |"]
    for r in rows:
        ops = ", ".join(f"{name} {ms:.1f} ms x{n}" for name, ms, n in r["top_ops"])
        lines.append(f"\ncostliest operators, {r['numerics']} {r['phase']}: {ops}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
