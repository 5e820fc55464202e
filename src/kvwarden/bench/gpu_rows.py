"""The measurements behind ``kvwarden bench gpu``, each run by it in a fresh process (``--part``).

Offline throughput on nano-vllm's shape, decode tok/s per batch, time to first
token cold and warm, MTP speculation on/off and a kernel profile. The machine
facts the driver sets them against are in :mod:`kvwarden.bench.floor`.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

from kvwarden.bench.floor import block_size_for, sync, vocab_of, workload
from kvwarden.bench.offline import run_kvwarden, run_transformers

# canonical-chunked: the canonical backend with gated DeltaNet on the chunk grid (numerics.recurrent_scan) instead of
# token by token
NUMERICS = {
    "canonical": "canonical",
    "fast": "shape-dependent",
    "canonical-eager": "canonical",
    "canonical-chunked": "canonical",
    "canonical-serial": "canonical",  # async scheduling off: the next step waits for this step's tokens
}


def llm(model: str, args: argparse.Namespace, numerics: str, **kw: Any) -> Any:
    from kvwarden import LLM

    kw.setdefault("enforce_eager", args.engine == "canonical-eager")
    kw.setdefault("async_scheduling", args.engine != "canonical-serial")
    if args.engine == "canonical-chunked":
        kw.setdefault("recurrent_scan", "chunked")
    kw.setdefault("block_size", block_size_for(model))
    return LLM(model, device=args.device, dtype=args.dtype, numerics=numerics, **kw)


def decode_rows(model: str, args: argparse.Namespace, vocab: int, engines: list[str]) -> list[dict[str, Any]]:
    rows = []
    steps = 32
    for name in engines:
        numerics = NUMERICS[name]
        engine = llm(model, args, numerics, max_num_seqs=256, max_num_batched_tokens=8192, enable_prefix_caching=False)
        rng = random.Random(1)
        for batch in args.batches:
            prompts = [[rng.randrange(3, vocab) for _ in range(128)] for _ in range(batch)]
            best = min(decode_window(engine.engine, prompts, steps, args.device) for _ in range(2))
            graphs = engine.engine.runner.graphs
            captured = bool(graphs is not None and graphs.graphs)
            rows.append(
                {
                    "model": model,
                    "engine": name,
                    "batch": batch,
                    "decode_tok_s": batch * steps / best,
                    "graphs": captured,
                    "capture_error": graphs.capture_error if graphs is not None else None,
                }
            )
        del engine
    return rows


def decode_window(core: Any, prompts: list[list[int]], steps: int, device: str) -> float:
    """Seconds of ``steps`` engine steps in which every request of ``prompts`` decodes (greedy): prompts
    computed and two decode steps run first, no request ends inside the window, the device synchronised
    at both ends (a step async scheduling launched ahead is inside it). The requests are aborted after."""
    from kvwarden import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=steps + 4, ignore_eos=True)
    ids = [core.add_request(p, params) for p in prompts]
    while core.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in core.scheduler.running):
        core.step()
    for _ in range(2):  # the first decode steps at this batch size (a graph's first replay)
        core.step()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        core.step()
    sync(device)
    seconds = time.perf_counter() - t0
    for rid in ids:
        core.abort(rid)
    return seconds


def ttft_rows(model: str, args: argparse.Namespace, vocab: int, engines: list[str]) -> list[dict[str, Any]]:
    from kvwarden import SamplingParams

    rows = []
    one = SamplingParams(temperature=0.0, max_tokens=1)
    for name in engines:
        numerics = NUMERICS[name]
        # Half the card: the fast path's attention builds a dense mask for a 16K prompt (8 GiB).
        engine = llm(
            model, args, numerics, max_num_batched_tokens=8192, max_model_len=max(args.prompts) + 64,
            gpu_memory_utilization=0.5,
        )  # fmt: skip
        rng = random.Random(2)
        # Warm-up that compiles every kernel the timed runs use: a cold prompt past one attention split
        # and its prefix hit (the parallel-split launch), so no row pays a first-use compile.
        warm = [rng.randrange(3, vocab) for _ in range(min(1100, max(args.prompts)))]
        engine.generate([warm + [7] * 16, warm + [9] * 16], one)

        def timed(prompt: list[int], engine: Any = engine) -> float:
            sync(args.device)
            t0 = time.perf_counter()
            engine.generate([prompt], one)
            sync(args.device)
            return time.perf_counter() - t0

        for length in args.prompts:
            colds, warms, tail_graph = [], [], True
            for _ in range(args.ttft_repeats):  # a fresh prefix each time: every cold run is really cold
                prefix = [rng.randrange(3, vocab) for _ in range(length)]
                colds.append(timed(prefix + [7] * 16))
                graphs = engine.engine.runner.graphs
                tails = graphs.tail_replays if graphs is not None else 0
                warms.append(timed(prefix + [9] * 16))  # the prefix's blocks are cached now
                # whether the warm request's 16-token tail replayed a graph (else it ran eagerly)
                tail_graph &= graphs is not None and graphs.tail_replays > tails
            row = {"model": model, "engine": name, "prompt": length, "warm_graph": tail_graph}
            # the median of the repeats (one slow first call or one lucky one moves neither)
            row |= {"cold_s": statistics.median(colds), "warm_s": statistics.median(warms)}
            rows.append(row | {"cold_runs_s": colds, "warm_runs_s": warms})
        del engine
    return rows


def spec_rows(model: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Greedy decode with the MTP head proposing 2 tokens against speculation off: speed and equality."""
    from kvwarden import SamplingParams
    from kvwarden.models.bundled import documents

    rows = []
    # Windows of the bundled documents, not random ids: a model trained on that text (make-model
    # --train-steps) continues it the way its MTP head was fitted to predict; random ids are no one's input.
    text = "\n\n".join(d.text for d in documents())
    outs: dict[str, Any] = {}
    prompts_all: list[list[int]] = []
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True, logprobs=1)
    for name, spec in (("off", None), ("on", {"method": "mtp", "num_speculative_tokens": 2})):
        engine = llm(model, args, "canonical", max_num_seqs=64, enable_prefix_caching=False, speculative_config=spec)
        if not prompts_all:
            ids = engine.tokenizer.encode(text)
            stride = max(128, (len(ids) - 128) // 16)
            prompts_all = [ids[i * stride : i * stride + 128] for i in range(16)]
        for batch in (1, 16):  # warm-up at the measured shapes: prefill kernels compile on first use
            engine.generate(prompts_all[:batch], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
        for batch in (1, 16):
            before = _step_counts(engine.engine)
            sync(args.device)
            t0 = time.perf_counter()
            got = engine.generate(prompts_all[:batch], params)
            sync(args.device)
            outs[name, batch] = (time.perf_counter() - t0, [(o.token_ids, o.logprobs) for o in got])
            # this batch's own counts (acceptance and how its steps ran), not the warm-up's
            outs[name, batch, "steps"] = {k: v - before[k] for k, v in _step_counts(engine.engine).items()}
        del engine
    for batch in (1, 16):
        n = batch * 64
        on = outs["on", batch, "steps"]
        rows.append(
            {
                "batch": batch,
                "off_tok_s": n / outs["off", batch][0],
                "on_tok_s": n / outs["on", batch][0],
                "accept_length": 1 + on["accepted"] / max(on["drafts"], 1),
                "identical": outs["off", batch][1] == outs["on", batch][1],
                "off_steps": outs["off", batch, "steps"],
                "on_steps": on,
            }
        )
    return rows


def _step_counts(core: Any) -> dict[str, int]:
    """Engine steps, graph replays (verify ones, MTP drafting ones) and acceptance counts so far."""
    stats = core.stats()
    graphs = core.runner.graphs
    proposer = core.speculator.proposer if core.speculator is not None else None
    mtp = getattr(proposer, "graphs", None)
    return {
        "steps": core.num_steps,
        "replays": graphs.replays if graphs is not None else 0,
        "verify_replays": graphs.verify_replays if graphs is not None else 0,
        "mtp_replays": mtp.replays if mtp is not None else 0,
        "drafts": stats.get("spec_num_drafts", 0),
        "accepted": stats.get("spec_num_accepted_tokens", 0),
    }


def profile_steps(model: str, args: argparse.Namespace, vocab: int, batch: int, prompt: int) -> str:
    """Kernel-time table of a prefill step and the decode steps after it (torch.profiler, canonical)."""
    from torch.profiler import ProfilerActivity, profile

    from kvwarden import SamplingParams

    # Eager, so that each kernel is attributed to its launch (a graph replays the same kernels).
    engine = llm(
        model, args, "canonical", max_num_seqs=256, max_num_batched_tokens=8192, enable_prefix_caching=False,
        enforce_eager=True,
    )  # fmt: skip
    rng = random.Random(3)
    engine.generate([[5] * 8], SamplingParams(max_tokens=2))
    core = engine.engine
    for _ in range(batch):
        core.add_request(
            [rng.randrange(3, vocab) for _ in range(prompt)], SamplingParams(max_tokens=9, ignore_eos=True)
        )
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    with profile(activities=activities) as prof:
        while core.has_unfinished_requests():
            core.step()
        sync(args.device)
    key = "cuda_time_total" if args.device == "cuda" else "cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=18)


def run_part(args: argparse.Namespace) -> dict[str, Any]:
    """One measurement in this process (the driver runs each in a fresh process: its memory dies with it)."""
    lo, hi = (16, 48) if args.quick else (100, 1024)
    vocab = min(vocab_of(args.model), 8192)
    numerics = NUMERICS.get(args.engine, "canonical")
    if args.part == "offline":
        reqs = workload(args.num_requests, lo, hi, vocab)
        ns = argparse.Namespace(
            device=args.device,
            dtype=args.dtype,
            max_input=hi,
            max_output=hi,
            max_num_seqs=256,
            max_num_batched_tokens=8192,
            hf_batch=args.num_requests,
            block_size=block_size_for(args.model),
        )
        r = run_transformers(args.model, reqs, ns.hf_batch, ns) if args.engine == "transformers" else None
        name = "canonical-serial" if args.engine == "canonical-serial" else numerics  # offline.ENGINES' key
        r = r or run_kvwarden(args.model, reqs, name, ns)
        return {"engine": args.engine, "output_tok_s": r.output_tok_s, "seconds": r.seconds}
    if args.part == "decode":
        return {"rows": decode_rows(args.model, args, vocab, [args.engine])}
    if args.part == "ttft":
        return {"rows": ttft_rows(args.model, args, vocab, [args.engine])}
    if args.part == "spec":
        return {"rows": spec_rows(args.model, args)}
    return {"table": profile_steps(args.model, args, vocab, batch=16, prompt=512)}
