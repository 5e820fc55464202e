"""Tensor parallelism on CPU ranks: tok/s at each rank count, and what the rank-count-invariant exchange costs
against a plain all-reduce.

    kvwarden bench tensor_parallel --model builtin:llama-small --ranks 1 2

1. engine: for each ``--ranks`` N, ``LLM(model, tensor_parallel_size=N)``: decode tok/s at each
   ``--batch`` (``--input-len`` prompts, ``--output-len`` tokens each) and the prefill time of one
   ``--prefill-len`` prompt; the first output's tokens are compared across N (bitwise, as the tests assert).
2. exchange, on two gloo ranks of this host: per decode step of B rows, the four all-gathers kvwarden runs
   per layer (attention output, ``o_proj`` output, SwiGLU activation, ``down_proj`` output; each rank's
   half) against the two all-reduces of ``[B, hidden]`` a Megatron-style layer runs (summing partials,
   whose order then depends on the rank count), times the layers: milliseconds per step each, and their
   difference as a share of the measured decode step at N = 2.

Prints a table and ends with one JSON line (``--out FILE`` writes it too).
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from kvwarden.engine.context_parallel.group import RankGroup

REPEATS = 50


def _shapes(model: str) -> dict[str, int]:
    from kvwarden.models.config import ModelConfig
    from kvwarden.models.sources import resolve_model

    cfg = ModelConfig.from_dir(resolve_model(model))
    return {
        "layers": cfg.num_hidden_layers,
        "hidden": cfg.hidden_size,
        "attn": cfg.num_attention_heads * cfg.head_dim,
        "inter": cfg.intermediate_size,
    }


def engine_rows(model: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    from kvwarden import LLM, SamplingParams

    rows, first = [], {}
    for n in args.ranks:
        ep = args.enable_expert_parallel and n > 1  # one rank holds every expert
        budget = max(512, args.prefill_len)
        with LLM(model, tensor_parallel_size=n, enable_expert_parallel=ep, max_num_batched_tokens=budget) as llm:
            vocab = min(llm.engine.model_config.vocab_size, 8000)
            params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
            llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))  # warm
            row: dict[str, Any] = {"ranks": n}
            rng = random.Random(0)  # the same prompts at every rank count
            for b in args.batch:
                prompts = [[rng.randrange(3, vocab) for _ in range(args.input_len)] for _ in range(b)]
                t = time.perf_counter()
                outs = llm.generate(prompts, params)
                row[f"decode_tok_s_b{b}"] = round(sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t), 1)
                first.setdefault(b, [o.token_ids for o in outs])
                row[f"same_tokens_b{b}"] = [o.token_ids for o in outs] == first[b]
            long = [rng.randrange(3, vocab) for _ in range(args.prefill_len)]
            t = time.perf_counter()
            llm.generate([long], SamplingParams(max_tokens=1))
            row["prefill_s"] = round(time.perf_counter() - t, 3)
            rows.append(row)
    return rows


def _time(fn: Any) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(REPEATS):
        fn()
    return (time.perf_counter() - t) / REPEATS


def exchange(group: RankGroup, shapes: dict[str, int], batches: list[int], dtype: torch.dtype) -> list[dict]:
    """Both ranks run this together: per step of each batch size, gathers vs all-reduces, in ms."""
    from kvwarden.engine.tensor_parallel.comm import GlooColumns

    gather = GlooColumns(group)
    out = []
    for b in batches:
        halves = [torch.zeros(b, shapes[k] // 2, dtype=dtype) for k in ("attn", "hidden", "inter", "hidden")]
        full = torch.zeros(b, shapes["hidden"], dtype=torch.float32)  # gloo reduces float32 (no bfloat16 sum)
        layers = shapes["layers"]
        gathers = 1e3 * layers * _time(lambda halves=halves: [gather.all_gather(h, [h.shape[1]] * 2) for h in halves])
        reduces = 1e3 * layers * _time(lambda full=full: [group.pg.allreduce([full]).wait() for _ in range(2)])
        out.append({"batch": b, "gather_ms": gathers, "allreduce_ms": reduces})
    return out


def _peer(args: argparse.Namespace) -> int:
    store = RankGroup.connect_store(args.port, 2, 60.0)
    group = RankGroup(store, 1, 2, torch.device("cpu"), 60.0)
    exchange(group, json.loads(args.shapes), args.batch, getattr(torch, args.dtype))
    group.close()
    return 0


def exchange_rows(model: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    shapes = _shapes(model)
    store = RankGroup.open_store(2, 60.0)
    cmd = [sys.executable, "-m", "kvwarden.bench.tensor_parallel", "--peer-port", str(store.port), "--model", model,
           "--shapes", json.dumps(shapes), "--dtype", args.dtype, "--batch", *map(str, args.batch)]  # fmt: skip
    peer = subprocess.Popen(cmd)
    try:
        group = RankGroup(store, 0, 2, torch.device("cpu"), 60.0)
        rows = exchange(group, shapes, args.batch, getattr(torch, args.dtype))
        group.close()
    finally:
        peer.wait(timeout=120)
    return rows


def summarize(figures: dict[str, Any]) -> list[tuple[str, str]]:
    """One (label, value) pair per headline figure: decode tok/s and equal tokens per rank count, the exchange."""
    out = []
    for r in figures["engine"]:
        tok_s = [v for k, v in r.items() if k.startswith("decode_tok_s")]
        same = all(v for k, v in r.items() if k.startswith("same_tokens"))
        out.append((f"TP {r['ranks']}: decode tok/s by batch, equal, prefill s", f"{tok_s} {same} {r['prefill_s']}"))
    ex = [(r["batch"], r["gather_ms"], r["allreduce_ms"], r.get("invariant_extra_share")) for r in figures["exchange"]]
    out.append(("exchange (b, gather ms, all-reduce ms, extra)", str(ex)))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="builtin:llama-small")
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--prefill-len", type=int, default=512)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--enable-expert-parallel", action="store_true", help="a MoE model's experts over the ranks")
    p.add_argument("--out", type=Path)
    p.add_argument("--peer-port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--shapes", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.peer_port is not None:
        args.port = args.peer_port
        return _peer(args)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    engines = engine_rows(args.model, args)
    ex = exchange_rows(args.model, args)
    two = next((r for r in engines if r["ranks"] == 2), None)
    for row in ex:
        key = f"decode_tok_s_b{row['batch']}"
        if two is not None and key in two:
            step_ms = 1e3 * row["batch"] / two[key]  # one token per request per decode step
            row["decode_step_ms_tp2"] = round(step_ms, 2)
            row["invariant_extra_share"] = round((row["gather_ms"] - row["allreduce_ms"]) / step_ms, 3)
        row["gather_ms"], row["allreduce_ms"] = round(row["gather_ms"], 3), round(row["allreduce_ms"], 3)
    result = {"name": "tensor_parallel", "config": vars(args) | {"out": str(args.out)}, "engine": engines,
              "exchange": ex, "machine": {"cpu": _cpu(), "torch": torch.__version__}}  # fmt: skip
    for r in engines:
        print(f"TP {r['ranks']}: " + ", ".join(f"{k} {v}" for k, v in r.items() if k != "ranks"))
    for r in ex:
        print(f"exchange b={r['batch']}: gathers {r['gather_ms']} ms/step, all-reduces {r['allreduce_ms']} ms/step, "
              f"extra {r.get('invariant_extra_share')} of a TP-2 decode step")  # fmt: skip
    line = json.dumps(result)
    if args.out:
        args.out.write_text(line + "\n")
    print(line)
    return 0 if all(v for r in engines for k, v in r.items() if k.startswith("same_tokens")) else 1


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


if __name__ == "__main__":
    raise SystemExit(main())
