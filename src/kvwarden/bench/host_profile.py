"""Where a decode step's host time goes: the ground truth for overlapping the host with the GPU.

A replayed decode step (CUDA graph) is host work, then the replay, then the wait
for its logits, then the sampler's and the requests' bookkeeping: the GPU idles
whenever the host works. For each batch size this measures, over ``--steps``
steady decode steps of one engine (every request past its prompt):

* the whole step's wall time, and the GPU's busy time inside it (the
  profiler's kernel times of a step, summed: one stream runs them in turn);
* a ``cProfile`` of the same steps: the functions that take the host's time,
  by own time and by cumulative time (the profiler slows Python, so its shares
  matter, not its seconds).

GPU idle = wall - kernels is the part an overlapped scheduler could hide.

    kvwarden bench host_profile                                    # on a GPU: qwen3-0.6b, batch 1 and 64
    kvwarden bench host_profile --model builtin:qwen3_next-0.6b --batch 64
    kvwarden bench host_profile --device cpu --dtype float32 --model builtin:llama-tiny --batch 4 --steps 8

Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import random
import time
from pathlib import Path
from typing import Any

from kvwarden.bench.floor import block_size_for, sync, vocab_of


def steady_engine(args: argparse.Namespace, batch: int) -> Any:
    """An engine with ``batch`` requests all decoding (prompts of ``--prompt`` random ids)."""
    from kvwarden import LLM, SamplingParams

    llm = LLM(
        args.model, device=args.device, dtype=args.dtype, max_num_seqs=max(batch, 1), enable_prefix_caching=False,
        block_size=block_size_for(args.model), gpu_memory_utilization=0.4, async_scheduling=not args.serial,
    )  # fmt: skip
    core = llm.engine
    rng = random.Random(0)
    vocab = min(vocab_of(args.model), 8192)
    n = 4 * args.steps + 16
    for i in range(batch):
        # --offline: nano-vllm's sampling (seeded, temperature 0.6) and outputs only at the end, as LLM.generate
        temp, seed = (0.6, i) if args.offline else (0.0, None)
        params = SamplingParams(temperature=temp, seed=seed, max_tokens=n, ignore_eos=True, logprobs=args.logprobs)
        core.add_request([rng.randrange(3, vocab) for _ in range(args.prompt)], params, final_only=args.offline)
    while core.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in core.scheduler.running):
        core.step()
    for _ in range(4):  # warm-up decode steps (graph capture at this batch on first use)
        core.step()
    return llm


def gpu_busy(core: Any, device: str) -> float:
    """Seconds of kernels in one step (the profiler's device times, summed: one stream runs them one after
    another, so this is the GPU's busy time; the CPU: 0)."""
    if device != "cuda":
        core.step()
        return 0.0
    from gpu_profile import kernel_times

    return sum(t for t, _ in kernel_times(core.step, device)[0].values())


def top_functions(prof: cProfile.Profile, key: str, n: int) -> list[dict[str, Any]]:
    """The ``n`` functions with the most ``key`` time ('tottime' or 'cumulative'), as rows."""
    stats = pstats.Stats(prof, stream=io.StringIO())
    stats.sort_stats(key)
    rows = []
    for func in stats.fcn_list[:n]:  # type: ignore[attr-defined]
        _, nc, tt, ct, _ = stats.stats[func]  # type: ignore[attr-defined]
        file, line, name = func
        where = f"{Path(file).name}:{line}" if file != "~" else "builtin"
        rows.append({"function": f"{name} ({where})", "calls": nc, "tottime_s": tt, "cumtime_s": ct})
    return rows


def measure(args: argparse.Namespace, batch: int) -> dict[str, Any]:
    llm = steady_engine(args, batch)
    core = llm.engine
    # NOTE: the steps' mean over one timed run, not each step timed alone: a sync before each step would
    # drain the step async scheduling launched ahead, and time the host alone
    sync(args.device)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        core.step()
    sync(args.device)
    step_s = (time.perf_counter() - t0) / args.steps
    busy = [gpu_busy(core, args.device) for _ in range(4)]
    prof = cProfile.Profile()
    sync(args.device)
    prof.enable()
    for _ in range(args.steps):
        core.step()
    sync(args.device)
    prof.disable()
    graphs = core.runner.graphs
    median = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    row = {
        "batch": batch,
        "step_s": step_s,
        "gpu_busy_s": median(busy),
        "graphs": bool(graphs is not None and graphs.graphs),
        "by_tottime": top_functions(prof, "tottime", args.top),
        "by_cumtime": top_functions(prof, "cumulative", args.top),
    }
    for r in list(core.scheduler.running) + list(core.scheduler.waiting):
        core.abort(r.request_id)
    del llm, core
    return row


def render(rows: list[dict[str, Any]]) -> str:
    lines = []
    for r in rows:
        idle = r["step_s"] - r["gpu_busy_s"]
        lines.append(
            f"\nbatch {r['batch']}: step {r['step_s'] * 1e3:.2f} ms, kernels {r['gpu_busy_s'] * 1e3:.2f} ms, "
            f"GPU idle {idle * 1e3:.2f} ms ({idle / r['step_s']:.0%}); {'graphs' if r['graphs'] else 'eager'}"
        )
        for key, title in (("by_tottime", "own time"), ("by_cumtime", "cumulative")):
            total = (
                sum(x["tottime_s"] for x in r["by_tottime"]) if key == "by_tottime" else r["by_cumtime"][0]["cumtime_s"]
            )
            lines.append(f"| function ({title}) | calls | s | share |")
            lines.append("|---|---|---|---|")
            for x in r[key]:
                t = x["tottime_s" if key == "by_tottime" else "cumtime_s"]
                lines.append(f"| {x['function']} | {x['calls']} | {t:.4f} | {t / max(total, 1e-12):.0%} |")
    return "\n".join(lines)


def summarize(figures: dict[str, Any]) -> list[tuple[str, str]]:
    """One (label, value) pair per line of the GPU script's summary: step and kernel ms per batch."""
    rows = [(r["batch"], round(r["step_s"] * 1e3, 2), round(r["gpu_busy_s"] * 1e3, 2)) for r in figures["rows"]]
    return [(f"{'serial' if figures.get('serial') else 'async'}: (batch, step ms, kernels ms)", str(rows))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="builtin:qwen3-0.6b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch", type=int, action="append", help="repeatable; default 1 and 64")
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens per request")
    p.add_argument("--steps", type=int, default=32, help="decode steps timed, then profiled")
    p.add_argument("--logprobs", type=int, default=None, help="top logprobs per token (the probe asks for 20)")
    p.add_argument("--top", type=int, default=22, help="functions listed per table")
    p.add_argument("--serial", action="store_true", help="async scheduling off: each step waits for its tokens")
    p.add_argument("--offline", action="store_true", help="seeded temperature-0.6 requests, outputs at the end")
    args = p.parse_args()
    rows = [measure(args, b) for b in args.batch or [1, 64]]
    print(render(rows))
    head = {"bench": "host_profile", "model": args.model, "device": args.device, "serial": args.serial}
    head["offline"] = args.offline
    print(json.dumps({**head, "rows": rows}))


if __name__ == "__main__":
    main()
