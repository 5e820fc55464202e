"""Running a scenario: a fresh server per arm (or a URL), one JSONL record per response.

The run directory holds ``records.jsonl`` (append-only, flushed after every
record), ``logs/`` (each server's output) and the reports. An interrupted run
resumes: arms with an ``arm_done`` record are skipped; an arm cut off half way
is run again from a fresh server (its cache history must start clean), and its
earlier partial records stay in the file under their own attempt id.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from rich.progress import Progress

from kvwarden.probe.builtin import noise_prompts
from kvwarden.probe.client import Client, ProbeError, Response
from kvwarden.probe.fingerprint import fingerprint
from kvwarden.probe.launchers import Launcher, RunningServer, ServerFailed, ServerSettings, log_tail
from kvwarden.probe.scenario import Arm, Scenario
from kvwarden.probe.server_info import discover

CACHED_METRICS = ("kvwarden:prefix_cache_hits_total", "vllm:prefix_cache_hits_total")


@dataclass
class Target:
    """Where requests go: a launcher + model (fresh server per arm) or a running URL."""

    launcher: Launcher | None = None
    model: str | None = None
    url: str | None = None
    served_name: str | None = None
    api_key: str | None = None
    tokenizer: Any = None  # for noise prompts in the model's own tokens

    def __post_init__(self) -> None:
        if (self.launcher is None) == (self.url is None):
            raise ValueError("give either a launcher (with --model) or --url")
        if self.launcher is not None and not self.model:
            raise ValueError("--model is required with --launcher")


class RecordLog:
    """Append-only JSONL, flushed and synced per record."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)

    def read(self) -> list[dict[str, Any]]:
        if not self.path.is_file():
            return []
        out = []
        for line in self.path.read_text().splitlines():
            if line.strip():
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    continue  # a line cut by a crash; everything before it is intact
        return out

    def append(self, record: dict[str, Any]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())


def response_record(arm: str, attempt: str, step: int, run: int, measured: bool, request: str, resp: Response) -> dict:
    fp = fingerprint(resp.tops, resp.text)
    return {
        "type": "response",
        "arm": arm,
        "attempt": attempt,
        "step": step,
        "run": run,
        "measured": measured,
        "request": request,
        "fingerprint": fp.ordered,
        "fingerprint_sorted": fp.sorted,
        "text_sha256": fp.text,
        "text": resp.text,
        "tokens": resp.tokens,
        "tops": [[[k, v] for k, v in top] for top in resp.tops],
        "cached_tokens": resp.cached_tokens,
        "prompt_tokens": resp.prompt_tokens,
        # kvwarden's speculative-decoding totals for the request (None where the server reports none)
        "spec_decoding": resp.raw_usage.get("spec_decoding"),
        "latency_s": round(resp.latency_s, 4),
    }


@contextmanager
def serve_arm(
    target: Target, name: str, settings: ServerSettings, run_dir: Path, attempt: str
) -> Iterator[tuple[str, dict[str, Any], RunningServer | None]]:
    """The arm's server (fresh with a launcher), its URL and the fields every request of the arm carries."""
    if target.launcher is None:
        # A shared server: isolate arms by cache_salt (kvwarden, vLLM) so one arm's cache cannot help another.
        yield str(target.url), {"cache_salt": f"{name}-{attempt}"}, None
        return
    server = target.launcher.start(str(target.model), settings, run_dir, f"{name}-{attempt}")
    try:
        yield server.url, server.request_extra, server
    finally:
        server.stop()


def server_info(target: Target, settings: ServerSettings, url: str, server: RunningServer | None) -> dict[str, Any]:
    """What the server says it runs with (block size, budget), recorded before the first request."""
    if target.launcher is not None and server is not None:
        return target.launcher.discover(server, settings).to_dict()
    return discover(url, None, settings.block_size, settings.max_num_batched_tokens).to_dict()


# An arm's requests: (url, fields every request carries, attempt id) -> None, raising on a failed request.
ArmBody = Callable[[str, dict[str, Any], str], None]


