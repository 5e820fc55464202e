"""Soak: a real server under load, aborts and malformed input; nothing may leak or change an answer.

Starts ``kvwarden serve`` on loopback (or uses ``--url``) and sends ``--requests``
requests at ``--concurrency``, bounded by ``--max-seconds``:

* normal (about 75 %): random token prompts and lengths, greedy or seeded
  sampling, streaming or not, top-20 logprobs (their fingerprint is kept);
* aborted (about 20 %): the client disconnects before the first token or
  mid-stream, or a non-streaming request is dropped by a short client timeout;
* malformed (about 5 %): a valid body with one field replaced by a value of
  the wrong type or range, the field drawn from the server's own OpenAPI schema.

Then it waits for the server to drain and replays a sample of the completed
requests one at a time. Reported: requests by outcome, 5xx answers (must be 0),
KV blocks and recurrent-state slots still held after the drain (must be 0),
the server's resident memory at start and end, and replayed requests whose
fingerprint differs from their run under load (must be 0). Exit status 1 if
any must-be-zero figure is not.

    kvwarden bench soak --model builtin:qwen3_next-tiny --requests 10000 --concurrency 32

Prints a table and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import random
import struct
import tempfile
import time
from collections import Counter
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import httpx


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="builtin:qwen3_next-tiny", help="model the soak starts a server for")
    p.add_argument("--url", help="soak a running server instead (its /metrics must be kvwarden's)")
    p.add_argument("--requests", type=int, default=10_000, help="requests in all")
    p.add_argument("--concurrency", type=int, default=32, help="requests in flight")
    p.add_argument("--max-seconds", type=float, default=3600, help="stop sending after this long")
    p.add_argument("--replays", type=int, default=100, help="completed requests replayed alone afterwards")
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument("--vocab", type=int, default=1000, help="token ids are drawn below this")
    return p.parse_args()


def fingerprint(choice: dict[str, Any], streamed: list[dict[str, Any]] | None = None) -> str:
    """SHA-256 over every generated token's top-20 (token, logprob) pairs."""
    tops = []
    for top in (choice.get("logprobs") or {}).get("top_logprobs") or []:
        tops.extend(sorted(top.items()))
    for chunk in streamed or []:
        for top in (chunk.get("logprobs") or {}).get("top_logprobs") or []:
            tops.extend(sorted(top.items()))
    h = hashlib.sha256()
    for token, logprob in tops:
        h.update(token.encode() + struct.pack("<d", logprob))
    return h.hexdigest()


def body_for(rng: random.Random, vocab: int, model: str) -> dict[str, Any]:
    seeded = rng.random() < 0.5
    body: dict[str, Any] = {
        "model": model,
        "prompt": [rng.randrange(3, vocab) for _ in range(rng.randint(4, 200))],
        "max_tokens": rng.randint(1, 48),
        "logprobs": 20,
        "return_tokens_as_token_ids": True,
        "ignore_eos": rng.random() < 0.5,
        "stream": rng.random() < 0.5,
    }
    if seeded:
        body |= {"temperature": 0.8, "top_p": rng.choice([1.0, 0.9]), "top_k": rng.choice([0, 40])}
        body["seed"] = rng.randrange(10**6)
    else:
        body["temperature"] = 0.0
    return body


def malformed(rng: random.Random, body: dict[str, Any], fields: list[str]) -> dict[str, Any] | bytes:
    """One field of a valid body replaced by a wrong type or an out-of-range value (or broken JSON)."""
    if rng.random() < 0.1:
        return json.dumps(body).encode()[: rng.randint(1, 40)]
    field = rng.choice(fields)
    return {**body, field: rng.choice(["x", -1, 10**12, [], {"a": 1}, None, 1.5, True])}


async def run_one(
    client: httpx.AsyncClient, url: str, kind: str, payload: Any, rng: random.Random
) -> tuple[str, dict[str, Any] | None]:
    """(outcome, completed response as {'choice', 'streamed'} or None)."""
    try:
        if isinstance(payload, bytes):
            resp = await client.post(url, content=payload, headers={"content-type": "application/json"})
            return _status(resp.status_code), None
        if kind == "abort" and not payload.get("stream"):
            try:
                await client.post(url, json=payload, timeout=rng.uniform(0.001, 0.05))
            except httpx.TimeoutException:
                return "aborted by client timeout", None
            return "completed-before-abort", None
        if payload.get("stream"):
            async with client.stream("POST", url, json=payload) as resp:
                if resp.status_code != 200:
                    await resp.aread()
                    return _status(resp.status_code), None
                chunks: list[dict[str, Any]] = []
                stop_after = rng.randint(-1, 3) if kind == "abort" else None
                if stop_after == -1:
                    return "aborted before the first token", None  # headers only: the stream has not started
                async for line in resp.aiter_lines():
                    if stop_after is not None and len(chunks) >= stop_after:
                        return "aborted mid-stream", None  # leaving the block closes the connection
                    if line.startswith("data: ") and line != "data: [DONE]":
                        event = json.loads(line[6:])
                        if "error" in event:
                            return "stream-error", None
                        chunks.extend(event["choices"])
                return "completed", {"streamed": chunks}
        resp = await client.post(url, json=payload)
        if resp.status_code != 200:
            return _status(resp.status_code), None
        return "completed", {"choice": resp.json()["choices"][0]}
    except httpx.HTTPError as exc:
        return f"client-error:{type(exc).__name__}", None


def _status(code: int) -> str:
    return "5xx" if code >= 500 else f"{code}"


