"""GPU speed, one run, one machine: throughput, decode, time to first token, and the cost of invariance.

Rows (kvwarden canonical = invariant Triton kernels; fast path = cuBLAS + SDPA):

1. offline throughput on nano-vllm's workload (``--num-requests`` sequences,
   random input and output lengths in [100, 1024], ``ignore_eos``): kvwarden
   canonical, kvwarden fast path, transformers ``generate`` (batched, left
   padded); beside it the workload's bandwidth floor: every decode step must
   read the weights and the KV of every running sequence, over the copy
   bandwidth measured in this run;
2. decode tok/s at batch 1, 16, 64, 256 (128-token prompts), and the batch-1
   figure as a share of the HBM roofline (weights + KV bytes read per token over
   the measured copy bandwidth);
3. time to first token for 1K, 4K and 16K-token prompts, cold and with the
   prompt's prefix cached (16 new tokens), the median of ``--ttft-repeats``
   fresh prefixes;
4. the cost of invariance: canonical over fast path, per row;
5. the hybrid models (``--hybrid``, comma-separated: a Qwen3-Next-style and a
   Granite-4.0-H-style one by default) beside the dense one for rows 1
   (kvwarden's engines), 2 and 3, and each one's ratio to the dense model per row;
6. ``--spec-model``: speculative decoding with the model's MTP head (k = 2)
   against speculation off, batch 1 and 16: tok/s, accept length, equal output;
7. ``--online``: ``kvwarden serve`` under ``kvwarden bench online``'s client at
   concurrency 1, 16 and 64 (TTFT, TPOT, tok/s), canonical beside the fast path;
8. ``--shared-prefix``: offline, groups of requests over a few long system
   prompts against the same lengths unshared (``kvwarden bench gpu_serving``).

    kvwarden bench gpu                                  # on a GPU: qwen3-0.6b, qwen3_next-0.6b, granite_hybrid-0.6b
    kvwarden bench gpu --device cpu --dtype float32 --model builtin:llama-tiny --hybrid builtin:qwen3_next-tiny --quick

A run that must fit a time limit takes ``--deadline-s`` (a part that would start
later is skipped and listed under ``skipped``) and ``--save PATH`` (the result so
far, rewritten after every part). Every part's wall time is in ``part_seconds``.

Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from kvwarden.bench.floor import copy_bandwidth, floor_seconds, model_bytes, vocab_of, workload
from kvwarden.bench.gpu_rows import NUMERICS, run_part
from kvwarden.bench.gpu_serving import print_rows, run_serving_part
from kvwarden.bench.gpu_summary import summarize  # noqa: F401 (read by kvwarden bench --summarize)


class Parts:
    """Runs each measurement in a child process, keeps the run's result and saves it after every part.

    ``--deadline-s`` bounds the run: a part that would start after it is skipped and named in
    ``result["skipped"]``, so a run cut short by a device call's time limit still says what it measured.
    """

    def __init__(self, args: argparse.Namespace, console: Any, result: dict[str, Any]) -> None:
        self.args, self.console, self.result = args, console, result
        self.t0 = time.perf_counter()
        result.setdefault("part_seconds", [])
        result.setdefault("skipped", [])

    def run(self, name: str, model: str, engine: str) -> dict[str, Any] | None:
        """One measurement's JSON line, or None (failed: the error is printed; or skipped past the deadline)."""
        import subprocess

        args = self.args
        if args.deadline_s and time.perf_counter() - self.t0 > args.deadline_s:
            self.console.print(f"[gpu bench] {name} {engine} {model}: skipped (past --deadline-s {args.deadline_s})")
            self.result["skipped"].append(f"{name} {engine} {model}")
            return None
        cmd = [sys.executable, "-m", "kvwarden.bench.gpu", "--part", name, "--model", model, "--engine", engine]
        cmd += ["--device", args.device, "--dtype", args.dtype, "--num-requests", str(args.num_requests)]
        cmd += [
            "--batches",
            args.batches_text,
            "--prompts",
            args.prompts_text,
            "--ttft-repeats",
            str(args.ttft_repeats),
        ]
        cmd += ["--quick"] if args.quick else []
        self.console.print(f"[gpu bench] {name} {engine} {model} ...")
        t0 = time.perf_counter()
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        seconds = time.perf_counter() - t0
        self.console.print(f"  ({seconds:.0f} s with start-up)")
        self.result["part_seconds"].append([name, engine, model, round(seconds, 1)])
        got = None
        if done.returncode != 0:
            self.console.print(f"  failed ({done.returncode}): {done.stderr[-1500:]}")
        else:
            got = json.loads(done.stdout.strip().splitlines()[-1])
        return got

    def save(self) -> None:
        """The result so far, as one JSON document at ``--save`` (rewritten after every part)."""
        if self.args.save:
            Path(self.args.save).write_text(json.dumps(self.result))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="builtin:qwen3-0.6b")
    p.add_argument(
        "--hybrid", default="builtin:qwen3_next-0.6b,builtin:granite_hybrid-0.6b", help="comma-separated; 'none'"
    )
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--batches", default="1,16,64,256")
    p.add_argument("--prompts", default="1024,4096,16384")
    p.add_argument("--hybrid-batches", default="1,16,64,256")
    p.add_argument("--hybrid-prompts", default="1024,4096,16384")
    p.add_argument("--ttft-repeats", type=int, default=3, help="TTFT rows: the median of this many fresh prefixes")
    p.add_argument("--spec-model", default="", help="a model with an MTP head: MTP k=2 vs speculation off")
    p.add_argument("--skip-offline", action="store_true")
    p.add_argument("--skip-rows", action="store_true", help="offline throughput (and --profile) only")
    p.add_argument("--skip-transformers", action="store_true", help="offline rows of kvwarden only")
    p.add_argument("--skip-dense-rows", action="store_true", help="decode and TTFT rows of the hybrid only")
    p.add_argument(
        "--row-engines",
        default="canonical,fast,canonical-eager,canonical-serial",
        help="engines of the decode/TTFT rows (canonical-serial: async scheduling off)",
    )
    p.add_argument("--online", action="store_true", help="kvwarden serve at concurrency 1, 16, 64, both engines")
    p.add_argument("--shared-prefix", action="store_true", help="offline: shared system prompts against unshared")
    p.add_argument("--profile", action="store_true", help="print a kernel table of one prefill + 8 decode steps")
    p.add_argument("--profile-model", default="", help="the model --profile looks at (default --model)")
    p.add_argument("--deadline-s", type=float, default=0.0, help="start no part after this many seconds (0: none)")
    p.add_argument("--save", default="", help="write the result so far to this JSON file after every part")
    p.add_argument("--quick", action="store_true", help="small sizes to check the script runs")
    p.add_argument("--part", default=None, help=argparse.SUPPRESS)  # internal: one measurement per process
    p.add_argument("--engine", default="canonical", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.quick:
        args.num_requests, args.batches, args.prompts = 4, "1,4", "64,256"
    args.batches_text, args.prompts_text = args.batches, args.prompts
    args.batches = [int(x) for x in args.batches.split(",")]
    args.prompts = [int(x) for x in args.prompts.split(",")]
    if args.part in ("online", "shared"):
        print(json.dumps(run_serving_part(args)))
        return
    if args.part is not None:
        print(json.dumps(run_part(args)))
        return

    from rich.console import Console

    console = Console(stderr=True)
    bw = copy_bandwidth(args.device)
    weights, kv_per_token = model_bytes(args.model)
    result: dict[str, Any] = {"bench": "gpu", "device": args.device, "copy_bandwidth_gb_s": bw / 1e9}
    parts = Parts(args, console, result)
    hybrids = [m for m in args.hybrid.split(",") if m not in ("", "none")]
    console.print(f"[gpu bench] copy {bw / 1e9:.0f} GB/s; weights {weights / 1e9:.2f} GB; KV {kv_per_token} B/token")
    if not args.skip_offline:
        offline(args, parts, hybrids, weights, kv_per_token, bw)
    roofline = bw / (weights + kv_per_token * 160)
    result["roofline_b1_tok_s"] = roofline
    result["decode"], result["ttft"] = [], []
    for model in ([args.model] * (not args.skip_dense_rows) + hybrids) * (not args.skip_rows):
        rows(args, parts, model, roofline)
    console.print(f"  batch-1 roofline {roofline:.0f} tok/s")
    if args.spec_model:
        got = parts.run("spec", args.spec_model, "canonical")
        result["spec"] = got["rows"] if got else []
        for r in result["spec"]:
            console.print(
                f"  MTP k=2 b{r['batch']:<3d} off {r['off_tok_s']:8.1f} on {r['on_tok_s']:8.1f} tok/s, "
                f"accept length {r['accept_length']:.2f}, identical {r['identical']}"
            )
            console.print(f"      steps off {r['off_steps']}")
            console.print(f"      steps on  {r['on_steps']}")
        parts.save()
    if not (args.skip_offline or args.skip_transformers):  # the reference last: the first part a deadline drops
        row = parts.run("offline", args.model, "transformers")
        if row is not None:
            floor = result["offline"]["floor_tok_s"]
            console.print(
                f"  offline transformers {row['output_tok_s']:9.0f} tok/s ({row['output_tok_s'] / floor:.1%} of floor)"
            )
            result["offline"]["rows"].append(row)
        parts.save()
    for name, wanted in (("online", args.online), ("shared", args.shared_prefix)):
        for engine in ("canonical", "fast") if wanted else ():
            got = parts.run(name, args.model, engine)
            result.setdefault(name, []).extend(got["rows"] if got else [])
            parts.save()
    print_rows(result, console)
    if args.profile:
        got = parts.run("profile", args.profile_model or args.model, "canonical")
        if got is not None:
            console.print(got["table"])
            result["profile"] = got["table"]
    if result["skipped"]:
        console.print(f"[gpu bench] skipped past the deadline: {result['skipped']}")
    parts.save()
    print(summary_table(result))
    print(json.dumps(result))


def offline(args: argparse.Namespace, parts: Parts, hybrids: list[str], weights: int, kv: int, bw: float) -> None:
    """Rows 1 and 5: nano-vllm's workload on the dense model (and transformers), then on each hybrid."""
    result, console = parts.result, parts.console
    lo, hi = (16, 48) if args.quick else (100, 1024)
    reqs = workload(args.num_requests, lo, hi, min(vocab_of(args.model), 8192))
    floor = sum(n for _, n in reqs) / floor_seconds(reqs, weights, kv, bw, 256)
    console.print(f"  offline bandwidth floor {floor:9.0f} tok/s")
    result["offline"] = {"rows": [], "floor_tok_s": floor}
    result["offline_hybrid"] = []
    for engine in ("canonical", "fast", "canonical-serial"):
        row = parts.run("offline", args.model, engine)
        if row is not None:
            share = row["output_tok_s"] / floor
            console.print(f"  offline {engine:12s} {row['output_tok_s']:9.0f} tok/s ({share:.1%} of floor)")
            result["offline"]["rows"].append(row)
        parts.save()
    for model in hybrids:
        for engine in ("canonical", "fast"):
            row = parts.run("offline", model, engine)
            if row is not None:
                row["model"] = model
                console.print(f"  offline {engine:12s} {row['output_tok_s']:9.0f} tok/s ({model})")
                result["offline_hybrid"].append(row)
            parts.save()


def rows(args: argparse.Namespace, parts: Parts, model: str, roofline: float) -> None:
    """Rows 2 and 3 of one model: decode tok/s by batch and TTFT cold / warm, per engine."""
    result, console = parts.result, parts.console
    if model != args.model:  # the hybrids' own sizes (--hybrid-batches, --hybrid-prompts)
        args.batches_text, args.prompts_text = args.hybrid_batches, args.hybrid_prompts
    for engine in [e for e in NUMERICS if e in args.row_engines.split(",")]:
        if engine in ("canonical-eager", "canonical-serial") and model != args.model:
            continue  # the hybrids' eager rows are left out to keep the run inside one device call
        got = parts.run("decode", model, engine)
        for r in got["rows"] if got else []:
            if model == args.model and r["batch"] == 1:
                r["share_of_roofline"] = r["decode_tok_s"] / roofline
            graphs = "graphs" if r.get("graphs") else " ".join(["eager", r.get("capture_error") or ""]).strip()
            console.print(f"  decode {engine:10s} b{r['batch']:<4d} {r['decode_tok_s']:9.1f} tok/s ({graphs})")
            result["decode"].append(r)
        parts.save()
        if engine in ("canonical-eager", "canonical-serial"):
            continue  # graphs and async scheduling only change decode steps
        got = parts.run("ttft", model, engine)
        for r in got["rows"] if got else []:
            console.print(
                f"  TTFT {engine:10s} {r['prompt']:6d} cold {r['cold_s']:.3f} s warm {r['warm_s']:.4f} s "
                f"({r['cold_s'] / r['warm_s']:.1f}x; tail {'graph' if r.get('warm_graph') else 'eager'})"
            )
            result["ttft"].append(r)
        parts.save()


def summary_table(result: dict[str, Any]) -> str:
    """The run as one markdown table: every figure beside its reference and the cost of invariance."""
    lines = ["| row | canonical | fast path | canonical / fast | reference |", "|---|---|---|---|---|"]
    off = {r["engine"]: r["output_tok_s"] for r in result.get("offline", {}).get("rows", [])}
    if off:
        ref = f"floor {result['offline']['floor_tok_s']:.0f}"
        ref += f"; transformers {off['transformers']:.0f}" if "transformers" in off else ""
        ref += f"; serial {off['canonical-serial']:.0f}" if "canonical-serial" in off else ""
        lines.append(_row("offline tok/s", off.get("canonical"), off.get("fast"), ref))
    hybrids: dict[str, dict[str, float]] = {}
    for r in result.get("offline_hybrid", []):
        hybrids.setdefault(r["model"], {})[r["engine"]] = r["output_tok_s"]
    for model, hyb in hybrids.items():
        ref = f"{hyb['canonical'] / off['canonical']:.2f}x dense" if off.get("canonical") and "canonical" in hyb else ""
        lines.append(_row(f"offline tok/s {model.split(':')[-1]}", hyb.get("canonical"), hyb.get("fast"), ref))
    dec: dict[tuple[str, int], dict[str, float]] = {}
    for r in result["decode"]:
        dec.setdefault((r["model"], r["batch"]), {})[r["engine"]] = r["decode_tok_s"]
    dense = result["decode"][0]["model"] if result["decode"] else ""
    for (model, batch), e in dec.items():
        ref = "; ".join(f"{k.split('-')[1]} {e[k]:.0f}" for k in ("canonical-eager", "canonical-serial") if k in e)
        base = dec.get((dense, batch), {}).get("canonical")
        if model != dense and base and "canonical" in e:
            ref += ("; " if ref else "") + f"{e['canonical'] / base:.2f}x dense"
        if batch == 1 and "canonical" in e and model == result["decode"][0]["model"]:
            ref += (
                "; " if ref else ""
            ) + f"roofline {result['roofline_b1_tok_s']:.0f} ({e['canonical'] / result['roofline_b1_tok_s']:.0%})"
        lines.append(_row(f"decode tok/s {model.split(':')[-1]} b{batch}", e.get("canonical"), e.get("fast"), ref))
    ttft: dict[tuple[str, int], dict[str, dict[str, float]]] = {}
    for r in result["ttft"]:
        ttft.setdefault((r["model"], r["prompt"]), {})[r["engine"]] = r
    for (model, prompt), e in ttft.items():
        c, f = e.get("canonical"), e.get("fast")
        dense_ttft = ttft.get((result["ttft"][0]["model"], prompt), {}).get("canonical")
        for kind in ("cold", "warm"):
            ref = f"cold / warm {c['cold_s'] / c['warm_s']:.1f}x" if kind == "warm" and c else ""
            if kind == "cold" and c and dense_ttft and dense_ttft is not c:
                ref = f"{c['cold_s'] / dense_ttft['cold_s']:.2f}x dense"
            name = f"TTFT s {model.split(':')[-1]} {prompt} {kind}"
            lines.append(_row(name, c and c[f"{kind}_s"], f and f[f"{kind}_s"], ref, seconds=True))
    for r in result.get("spec", []):
        ref = (
            f"off {r['off_tok_s']:.0f} ({r['on_tok_s'] / r['off_tok_s']:.2f}x); accept length {r['accept_length']:.2f}"
        )
        lines.append(_row(f"MTP k=2 b{r['batch']} tok/s", r["on_tok_s"], None, ref + f"; equal {r['identical']}"))
    online: dict[int, dict[str, dict[str, Any]]] = {}
    for r in result.get("online", []):
        online.setdefault(r["concurrency"], {})[r["engine"]] = r
    for conc, e in online.items():
        c, f = e.get("canonical"), e.get("fast")
        lines.append(_row(f"online c{conc} tok/s", c and c["output_tok_s"], f and f["output_tok_s"], ""))
        for key, label in (("ttft_ms_mean", "TTFT"), ("tpot_ms_mean", "TPOT")):
            cv, fv = c and c[key], f and f[key]
            lines.append(_row(f"online c{conc} {label} s", cv and cv / 1e3, fv and fv / 1e3, "", seconds=True))
    shared: dict[str, dict[str, dict[str, Any]]] = {}
    for r in result.get("shared", []):
        shared.setdefault(r["workload"], {})[r["engine"]] = r
    for kind, e in shared.items():
        c, f = e.get("canonical"), e.get("fast")
        ref = f"{c['cached_share']:.0%} cached" if c else ""
        unshared = shared.get("unshared", {}).get("canonical")
        if kind == "shared" and c and unshared:
            ref += f"; {c['output_tok_s'] / unshared['output_tok_s']:.2f}x unshared"
        lines.append(_row(f"{kind} prompts, output tok/s", c and c["output_tok_s"], f and f["output_tok_s"], ref))
    return "\n".join(lines)


def _row(name: str, canonical: float | None, fast: float | None, ref: str, seconds: bool = False) -> str:
    fmt = (lambda v: f"{v:.3f}") if seconds else (lambda v: f"{v:.0f}")
    ratio = ""
    if canonical and fast:  # for times the cost is fast / canonical: >1 would mean canonical is faster
        ratio = f"{(fast / canonical if seconds else canonical / fast):.2f}"
    return f"| {name} | {fmt(canonical) if canonical else '-'} | {fmt(fast) if fast else '-'} | {ratio} | {ref} |"


if __name__ == "__main__":
    main()
