"""Models at their real size with dummy weights: load time, decode under load, offline throughput and the
invariance properties (b), (e), (f), for a published ``config.json`` (optionally FP8, optionally its first
N layers).

    kvwarden bench scale --config bench/configs/qwen3-next-80b-a3b.json --fp8 --dtype bfloat16
    kvwarden bench scale --config bench/configs/large/glm-5.json --num-layers 8 --fp8 --dtype bfloat16

Steps, each timed on the same folder (``config.json`` and a tokenizer, no weights):

1. load: ``LLM(..., load_format="dummy")``: weights drawn on the device (FP8 with block scales when the
   config says so), the seconds and GB the loader reports;
2. offline: ``generate`` over ``--offline-requests`` random prompts of ``--input-len`` tokens, each
   ``--output-len`` tokens (``ignore_eos``): output tok/s;
3. invariance: one request against its cold run with caching off - (b) repeated after its own warm-up,
   (f) beside batch partners, on one engine; (e) under another step budget, on a second engine (engines
   built one after another, each freed before the next: an 80B model fits once);
4. online: ``kvwarden serve --load-format dummy`` on loopback, the streaming client at each
   ``--concurrency`` (``2 x concurrency`` requests, at least 4): output tok/s, TPOT and TTFT medians - the
   shape of vLLM's ``--random-input-len 1024 --random-output-len 1024`` runs.

Prints a table and ends with one JSON line; ``--out FILE`` writes the same JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from kvwarden.bench.properties import compare
from kvwarden.bench.stream_client import completion_body, run_bounded, served_model, stream_completion


def prepare(config: Path, out: Path, num_layers: int | None, fp8: tuple[int, int] | None) -> dict[str, Any]:
    """``out`` with the config (cut to ``num_layers``, FP8 when asked) and kvwarden's tokenizer; no weights."""
    from kvwarden.models.make_model import VOCAB_SIZES, fp8_config, train_tokenizer, write_config
    from kvwarden.models.random_weights import cut_layers

    cfg = json.loads(config.read_text())
    if num_layers:
        cfg = cut_layers(cfg, num_layers)
    if fp8 is not None:
        cfg["quantization_config"] = fp8_config(fp8)
    write_config(out, cfg, train_tokenizer(VOCAB_SIZES["tiny"]))
    return cfg


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def _collect() -> float:
    """Return freed device memory to the driver once an engine's last reference is gone (two copies of an
    80B model do not fit one GPU); the GiB still allocated, for the log."""
    import torch

    gc.collect()
    if not torch.cuda.is_available():
        return 0.0
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated() / 2**30


def _one_run(model: str, kw: dict[str, Any], prompt: list[int], params: Any) -> Any:
    """One request on an engine built for it and freed before returning."""
    from kvwarden import LLM

    llm = LLM(model, **kw)
    try:
        return llm.generate([prompt], params)[0]
    finally:
        llm.close()
        del llm
        _collect()


