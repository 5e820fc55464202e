"""Where a speculative step's time goes: the engine's phases timed one by one, speculation off and on.

Each phase of :meth:`kvwarden.engine.llm_engine.LLMEngine.step` is wrapped with
a device synchronisation before and after it (so the figures add up to the
step, at the cost of the overlap a real run would have): scheduling, the
recurrent checkpoint, the forward (a replayed graph or an eager step),
sampling and verification, the proposer (the MTP head's fill over the step's
rows, then its draft rounds). Prints ms per step for each phase and ends with
one JSON line.

    kvwarden bench spec_profile --device cuda --dtype bfloat16 --model builtin:qwen3_next-small
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="builtin:qwen3_next-small")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--k", type=int, default=2, help="MTP draft tokens")
    p.add_argument("--batches", default="1,16")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=0, help="default: the largest batch")
    p.add_argument(
        "--cprofile", type=int, default=0, metavar="N",
        help="then run each batch once more, unwrapped, under cProfile: the N functions of most own time",
    )  # fmt: skip
    return p.parse_args()


WRAPPED = ("schedule", "update", "execute", "_sample", "before_step", "commit", "propose", "step")


class Phases:
    """Accumulated seconds and calls per phase name."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def wrap(self, obj: Any, attr: str, name: str, label: Callable[..., str] | None = None) -> None:
        inner = getattr(obj, attr)

        def timed(*args: Any, **kw: Any) -> Any:
            self.sync()
            t0 = time.perf_counter()
            out = inner(*args, **kw)
            self.sync()
            key = label(*args) if label is not None else name
            self.seconds[key] += time.perf_counter() - t0
            self.calls[key] += 1
            return out

        setattr(obj, attr, timed)


def instrument(llm: Any, phases: Phases) -> None:
    eng = llm.engine
    phases.wrap(eng.scheduler, "schedule", "schedule")
    phases.wrap(eng.scheduler, "update", "scheduler.update")
    runner = eng.runner

    def forward_label(out: Any, kv: Any) -> str:
        graphed = runner.will_replay(out)
        spec = any(c.num_spec for c in out.chunks)
        return f"forward ({'graph' if graphed else 'eager'}{', verify' if spec else ''})"

    phases.wrap(runner, "execute", "forward", forward_label)
    phases.wrap(eng, "_sample", "sample + verify")
    if eng.speculator is not None:
        phases.wrap(eng.speculator, "before_step", "checkpoint")
        phases.wrap(eng.speculator, "commit", "commit / rollback")
        prop = eng.speculator.proposer
        if hasattr(prop, "_fill"):
            phases.wrap(prop, "_fill", "mtp: head over the step's rows")
            phases.wrap(prop, "_run", "mtp: head forward (all)")
        phases.wrap(eng.speculator, "propose", "propose (all)")
    phases.wrap(eng, "step", "step (all)")


def host_profile(run: Callable[..., Any], args: tuple[Any, ...], top: int) -> str:
    """``run(*args)`` under cProfile: the ``top`` functions by own time, then the engine's own functions
    by cumulative time (a string table)."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    run(*args)
    torch.cuda.synchronize() if torch.cuda.is_available() else None
    prof.disable()
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats("kvwarden", top)  # which of the engine's own calls hold it
    return "\n".join(line for line in out.getvalue().splitlines() if line.strip())


def summarize(figures: dict[str, Any]) -> list[tuple[str, str]]:
    """One (label, value) pair per line of the GPU script's summary: ms per engine step, per row."""
    rows = figures["rows"]
    return [("ms/step (by row)", str({k: round(1e3 * r["wall_s"] / r["steps"], 2) for k, r in rows.items()}))]


def main() -> int:
    args = parse()
    from kvwarden import LLM, SamplingParams
    from kvwarden.models.bundled import documents

    device = "cuda" if args.device == "auto" and torch.cuda.is_available() else args.device
    device = "cpu" if device == "auto" else device
    batches = [int(b) for b in args.batches.split(",")]
    text = "\n\n".join(d.text for d in documents())
    results: dict[str, Any] = {}
    for name, spec in (("off", None), ("on", {"method": "mtp", "num_speculative_tokens": args.k})):
        llm = LLM(
            args.model, device=device, dtype=args.dtype, max_num_seqs=args.max_num_seqs or max(batches),
            enable_prefix_caching=False, speculative_config=spec, block_size=args.block_size,
        )  # fmt: skip
        ids = llm.engine.tokenizer.encode(text)
        stride = max(args.prompt_len, (len(ids) - args.prompt_len) // max(batches))
        prompts = [ids[i * stride : i * stride + args.prompt_len] for i in range(max(batches))]
        llm.generate([[5] * 8], SamplingParams(max_tokens=4))  # warm-up: compiles
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True, logprobs=1)
        for batch in batches:
            phases = Phases(torch.device(device))
            instrument(llm, phases)
            t0 = time.perf_counter()
            llm.generate(prompts[:batch], params)
            phases.sync()
            wall = time.perf_counter() - t0
            stats = llm.engine.stats()
            steps = phases.calls["step (all)"]
            row = {
                "wall_s": wall,
                "steps": steps,
                "tok_s": batch * args.max_tokens / wall,
                "ms_per_step": {k: 1e3 * v / max(steps, 1) for k, v in phases.seconds.items()},
                "calls": dict(phases.calls),
                "accepted_per_draft": stats["spec_num_accepted_tokens"] / max(stats["spec_num_draft_tokens"], 1),
            }
            results[f"{name} b{batch}"] = row
            # un-wrap: a fresh set of wrappers per batch (instance attributes shadow the class's)
            for obj in (llm.engine, llm.engine.scheduler, llm.engine.runner, llm.engine.speculator):
                if obj is not None:
                    for attr in WRAPPED:
                        obj.__dict__.pop(attr, None)
            prop = llm.engine.speculator.proposer if llm.engine.speculator is not None else None
            if prop is not None:
                for attr in ("_fill", "_run"):
                    prop.__dict__.pop(attr, None)
        if args.cprofile:  # host time by function, no phase synchronisation (waits show as tolist/item)
            for batch in batches:
                print(f"\n{name} b{batch}: cProfile, {args.cprofile} functions of most own time")
                print(host_profile(llm.generate, (prompts[:batch], params), args.cprofile))
        del llm
    print(f"\nPhases of a step, ms per engine step ({args.model}, {device}, {args.dtype}, MTP k={args.k}):")
    for key, row in results.items():
        print(
            f"\n{key}: {row['steps']} steps, {row['tok_s']:.1f} tok/s, {1e3 * row['wall_s'] / row['steps']:.2f} "
            f"ms/step, accepted per draft {row['accepted_per_draft']:.2f}"
        )
        for phase, ms in sorted(row["ms_per_step"].items(), key=lambda kv: -kv[1]):
            print(f"  {phase:<36} {ms:8.3f} ms   ({row['calls'][phase]} calls)")
    print(json.dumps({"bench": "spec_profile", "model": args.model, "device": device, "rows": results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
