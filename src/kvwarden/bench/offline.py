"""Offline throughput: kvwarden (canonical and shape-dependent numerics) vs transformers.

nano-vllm's benchmark shape scaled for a 2-core CPU: N requests of random token
ids, input lengths uniform in [min_input, max_input], output lengths uniform in
[min_output, max_output], sampling at temperature 0.6 with ignore_eos, fixed
seed. transformers runs the same requests with batched ``generate`` (left
padding, batches of each --hf-batch size, each batch generating up to its
longest request); only requested tokens count as output. Engines: ``canonical``
(on the CPU: the compiled kernels), ``canonical-torch`` (canonical numerics on
PyTorch's CPU kernels), ``shape-dependent``, ``transformers``. The targets
compare kvwarden's canonical path with transformers at its best batch size
(>= 1.5x on the CPU, >= 1.0x on a GPU) and with kvwarden's own shape-dependent
path (>= 0.75x).

Prints a table and the targets, and ends with one JSON line.

    kvwarden bench offline                       # full run (both models, ~30 min)
    kvwarden bench offline --quick               # smoke run (seconds)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from kvwarden.bench import workloads


@dataclass
class Result:
    model: str
    engine: str
    requests: int
    input_tokens: int
    output_tokens: int
    seconds: float

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def total_tok_s(self) -> float:
        return (self.input_tokens + self.output_tokens) / self.seconds


def workload(args: argparse.Namespace, vocab: int) -> list[tuple[list[int], int]]:
    reqs = workloads.uniform(
        args.num_requests, (args.min_input, args.max_input), (args.min_output, args.max_output), vocab, args.seed
    )
    return [(list(r.prompt), r.max_tokens) for r in reqs]


# engine name -> (numerics mode, kernel source)
ENGINES = {
    "canonical": ("canonical", "auto"),
    "canonical-torch": ("canonical", "torch"),
    "shape-dependent": ("shape-dependent", "auto"),
    "canonical-serial": ("canonical", "auto"),  # without async scheduling (engine/overlap.py): its A/B
}


def run_kvwarden(model: str, reqs: list[tuple[list[int], int]], engine: str, args: argparse.Namespace) -> Result:
    from kvwarden import LLM, SamplingParams

    numerics, kernels = ENGINES[engine]
    llm = LLM(
        model,
        numerics=numerics,
        kernels=kernels,
        device=args.device,
        dtype=args.dtype,
        max_model_len=args.max_input + args.max_output + 8,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=getattr(args, "block_size", 16),
        async_scheduling=engine != "canonical-serial",
    )
    params = [SamplingParams(temperature=0.6, seed=i, max_tokens=n, ignore_eos=True) for i, (_, n) in enumerate(reqs)]
    llm.generate([reqs[0][0]], SamplingParams(max_tokens=2))  # warm-up
    start = time.perf_counter()
    outs = llm.generate([p for p, _ in reqs], params, use_tqdm=True)
    seconds = time.perf_counter() - start
    produced = sum(len(o.token_ids) for o in outs)
    return Result(model, f"kvwarden ({engine})", len(reqs), sum(len(p) for p, _ in reqs), produced, seconds)


def run_transformers(model: str, reqs: list[tuple[list[int], int]], hf_batch: int, args: argparse.Namespace) -> Result:
    from transformers import AutoModelForCausalLM

    from kvwarden.models.sources import resolve_model

    path = resolve_model(model)
    dtype = getattr(torch, args.dtype)
    if path.suffix == ".gguf":
        hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
    else:
        hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    device = _device(args)
    hf = hf.to(device).eval()
    pad = 0
    start = time.perf_counter()
    produced = 0
    for b in range(0, len(reqs), hf_batch):
        batch = reqs[b : b + hf_batch]
        width = max(len(p) for p, _ in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, (p, _) in enumerate(batch):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        max_new = max(n for _, n in batch)
        with torch.no_grad():
            hf.generate(
                ids.to(device),
                attention_mask=mask.to(device),
                max_new_tokens=max_new,
                min_new_tokens=max_new,
                do_sample=True,
                temperature=0.6,
                top_k=0,
                pad_token_id=pad,
            )
        produced += sum(n for _, n in batch)
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    engine = f"transformers generate (batch {hf_batch})"
    return Result(model, engine, len(reqs), sum(len(p) for p, _ in reqs), produced, seconds)


def _device(args: argparse.Namespace) -> str:
    from kvwarden.config import resolve_device

    return resolve_device(args.device)


def vocab_size(model: str) -> int:
    from kvwarden.models.sources import resolve_model

    path = resolve_model(model)
    if path.suffix == ".gguf":
        return 49152
    return json.loads((path / "config.json").read_text())["vocab_size"]


def check_targets(results: list[Result], device: str) -> list[dict[str, object]]:
    """canonical >= 1.5x (CPU) or 1.0x (GPU) transformers at its best batch size; canonical >= 0.75x
    shape-dependent."""
    least = 1.5 if device == "cpu" else 1.0
    out: list[dict[str, object]] = []
    for model in dict.fromkeys(r.model for r in results):
        mine = {r.engine: r.output_tok_s for r in results if r.model == model}
        canonical = mine.get("kvwarden (canonical)")
        hf = {e: v for e, v in mine.items() if e.startswith("transformers")}
        if canonical is None:
            continue
        if hf:
            best = max(hf, key=lambda e: hf[e])
            ratio = canonical / hf[best]
            target = f"canonical vs {best} >= {least}"
            out.append({"model": model, "target": target, "ratio": ratio, "met": ratio >= least})
        fast = mine.get("kvwarden (shape-dependent)")
        if fast:
            ratio = canonical / fast
            target = "canonical vs shape-dependent >= 0.75"
            out.append({"model": model, "target": target, "ratio": ratio, "met": ratio >= 0.75})
    return out


def print_table(results: list[Result], device: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"offline throughput ({device})")
    for col in ("model", "engine", "requests", "input tok", "output tok", "seconds", "output tok/s", "total tok/s"):
        table.add_column(col)
    for r in results:
        table.add_row(
            r.model,
            r.engine,
            str(r.requests),
            str(r.input_tokens),
            str(r.output_tokens),
            f"{r.seconds:.1f}",
            f"{r.output_tok_s:.1f}",
            f"{r.total_tok_s:.1f}",
        )
    Console(file=sys.stderr, width=160).print(table)


def summarize(figures: dict[str, Any]) -> list[tuple[str, str]]:
    """One (label, value) pair per line of the GPU script's summary: output tok/s by engine, per model."""
    by_model: dict[str, dict[str, float]] = {}
    for r in figures["results"]:
        by_model.setdefault(r["model"], {})[r["engine"]] = r["output_tok_s"]
    if len(by_model) == 1:
        return [("throughput (output tok/s)", str(next(iter(by_model.values()))))]
    return [(f"throughput {m.split(':')[-1]} (output tok/s)", str(tok_s)) for m, tok_s in by_model.items()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["builtin:llama-small", "smollm2"])
    p.add_argument("--engines", nargs="+", default=["canonical", "shape-dependent", "transformers"])
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--min-input", type=int, default=64)
    p.add_argument("--max-input", type=int, default=512)
    p.add_argument("--min-output", type=int, default=32)
    p.add_argument("--max-output", type=int, default=256)
    p.add_argument(
        "--max-num-seqs", type=int, default=64, help="kvwarden's batch (64: transformers' largest --hf-batch)"
    )
    p.add_argument("--max-num-batched-tokens", type=int, default=1024)
    p.add_argument("--hf-batch", type=int, nargs="+", default=[16, 32, 64], help="transformers batch sizes to try")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", help="auto, cpu or cuda (transformers runs on the same device)")
    p.add_argument("--dtype", default="float32", help="float32 or bfloat16")
    p.add_argument("--quick", action="store_true", help="tiny workload to check the script runs")
    args = p.parse_args()
    if args.quick:
        args.num_requests, args.max_input, args.min_input = 4, 48, 16
        args.min_output, args.max_output, args.hf_batch = 4, 8, [2]
    results: list[Result] = []
    for model in args.models:
        reqs = workload(args, vocab_size(model))
        for engine in args.engines:
            print(f"[{model}] {engine} ...", file=sys.stderr, flush=True)
            if engine == "transformers":
                results.extend(run_transformers(model, reqs, size, args) for size in args.hf_batch)
            elif engine not in ENGINES:
                p.error(f"--engines: unknown {engine!r}; expected some of {', '.join([*ENGINES, 'transformers'])}")
            else:
                results.append(run_kvwarden(model, reqs, engine, args))
    print_table(results, _device(args))
    targets = check_targets(results, _device(args))
    for t in targets:
        print(f"{t['model']}: {t['target']}: {t['ratio']:.2f}x -> {'met' if t['met'] else 'MISSED'}", file=sys.stderr)
    summary = {
        "benchmark": "offline",
        "device": _device(args),
        "dtype": args.dtype,
        "workload": {
            k: getattr(args, k) for k in ("num_requests", "min_input", "max_input", "min_output", "max_output", "seed")
        },
        "results": [{**asdict(r), "output_tok_s": round(r.output_tok_s, 2)} for r in results],
        "targets": targets,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
