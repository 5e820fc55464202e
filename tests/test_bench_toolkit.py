"""The bench toolkit (``kvwarden.bench``: workloads, streaming client, launcher) against a real server.

``kvwarden bench online`` runs each workload against ``kvwarden serve`` on loopback and its last JSON line
is checked: every request completed, and where the workload repeats a prefix, the server's usage
reports cached tokens (the prefix cache is on by default).
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvwarden.bench import workloads
from kvwarden.bench.launch import kvwarden_servers
from kvwarden.bench.stats import latency_ms, pct
from kvwarden.bench.stream_client import completion_body, served_model, stream_completion
from kvwarden.probe.launchers import RunningServer, ServerSettings, free_port

BENCH = Path(__file__).resolve().parent.parent / "src" / "kvwarden" / "bench"
BLOCK = 16


@pytest.fixture(scope="module")
def server(llama_tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    settings = ServerSettings(block_size=BLOCK, extra_args=("--disable-log-requests",))
    run_dir = tmp_path_factory.mktemp("bench-toolkit")
    with kvwarden_servers(str(llama_tiny), {"tiny": settings}, run_dir) as started:
        yield started["tiny"]
    assert started["tiny"].process.poll() is not None, "the launcher stops what it started"


def online(url: str, *args: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-m", "kvwarden", "bench", "online", "--url", url, *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def kvwarden(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvwarden", *args], capture_output=True, text=True, timeout=120)


def test_bench_entry_point_lists_runs_and_refuses() -> None:
    listing = kvwarden("bench", "--help")
    assert listing.returncode == 0, listing.stderr
    names = re.findall(r"^  (\w+) {2,}\S", listing.stdout.split("benchmarks:", 1)[1], flags=re.M)
    for name in ("offline", "online", "invariance", "agreement", "scale", "tensor_parallel", "gpu", "soak"):
        assert name in names, f"kvwarden bench --help lists {name}"
    # every listed bench is a module of the package that runs as a program; helpers are not listed
    for name in names:
        assert 'if __name__ == "__main__":' in (BENCH / f"{name}.py").read_text(), name
    assert "stream_client" not in names and "instant" not in names
    # a bench's own flags and exit status come through
    own = kvwarden("bench", "offline", "--help")
    assert own.returncode == 0 and "kvwarden bench offline" in own.stdout and "--engines" in own.stdout, own.stderr
    missing = kvwarden("bench", "scale")
    assert missing.returncode == 2 and "--config" in missing.stderr, missing.stderr
    unknown = kvwarden("bench", "offlin")
    assert unknown.returncode == 2, unknown.stderr
    assert "NAME: unknown benchmark 'offlin'" in unknown.stderr and "offline" in unknown.stderr


def test_no_bench_patches_the_import_path() -> None:
    # the benches import each other as modules of the package (one entry point: ``kvwarden bench``)
    patched = [p.name for p in BENCH.glob("*.py") if "sys.path" in p.read_text()]
    assert not patched, f"these benches patch sys.path: {patched}"


def test_workloads_are_seeded_and_shaped() -> None:
    nano = workloads.nano_vllm(16, vocab=500)
    assert nano == workloads.nano_vllm(16, vocab=500)
    assert all(100 <= len(r.prompt) <= 1024 and 100 <= r.max_tokens <= 1024 for r in nano)
    assert all(0 <= t < 500 for r in nano for t in r.prompt)
    uni = workloads.uniform(8, (5, 9), (2, 3), 50, seed=1)
    assert uni != workloads.uniform(8, (5, 9), (2, 3), 50, seed=2)
    assert all(5 <= len(r.prompt) <= 9 and r.max_tokens in (2, 3) for r in uni)
    shared = workloads.shared_prefix(3, 4, 32, 5, 7, 100, seed=0)
    assert len(shared) == 12 and all(len(r.prompt) == 37 and r.max_tokens == 7 for r in shared)
    for g in range(3):
        mine = [r.prompt for r in shared if r.kind == f"group-{g}"]
        assert len(mine) == 4 and len({tuple(p[:32]) for p in mine}) == 1 and len({tuple(p) for p in mine}) == 4
    assert len({tuple(r.prompt[:32]) for r in shared}) == 3
    mixed = workloads.mixed(9, (40, 50), 2, (3, 5), 20, 100, __import__("random").Random(0))
    assert sorted(r.kind for r in mixed) == ["long_gen"] * 5 + ["long_prompt"] * 4
    chats = workloads.multi_turn(2, 3, 10, 4, seed=0)
    assert len(chats) == 2 and all(len(c.turns) == 3 and all(len(t.split()) == 10 for t in c.turns) for c in chats)
    docs = workloads.documents(5, (8, 12), (1, 2))
    assert all(isinstance(r.prompt, str) and 8 <= len(r.prompt.split()) <= 12 for r in docs)
    assert workloads.span("7") == (7, 7) and workloads.span("3,9") == (3, 9)
    for bad in ("9,3", "0,4", "x"):
        with pytest.raises(ValueError):
            workloads.span(bad)


def test_stats_use_nearest_rank() -> None:
    assert pct([], 50) is None and latency_ms([]) == {}
    values = [i / 1000 for i in range(100, 0, -1)]  # unsorted on purpose
    assert pct(values, 50) == 0.051 and pct(values, 99) == 0.1 and pct(values, 100) == 0.1 and pct(values, 0) == 0.001
    assert latency_ms(values) == {"mean_ms": 50.5, "p50_ms": 51.0, "p90_ms": 91.0, "p99_ms": 100.0}


def test_stream_client_times_tokens_and_reports_failures(server: RunningServer) -> None:
    async def go() -> tuple:
        async with httpx.AsyncClient(timeout=60) as client:
            model = await served_model(client, server.url)
            good = await stream_completion(client, server.url, completion_body(model, [5, 6, 7, 8], 6))
            wrong = await stream_completion(client, server.url, completion_body("no-such-model", [5, 6], 2))
            dead_url = f"http://127.0.0.1:{free_port()}"
            dead = await stream_completion(client, dead_url, completion_body(model, [5, 6], 2))
            return good, wrong, dead, dead_url

    good, wrong, dead, dead_url = asyncio.run(go())
    assert good.ok and good.output_tokens == 6 and good.prompt_tokens == 4 and good.text
    assert 1 <= len(good.chunk_times) <= 6 and good.chunk_times == sorted(good.chunk_times)
    assert 0 < good.ttft <= good.e2e and good.itl_mean is not None and good.itl_mean >= 0
    assert not wrong.ok and wrong.status == 404 and "no-such-model" in wrong.error
    assert not dead.ok and dead.status == 0 and dead_url in dead.error


def test_online_bench_runs_every_workload(server: RunningServer, measure) -> None:
    docs = online(server.url, "--num-requests", "6", "--max-concurrency", "3", "--min-output", "2", "--max-output", "5")
    assert (docs["workload"], docs["requests"], docs["completed"], docs["failed"]) == ("documents", 6, 6, 0)
    assert docs["ttft"]["p50_ms"] > 0 and docs["itl"]["p50_ms"] >= 0

    # One at a time, so every later request of a group finds its prefix's 4 full blocks cached.
    args = ["--groups", "2", "--per-group", "3", "--prefix-len", str(4 * BLOCK), "--suffix-len", "8"]
    shared = online(server.url, "--workload", "shared-prefix", *args, "--max-output", "3", "--max-concurrency", "1")
    assert shared["completed"] == shared["requests"] == 6
    assert shared["cached_tokens"] >= 2 * 2 * 4 * BLOCK

    args = ["--conversations", "2", "--turns", "3", "--turn-words", "40", "--max-output", "4", "--max-concurrency", "2"]
    chat = online(server.url, "--workload", "multi-turn", *args)
    assert chat["completed"] == chat["requests"] == 6 and chat["cached_tokens"] >= 2 * 2 * BLOCK

    nano = online(server.url, "--workload", "nano-vllm", "--num-requests", "2", "--max-concurrency", "2")
    assert nano["completed"] == 2 and nano["output_tok_s"] > 0
    measure(
        "kvwarden bench online on llama-tiny (2 cores)",
        **{w["workload"]: w["output_tok_s"] for w in (docs, shared, chat, nano)},
    )