def guarded_arm(
    name: str, settings: ServerSettings, target: Target, log: RecordLog, run_dir: Path, body: ArmBody
) -> None:
    """Run one arm on its own server: ``arm_start``, ``server_info``, the body's records, then ``arm_done``,
    or ``arm_error`` with the cause (a server that died under a request: its exit status and log tail)."""
    attempt = uuid.uuid4().hex[:8]
    log.append({"type": "arm_start", "arm": name, "attempt": attempt, "server": settings.__dict__})
    exit_code: int | None = None
    server: RunningServer | None = None
    try:
        with serve_arm(target, name, settings, run_dir, attempt) as (url, extra, server):
            try:
                info = server_info(target, settings, url, server)
                log.append({"type": "server_info", "arm": name, "attempt": attempt, "info": info})
                body(url, extra, attempt)
            except (ProbeError, httpx.HTTPError):
                # Before serve_arm stops the server: did the engine itself die under a request? A process
                # that just dropped its connections may need a moment to be reaped.
                if server is not None:
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        exit_code = server.process.wait(timeout=2)
                raise
        log.append({"type": "arm_done", "arm": name, "attempt": attempt})
    except (ServerFailed, ProbeError, httpx.HTTPError) as exc:
        error = str(exc) if isinstance(exc, ServerFailed) else f"{type(exc).__name__}: {exc}"
        if isinstance(exc, httpx.TransportError) and target.url:  # a dead --url: say which one
            error = f"{target.url}: {error}"
        if exit_code is not None:
            error = f"server exited with {exit_code} during the arm ({error})"
        tail = log_tail(server.log_path) if server is not None else ""
        log.append({"type": "arm_error", "arm": name, "attempt": attempt, "error": error, "log_tail": tail})


def run_arm(
    scenario: Scenario, arm: Arm, target: Target, log: RecordLog, run_dir: Path, progress: Progress | None
) -> None:
    def steps(url: str, extra: dict[str, Any], attempt: str) -> None:
        _run_steps(scenario, arm, target, log, attempt, url, extra, progress)

    guarded_arm(arm.name, arm.server, target, log, run_dir, steps)


def _run_steps(
    scenario: Scenario,
    arm: Arm,
    target: Target,
    log: RecordLog,
    attempt: str,
    url: str,
    extra: dict[str, Any],
    progress: Progress | None,
) -> None:
    task = progress.add_task(f"{arm.name}", total=sum(s.repeat for s in arm.steps)) if progress else None
    client = Client(url, target.api_key)
    try:
        name = target.served_name or client.model_name()
        noise_pool = noise_prompts(max(s.concurrent_noise for s in arm.steps), target.tokenizer)
        usage_has_cached = None  # unknown until the first response; else fall back to /metrics deltas
        for si, step in enumerate(arm.steps):
            prompt = scenario.requests[step.request].prompt
            for r in range(step.repeat):
                before = _cached_metric(client) if usage_has_cached is not True else None
                resp = _one(client, name, prompt, scenario, extra, step.concurrent_noise, noise_pool)
                usage_has_cached = resp.cached_tokens is not None
                if not usage_has_cached and before is not None:
                    after = _cached_metric(client)
                    resp.cached_tokens = None if after is None else int(after - before)
                measured = si == arm.measured_step
                log.append(response_record(arm.name, attempt, si, r, measured, step.request, resp))
                if progress is not None and task is not None:
                    progress.advance(task)
    finally:
        client.close()


def _cached_metric(client: Client) -> float | None:
    for name in CACHED_METRICS:
        value = client.metric(name)
        if value is not None:
            return value
    return None


def _one(
    client: Client, model: str, prompt: Any, scenario: Scenario, extra: dict, noise: int, noise_pool: list
) -> Response:
    if scenario.ignore_eos:
        extra = {**extra, "ignore_eos": True}
    if not noise:
        return client.complete(model, prompt, scenario.max_tokens, scenario.top_logprobs, extra)
    with ThreadPoolExecutor(max_workers=noise + 1) as pool:
        target = pool.submit(client.complete, model, prompt, scenario.max_tokens, scenario.top_logprobs, extra)
        others = [pool.submit(client.complete, model, p, 4 + i % 5, 1, extra) for i, p in enumerate(noise_pool[:noise])]
        result = target.result()
        for fut in others:
            fut.result()
        return result


def run_probe(scenario: Scenario, target: Target, run_dir: Path, show_progress: bool = True) -> list[dict[str, Any]]:
    """Run every arm not yet done in ``run_dir``; returns all records."""
    log = RecordLog(run_dir / "records.jsonl")
    done = {r["arm"] for r in log.read() if r.get("type") == "arm_done"}
    (run_dir / "scenario.json").write_text(json.dumps(_describe(scenario), indent=2))
    with Progress(disable=not show_progress, transient=False) as progress:
        for arm in scenario.arms:
            if arm.name not in done:
                run_arm(scenario, arm, target, log, run_dir, progress if show_progress else None)
    return log.read()


def _describe(s: Scenario) -> dict[str, Any]:
    return {
        "name": s.name,
        "max_tokens": s.max_tokens,
        "top_logprobs": s.top_logprobs,
        "requests": {
            k: (len(v.prompt) if isinstance(v.prompt, list) else v.prompt[:200]) for k, v in s.requests.items()
        },
        "arms": [
            {"name": a.name, "steps": [st.__dict__ for st in a.steps], "server": a.server.__dict__} for a in s.arms
        ],
        "compare_arms": list(s.compare_arms),
        "notes": s.notes,
    }
