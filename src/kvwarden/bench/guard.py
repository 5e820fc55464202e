"""What ``kvwarden guard`` costs and what it saves.

1. Overhead, in front of a backend that answers instantly
   (``kvwarden.bench.instant``): latency of the same request sent directly and
   through the guard (p50, p99; the difference is the guard's added latency),
   and the request rate each sustains with ``--concurrency`` clients.
2. Bad outputs delivered, under injected faults: ``--backends`` kvwarden
   servers (llama-tiny, n-gram speculation), each with
   ``kv-corruption=RATE`` and ``repetition=RATE`` (different fault seeds), and
   one clean server for the reference answers. Every prompt is sent once
   straight to a faulty backend (round-robin) and once through the guard; an
   answer is *bad* when its text or top-5 logprobs differ from the clean
   server's (the probe's fingerprint). Errors the guard returns after its
   retries are counted apart: they are refused, not delivered.

    kvwarden bench guard                     # both parts (a few minutes on 2 cores)
    kvwarden bench guard --quick             # smoke run

Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from kvwarden.bench.launch import process
from kvwarden.bench.stats import pct

MAX_TOKENS = 160  # past the acceptance rule's 128-token minimum


def guard_cmd(port: int, backends: list[str], *extra: str) -> list[str]:
    cmd = [sys.executable, "-m", "kvwarden.cli", "guard", "--port", str(port), "--canary-interval", "0", *extra]
    for url in backends:
        cmd += ["--backend", url]
    return cmd


# ------------------------------------------------------------------ overhead
def q(values: list[float], percent: int) -> float:
    """A percentile of latencies that are always there (each run sends at least one request)."""
    value = pct(values, percent)
    assert value is not None, "no latencies measured"
    return value


async def latencies(url: str, count: int, stream: bool) -> list[float]:
    body = {"model": "instant", "prompt": "x", "max_tokens": 16, "stream": stream}
    out = []
    async with httpx.AsyncClient(timeout=30) as client:
        for _ in range(count):
            t0 = time.perf_counter()
            async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
                async for _ in resp.aiter_bytes():
                    pass
                assert resp.status_code == 200, resp.status_code
            out.append(time.perf_counter() - t0)
    return out


async def sustained(url: str, concurrency: int, seconds: float) -> float:
    body = {"model": "instant", "prompt": "x", "max_tokens": 16}
    done = 0
    stop = time.perf_counter() + seconds
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(timeout=30, limits=limits) as client:

        async def worker() -> None:
            nonlocal done
            while time.perf_counter() < stop:
                resp = await client.post(f"{url}/v1/completions", json=body)
                assert resp.status_code == 200, resp.text
                done += 1

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return done / (time.perf_counter() - t0)


def overhead(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    from kvwarden.probe.launchers import free_port

    b_port, g_port = free_port(), free_port()
    backend_cmd = [sys.executable, "-m", "kvwarden.bench.instant", "--port", str(b_port)]
    with (
        process(backend_cmd, f"http://127.0.0.1:{b_port}", tmp / "instant.log") as backend,
        process(guard_cmd(g_port, [backend]), f"http://127.0.0.1:{g_port}", tmp / "guard-overhead.log") as guard,
    ):
        out: dict[str, Any] = {}
        for stream in (False, True):
            asyncio.run(latencies(guard, 20, stream))  # warm both paths
            asyncio.run(latencies(backend, 20, stream))
            direct = asyncio.run(latencies(backend, args.latency_requests, stream))
            via = asyncio.run(latencies(guard, args.latency_requests, stream))
            key = "stream" if stream else "json"
            out[key] = {
                "direct_p50_ms": 1e3 * q(direct, 50),
                "direct_p99_ms": 1e3 * q(direct, 99),
                "guard_p50_ms": 1e3 * q(via, 50),
                "guard_p99_ms": 1e3 * q(via, 99),
                "added_p50_ms": 1e3 * (q(via, 50) - q(direct, 50)),
                "added_p99_ms": 1e3 * (q(via, 99) - q(direct, 99)),
            }
        out["direct_rps"] = asyncio.run(sustained(backend, args.concurrency, args.seconds))
        out["guard_rps"] = asyncio.run(sustained(guard, args.concurrency, args.seconds))
    return out


# ------------------------------------------------------------- bad outputs
def prompts(count: int) -> list[str]:
    from kvwarden.models.bundled import documents

    docs = documents()
    out = []
    for i in range(count):
        words = docs[i % len(docs)].text.split()
        start = (i * 13) % max(1, len(words) - 40)
        out.append(" ".join(words[start : start + 30 + i % 10]))
    return out


async def answers(url: str, texts: list[str], urls: list[str] | None = None) -> list[tuple[str | None, str]]:
    """(fingerprint or None on an error, error code) per prompt; ``urls`` round-robins over several servers."""
    from kvwarden.probe.client import parse_logprobs
    from kvwarden.probe.fingerprint import fingerprint

    sem = asyncio.Semaphore(8)

    async def one(client: httpx.AsyncClient, i: int, prompt: str) -> tuple[str | None, str]:
        target = urls[i % len(urls)] if urls else url
        body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "logprobs": 5}
        body.update({"ignore_eos": True, "return_tokens_as_token_ids": True})
        async with sem:
            resp = await client.post(f"{target}/v1/completions", json=body)
        if resp.status_code != 200:
            return None, str(resp.json().get("error", {}).get("code"))
        choice = resp.json()["choices"][0]
        _, tops = parse_logprobs(choice["logprobs"])
        return fingerprint(tops, choice["text"]).ordered, ""

    async with httpx.AsyncClient(timeout=600) as client:
        return await asyncio.gather(*(one(client, i, p) for i, p in enumerate(texts)))


def bad_outputs(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    from kvwarden.models.make_model import make_model
    from kvwarden.probe.launchers import free_port

    model = tmp / "llama-tiny"
    make_model("llama", "tiny", 0, model)
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 3})
    serve = [sys.executable, "-m", "kvwarden.cli", "serve", str(model), "--served-model-name", "tiny"]
    serve += ["--speculative-config", spec]
    texts = prompts(args.requests)
    with contextlib.ExitStack() as stack:
        ports = [free_port() for _ in range(args.backends + 3)]
        clean = stack.enter_context(
            process([*serve, "--port", str(ports[0])], f"http://127.0.0.1:{ports[0]}", tmp / "clean.log")
        )
        faulty = []
        for i in range(args.backends):
            faults = [f"kv-corruption={args.fault_rate}", f"repetition={args.fault_rate}", f"fault-seed={i + 1}"]
            cmd = [*serve, "--port", str(ports[i + 1])]
            for fault in faults:
                cmd += ["--inject-fault", fault]
            url = f"http://127.0.0.1:{ports[i + 1]}"
            faulty.append(stack.enter_context(process(cmd, url, tmp / f"faulty-{i}.log")))
        g_port = ports[-1]
        guard = stack.enter_context(process(guard_cmd(g_port, faulty), f"http://127.0.0.1:{g_port}", tmp / "g.log"))
        t0 = time.perf_counter()
        reference = asyncio.run(answers(clean, texts))
        direct = asyncio.run(answers("", texts, faulty))
        # The same requests again through the guard: the fault draws continue, so other requests are hit.
        guarded = asyncio.run(answers(guard, texts))
        seconds = time.perf_counter() - t0
        # Refused prompts again, through a guard over the clean backend alone: refused there too means the
        # monitors trip on the clean answer itself (a false positive), not on an injected fault.
        again = [t for t, (fp, _) in zip(texts, guarded, strict=True) if fp is None]
        false_positive = 0
        if again:
            g2 = stack.enter_context(
                process(guard_cmd(ports[-2], [clean]), f"http://127.0.0.1:{ports[-2]}", tmp / "g2.log")
            )
            false_positive = sum(1 for fp, _ in asyncio.run(answers(g2, again)) if fp is None)
        metrics = httpx.get(f"{guard}/metrics", timeout=10).text
        faulted = [httpx.get(f"{u}/health", timeout=10).json().get("faulted_requests", {}) for u in faulty]
    aborts = {
        line.split('reason="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("kvwarden_guard:aborts_total{")
    }
    n = len(texts)
    bad_direct = sum(1 for (fp, _), (ref, _) in zip(direct, reference, strict=True) if fp != ref)
    bad_guard = sum(1 for (fp, _), (ref, _) in zip(guarded, reference, strict=True) if fp is not None and fp != ref)
    refused = sum(1 for fp, _ in guarded if fp is None)
    codes: dict[str, int] = {}
    for fp, code in guarded:
        if fp is None:
            codes[code] = codes.get(code, 0) + 1
    return {
        "requests": n,
        "fault_rate_each": args.fault_rate,
        "bad_without_guard": bad_direct / n,
        "bad_with_guard": bad_guard / n,
        "refused_by_guard": refused / n,
        "refused_codes": codes,
        "refused_by_a_guard_over_the_clean_backend": false_positive / n,
        "aborts": aborts,
        "faulted_requests_at_backends": faulted,
        "seconds": seconds,
    }


def summarize(figures: dict[str, Any]) -> list[tuple[str, str]]:
    """One (label, value) pair per headline figure: added latency, sustained rates, bad outputs under faults."""
    over, faults = figures["overhead"], figures.get("faults")
    added = {k: (round(over[k]["added_p50_ms"], 2), round(over[k]["added_p99_ms"], 2)) for k in ("json", "stream")}
    out = [
        ("added latency ms (p50, p99)", str(added)),
        ("sustained req/s (direct, guard)", f"{round(over['direct_rps'])} {round(over['guard_rps'])}"),
    ]
    if faults:
        shares = [round(faults[k], 4) for k in ("bad_without_guard", "bad_with_guard", "refused_by_guard")]
        out.append(("bad outputs (direct, guarded, refused)", str(shares)))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smoke run: few requests, short timings")
    p.add_argument("--latency-requests", type=int, default=300, help="sequential requests per latency figure")
    p.add_argument("--concurrency", type=int, default=32, help="clients for the sustained-rate figure")
    p.add_argument("--seconds", type=float, default=10.0, help="duration of the sustained-rate figure")
    p.add_argument("--requests", type=int, default=300, help="prompts for the bad-output figure")
    p.add_argument("--backends", type=int, default=2, help="faulty kvwarden backends behind the guard")
    p.add_argument("--fault-rate", type=float, default=0.05, help="kv-corruption and repetition rate of each")
    p.add_argument("--skip-faults", action="store_true", help="only the overhead part")
    args = p.parse_args()
    if args.quick:
        args.latency_requests, args.seconds, args.requests, args.fault_rate = 50, 2.0, 24, 0.25

    from rich.console import Console
    from rich.table import Table

    console = Console(stderr=True)
    with tempfile.TemporaryDirectory(prefix="kvwarden-bench-guard-") as tmp:
        console.print("[guard bench] overhead in front of an instant backend ...")
        over = overhead(args, Path(tmp))
        faults = None
        if not args.skip_faults:
            console.print(f"[guard bench] {args.requests} requests under injected faults ...")
            faults = bad_outputs(args, Path(tmp))
    table = Table(title="kvwarden guard: added latency (instant backend, 16 tokens)")
    for col in ("answer", "direct p50 ms", "direct p99 ms", "guard p50 ms", "guard p99 ms", "added p50", "added p99"):
        table.add_column(col, justify="right")
    for key in ("json", "stream"):
        r = over[key]
        cells = [r[k] for k in ("direct_p50_ms", "direct_p99_ms", "guard_p50_ms", "guard_p99_ms")]
        cells += [r["added_p50_ms"], r["added_p99_ms"]]
        table.add_row(key, *(f"{c:.2f}" for c in cells))
    console.print(table)
    console.print(f"sustained: direct {over['direct_rps']:.0f} req/s, through the guard {over['guard_rps']:.0f} req/s")
    if faults is not None:
        t = Table(title=f"bad outputs delivered ({faults['requests']} requests, faults at {args.fault_rate} each)")
        for col in ("path", "bad delivered", "refused (error)"):
            t.add_column(col, justify="right")
        t.add_row("straight to the faulty backends", f"{faults['bad_without_guard']:.2%}", "-")
        t.add_row("through kvwarden guard", f"{faults['bad_with_guard']:.2%}", f"{faults['refused_by_guard']:.2%}")
        fp = faults["refused_by_a_guard_over_the_clean_backend"]
        t.add_row("  of which refused over the clean backend too", "-", f"{fp:.2%}")
        console.print(t)
        console.print(f"aborts by reason: {faults['aborts']}; refused by last reason: {faults['refused_codes']}")
    print(json.dumps({"bench": "guard", "overhead": over, "faults": faults}))


if __name__ == "__main__":
    main()