async def soak(args: argparse.Namespace, url: str) -> dict[str, Any]:
    rng = random.Random(args.seed)
    limits = httpx.Limits(max_connections=args.concurrency * 2)
    async with AsyncExitStack() as stack:
        client = await stack.enter_async_context(httpx.AsyncClient(timeout=120, limits=limits))
        model = (await client.get(f"{url}/v1/models")).json()["data"][0]["id"]
        schema = (await client.get(f"{url}/openapi.json")).json()
        props = schema["components"]["schemas"]["CompletionRequest"]["properties"]
        fields = sorted(set(props) - {"model", "prompt"})
        sem = asyncio.Semaphore(args.concurrency)
        outcomes: Counter[str] = Counter()
        done: list[tuple[dict[str, Any], str]] = []
        start = time.monotonic()

        async def task(i: int) -> None:
            r = random.Random(args.seed * 1_000_003 + i)
            body = body_for(r, args.vocab, model)
            roll = r.random()
            kind = "abort" if roll < 0.20 else "malformed" if roll < 0.25 else "normal"
            payload = malformed(r, body, fields) if kind == "malformed" else body
            async with sem:
                if time.monotonic() - start > args.max_seconds:
                    outcomes["not-sent (time bound)"] += 1
                    return
                outcome, result = await run_one(client, f"{url}/v1/completions", kind, payload, r)
            outcomes[f"{kind}: {outcome}"] += 1
            if result is not None and kind == "normal":
                done.append((body, fingerprint(result.get("choice") or {}, result.get("streamed"))))

        await asyncio.gather(*(task(i) for i in range(args.requests)))
        elapsed = time.monotonic() - start
        drained = await _drain(client, url)
        replays = rng.sample(done, min(args.replays, len(done)))
        differing = 0
        for body, fp in replays:
            outcome, result = await run_one(client, f"{url}/v1/completions", "normal", body, rng)
            if outcome != "completed" or fingerprint(result.get("choice") or {}, result.get("streamed")) != fp:
                differing += 1
        return {
            "requests": args.requests,
            "concurrency": args.concurrency,
            "seconds": round(elapsed, 1),
            "outcomes": dict(sorted(outcomes.items())),
            "5xx": sum(n for k, n in outcomes.items() if k.endswith("5xx")),
            "leaked_kv_blocks": drained["kvwarden:kv_blocks_used"],
            "leaked_state_slots": drained["kvwarden:state_slots_used"],
            "requests_left_running": drained["kvwarden:num_requests_running"]
            + drained["kvwarden:num_requests_waiting"],
            "replayed": len(replays),
            "replays_differing": differing,
        }


async def _drain(client: httpx.AsyncClient, url: str, timeout: float = 60) -> dict[str, float]:
    """Metrics once nothing runs (aborts are processed between engine steps)."""
    names = ("kvwarden:kv_blocks_used", "kvwarden:state_slots_used", "kvwarden:num_requests_running",
             "kvwarden:num_requests_waiting")  # fmt: skip
    deadline = time.monotonic() + timeout
    while True:
        text = (await client.get(f"{url}/metrics")).text
        values = {n: 0.0 for n in names}
        for line in text.splitlines():
            name, _, value = line.partition(" ")
            if name in values:
                values[name] = float(value)
        if all(v == 0 for v in values.values()) or time.monotonic() > deadline:
            return values
        await asyncio.sleep(0.2)


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def summarize(figures: dict[str, Any]) -> list[tuple[str, str]]:
    """One (label, value) pair per headline figure: outcomes, the must-be-zero counts, the server's memory."""
    zero = ("5xx", "leaked_kv_blocks", "leaked_state_slots", "requests_left_running", "replays_differing")
    out = [
        (f"{figures['requests']} requests at concurrency {figures['concurrency']}: outcomes", str(figures["outcomes"])),
        ("must be 0: 5xx, KV, slots, running, replays", str([figures[k] for k in zero])),
    ]
    if "rss_mib_start" in figures:
        out.append(("server RSS MiB (start, end)", f"{figures['rss_mib_start']} {figures['rss_mib_end']}"))
    return out


def main() -> int:
    args = parse()
    if args.url:
        result = asyncio.run(soak(args, args.url.rstrip("/")))
    else:
        from kvwarden.bench.launch import kvwarden_servers
        from kvwarden.probe.launchers import ServerSettings

        extra = ("--max-num-seqs", str(args.concurrency), "--max-waiting", str(4 * args.concurrency))
        settings = ServerSettings(extra_args=(*extra, "--disable-log-requests"))
        with tempfile.TemporaryDirectory() as tmp, kvwarden_servers(args.model, {"soak": settings}, Path(tmp)) as srv:
            server = srv["soak"]
            rss_start = rss_mib(server.process.pid)
            result = asyncio.run(soak(args, server.url))
            result["rss_mib_start"] = round(rss_start, 1)
            result["rss_mib_end"] = round(rss_mib(server.process.pid), 1)
    zero = ("5xx", "leaked_kv_blocks", "leaked_state_slots", "requests_left_running", "replays_differing")
    print(f"Soak: {result['requests']} requests at concurrency {result['concurrency']} in {result['seconds']} s")
    print("| outcome | requests |\n|---|---|")
    for outcome, n in result["outcomes"].items():
        print(f"| {outcome} | {n} |")
    print("| must be zero | value |\n|---|---|")
    for key in zero:
        print(f"| {key} | {result[key]} |")
    if "rss_mib_start" in result:
        print(f"server RSS: {result['rss_mib_start']} MiB at start, {result['rss_mib_end']} MiB at end")
    result["ok"] = all(result[k] == 0 for k in zero)
    print(json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