def offline_and_invariance(model: str, args: argparse.Namespace) -> dict[str, Any]:
    from kvwarden import LLM, SamplingParams

    kw = {"load_format": "dummy", "dtype": args.dtype, "device": args.device, "block_size": args.block_size}
    start = time.perf_counter()
    llm = LLM(model, **kw)
    loaded = llm.engine.loaded
    row: dict[str, Any] = {
        "load_s": round(time.perf_counter() - start, 2),
        "weights_load_s": round(loaded.load_seconds, 2),
        "weights_gb": round(loaded.load_bytes / 1e9, 3),
        "parameters_b": round(loaded.num_parameters / 1e9, 3),
    }
    vocab = min(llm.engine.model_config.vocab_size, 8192)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    prompts = _prompts(args.offline_requests, args.input_len, vocab, seed=1)
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))  # warm-up
    row["offline_tok_s"] = None
    if "offline" not in args.skip:
        t = time.perf_counter()
        outs = llm.generate(prompts, params)
        wall = time.perf_counter() - t
        row["offline_tok_s"] = round(sum(len(o.token_ids) for o in outs) / wall, 1)
    if "invariance" in args.skip:
        llm.close()
        del llm, loaded  # the caller's names too: a reference left here keeps the weights on the device
        row["invariance"] = {}
        row["left_allocated_gib"] = round(_collect(), 2)
        return row
    # invariance at full size: one request, greedy, top-5 logprobs, against its cold run with caching off
    probe = SamplingParams(temperature=0.0, max_tokens=8, logprobs=5, ignore_eos=True)
    prompt = _prompts(1, 3 * args.block_size + 5, vocab, seed=2)[0]
    partners = _prompts(3, args.block_size + 3, vocab, seed=3)
    first = llm.generate([prompt], probe)[0]
    again = llm.generate([prompt], probe)[0]
    together = llm.generate([prompt, *partners], [probe] + [SamplingParams(max_tokens=6, seed=i) for i in range(3)])
    llm.close()
    del llm, loaded
    row["left_allocated_gib"] = round(_collect(), 2)
    ref = _one_run(model, {**kw, "enable_prefix_caching": False}, prompt, probe)
    chunked = _one_run(model, {**kw, "max_num_batched_tokens": args.block_size // 2 + 1}, prompt, probe)
    outcomes = {
        "b": compare(ref, again, f"cached {again.num_cached_tokens}"),
        "e": compare(ref, chunked, f"budget {args.block_size // 2 + 1}"),
        "f": compare(ref, together[0], "3 partners"),
    }
    row["invariance"] = {k: o.identical for k, o in outcomes.items()}
    row["invariance_cold_equal_first"] = compare(ref, first).identical
    return row


async def _online_level(url: str, concurrency: int, args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    n = max(4, 2 * concurrency)
    prompts = _prompts(n, args.input_len, vocab, seed=concurrency)
    async with httpx.AsyncClient(timeout=args.timeout) as client:
        name = await served_model(client, url)

        async def one(p: list[int]) -> Any:
            return await stream_completion(client, url, completion_body(name, p, args.output_len))

        results, wall = await run_bounded(prompts, one, concurrency)
    ok = [r for r in results if r.ok]
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return {
        "concurrency": concurrency,
        "requests": n,
        "failed": n - len(ok),
        "output_tok_s": round(sum(r.output_tokens for r in ok) / wall, 1),
        "tpot_ms": round(1000 * statistics.median(tpot), 2) if tpot else None,
        "ttft_ms": round(1000 * statistics.median(r.ttft for r in ok), 1) if ok else None,
    }


def online(model: str, args: argparse.Namespace, vocab: int, save: Any) -> list[dict[str, Any]]:
    from kvwarden.bench.launch import kvwarden_servers
    from kvwarden.probe.launchers import ServerSettings

    settings = ServerSettings(
        device=args.device, dtype=args.dtype, block_size=args.block_size, extra_args=("--load-format", "dummy")
    )
    # a model of tens of GB loads for a minute or two before it answers
    with kvwarden_servers(model, {"kvwarden": settings}, ready_timeout=args.timeout) as servers:
        url = servers["kvwarden"].url
        asyncio.run(_online_level(url, 1, argparse.Namespace(**{**vars(args), "output_len": 4}), vocab))  # warm
        levels: list[dict[str, Any]] = []
        for c in args.concurrency:
            levels.append(asyncio.run(_online_level(url, c, args, vocab)))
            save(levels)  # a run cut short by its time limit keeps the levels it finished
        return levels


def summarize(figures: dict[str, Any]) -> list[tuple[str, str]]:
    """One (label, value) pair per part of the GPU script's summary cell (``summary_line``): load, offline,
    online, invariance."""
    out = [
        ("layers, weights load s", f"{figures['config']['layers']} {figures.get('weights_load_s')}"),
        ("offline tok/s", str(figures.get("offline_tok_s"))),
    ]
    if figures.get("online"):
        out.append(("online [(c, tok/s, TPOT ms)]", str(_online(figures))))
    if "invariance" in figures:
        out.append(("invariance b/e/f", _invariance(figures)))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, help="a published config.json (required unless --summarize)")
    p.add_argument("--summarize", type=Path, metavar="FILE", help="print one line of a result file and exit")
    p.add_argument("--num-layers", type=int, help="keep the first N layers (a model too large for the device)")
    p.add_argument("--fp8", nargs="?", const="128,128", metavar="BN,BK", help="as its FP8 checkpoint (blocks)")
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    p.add_argument("--device", default="auto")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=1024)
    p.add_argument("--offline-requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--skip-online", action="store_true")
    p.add_argument("--skip", nargs="*", default=[], choices=("offline", "invariance"), help="parts left out")
    p.add_argument("--out", type=Path, help="also write the JSON result here")
    args = p.parse_args(argv)
    if args.summarize:
        print(summary_line(json.loads(args.summarize.read_text())))
        return 0
    if args.config is None:
        p.error("--config: required (a published config.json)")
    fp8 = tuple(int(v) for v in args.fp8.split(",")) if args.fp8 else None
    with tempfile.TemporaryDirectory(prefix="kvwarden-scale-") as tmp:
        cfg = prepare(args.config, Path(tmp), args.num_layers, fp8)  # type: ignore[arg-type]
        result: dict[str, Any] = {
            "name": "scale",
            "config": {"file": str(args.config), "layers": cfg["num_hidden_layers"], "fp8": args.fp8,
                       **{k: v for k, v in vars(args).items() if k not in ("config", "out", "fp8")}},
        }  # fmt: skip
        result |= offline_and_invariance(tmp, args)
        result["online"] = []
        _save(args.out, result)
        vocab = min(int(cfg.get("vocab_size", 8192)), 8192)
        if not args.skip_online:
            result["online"] = online(tmp, args, vocab, lambda levels: _save(args.out, {**result, "online": levels}))
    result["machine"] = _machine()
    if args.num_layers and result["online"]:  # a cut model: what one layer costs a decode step
        c1 = result["online"][0]
        result["tpot_per_layer_ms"] = round(c1["tpot_ms"] / args.num_layers, 3) if c1["tpot_ms"] else None
    _print_table(result)
    _save(args.out, result)
    print(json.dumps(result))
    return 0 if all(result["invariance"].values()) else 1


def summary_line(r: dict[str, Any]) -> str:
    """Layers, weights load s, offline tok/s, [(concurrency, tok/s, TPOT ms)], b/e/f (T/F): the GPU script's
    summary cell."""
    return f"{r['config']['layers']} {r.get('weights_load_s')} {r.get('offline_tok_s')} {_online(r)} {_invariance(r)}"


def _online(r: dict[str, Any]) -> list[tuple[Any, ...]]:
    return [(o["concurrency"], o["output_tok_s"], o["tpot_ms"]) for o in r.get("online", [])]


def _invariance(r: dict[str, Any]) -> str:
    """``T/T/F`` for (b), (e), (f); ``-`` when the run skipped them."""
    return "/".join(str(v)[0] for v in r.get("invariance", {}).values()) or "-"


def _save(out: Path | None, result: dict[str, Any]) -> None:
    """The result so far to ``--out`` (rewritten after each part: the last write is the whole run)."""
    if out is not None:
        out.write_text(json.dumps({**result, "machine": result.get("machine") or _machine()}) + "\n")


def _machine() -> dict[str, Any]:
    import platform

    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"gpu": gpu, "cpu": platform.processor() or platform.machine(), "torch": torch.__version__}


def _print_table(r: dict[str, Any]) -> None:
    rows = [
        ("layers / parameters", f"{r['config']['layers']} / {r['parameters_b']} B"),
        ("weights read, load", f"{r['weights_gb']} GB in {r['weights_load_s']} s ({r['load_s']} s with the engine)"),
        ("offline output tok/s", r["offline_tok_s"]),
        ("invariance b / e / f", " / ".join(str(v) for v in r["invariance"].values()) or "skipped"),
    ]
    for o in r["online"]:
        rows.append((f"online c={o['concurrency']}", f"{o['output_tok_s']} tok/s, TPOT {o['tpot_ms']} ms, "
                     f"TTFT {o['ttft_ms']} ms, {o['failed']} failed"))  # fmt: skip
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")


if __name__ == "__main__":
    raise SystemExit(main())
