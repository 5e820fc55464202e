"""The disaggregated abort race, measured: many requests, aborts at random moments, every answer checked.

A campaign sends ``requests`` completions to a decode instance (each naming a
prefill instance), a share of them abandoned by the client after a random
delay, so aborts fall before the transfer, during it and after it (the decode
instance counts which). Every request that completes is compared with the
same request's answer from a single server, run cold, by the fingerprint of
its top-k logprob lists (:mod:`kvwarden.probe.fingerprint`); a mismatch is a
corruption. Afterwards both instances' pools must return to their baseline:
no block held, none quarantined.

Used by ``tests/test_pd.py`` (a CI-sized campaign, with and without the abort
handshake) and ``kvwarden bench pd_faults`` (1,000 requests).
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvwarden.probe.client import parse_logprobs
from kvwarden.probe.fingerprint import fingerprint


@dataclass(frozen=True)
class CampaignConfig:
    """What a campaign sends (defaults: the CI size on llama-tiny)."""

    requests: int = 200
    concurrency: int = 12
    abort_share: float = 0.5  # requests the client abandons
    abort_window_s: float = 0.4  # an abandoned request is cut after a uniform delay in [0, window]
    distinct_prompts: int = 16
    min_prompt: int = 20
    max_prompt: int = 80
    vocab: int = 1000
    max_tokens: int = 24
    top_k: int = 20
    seed: int = 0


@dataclass
class CampaignResult:
    sent: int = 0
    completed: int = 0
    abandoned: int = 0  # cut by the client
    failed: int = 0  # answered with an error
    corrupted: int = 0  # completed, but not equal to the single server's cold answer
    seconds: float = 0.0
    decode: dict[str, Any] = field(default_factory=dict)  # decode /pd/v1/stats after the campaign
    prefill: dict[str, Any] = field(default_factory=dict)
    pools_at_baseline: bool = False
    errors: list[str] = field(default_factory=list)  # the first few error bodies
    corruptions: list[str] = field(default_factory=list)  # the first few corrupted answers, described

    def summary(self) -> dict[str, Any]:
        keys = ("aborts_before", "aborts_during", "aborts_after", "handshakes", "unsafe_frees", "done", "failed")
        return {
            "sent": self.sent,
            "completed": self.completed,
            "abandoned": self.abandoned,
            "failed": self.failed,
            "corrupted": self.corrupted,
            "seconds": round(self.seconds, 1),
            "pools_at_baseline": self.pools_at_baseline,
            **{f"decode_{k}": self.decode.get(k) for k in keys},
        }


def make_prompts(cfg: CampaignConfig) -> list[tuple[list[int], dict[str, Any]]]:
    """Distinct (prompt, sampling) pairs: half greedy, half seeded; some share a prefix (prefix-cache hits)."""
    rng = random.Random(cfg.seed)
    shared = [rng.randrange(3, cfg.vocab) for _ in range(cfg.min_prompt + 16)]
    out = []
    for i in range(cfg.distinct_prompts):
        n = rng.randint(cfg.min_prompt, cfg.max_prompt)
        body = [rng.randrange(3, cfg.vocab) for _ in range(n)]
        prompt = shared[: rng.randint(8, len(shared))] + body if i % 3 == 0 else body
        sampling = {"temperature": 0.0} if i % 2 == 0 else {"temperature": 0.8, "seed": 1000 + i}
        out.append((prompt, sampling))
    return out


def _body(model: str, prompt: list[int], sampling: dict[str, Any], cfg: CampaignConfig) -> dict[str, Any]:
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": cfg.max_tokens,
        "logprobs": cfg.top_k,
        "ignore_eos": True,
        "return_tokens_as_token_ids": True,
        **sampling,
    }


def _fingerprint(data: dict[str, Any]) -> str:
    tokens, tops = parse_logprobs(data["choices"][0]["logprobs"])
    return fingerprint([[(int(t), v) for t, v in top] for top in tops]).ordered + str(tokens)


async def references(single_url: str, model: str, cfg: CampaignConfig) -> list[str]:
    """Each distinct request's fingerprint on a single server, run cold and alone."""
    out = []
    async with httpx.AsyncClient(timeout=120) as http:
        for prompt, sampling in make_prompts(cfg):
            r = await http.post(f"{single_url}/v1/completions", json=_body(model, prompt, sampling, cfg))
            r.raise_for_status()
            out.append(_fingerprint(r.json()))
    return out


async def run_campaign(
    decode_url: str, prefill_url: str, model: str, refs: list[str], cfg: CampaignConfig, progress: Any = None
) -> CampaignResult:
    """Send the campaign; count completions, abandons, errors and corruptions; check both pools after."""
    prompts = make_prompts(cfg)
    rng = random.Random(cfg.seed + 1)
    plan = [(rng.randrange(len(prompts)), rng.random() < cfg.abort_share, rng.uniform(0, cfg.abort_window_s))
            for _ in range(cfg.requests)]  # fmt: skip
    result = CampaignResult()
    gate = asyncio.Semaphore(cfg.concurrency)
    started = time.perf_counter()

    async def one(http: httpx.AsyncClient, index: int, abandon: bool, after: float) -> None:
        prompt, sampling = prompts[index]
        body = {**_body(model, prompt, sampling, cfg), "kv_transfer_params": {"prefill_url": prefill_url}}
        async with gate:
            result.sent += 1
            call = http.post(f"{decode_url}/v1/completions", json=body)
            try:
                r = await (asyncio.wait_for(call, after) if abandon else call)
            except TimeoutError:
                result.abandoned += 1  # the connection is closed: the decode instance aborts the request
                return
            if r.status_code != 200:
                result.failed += 1
                if len(result.errors) < 5:
                    result.errors.append(f"HTTP {r.status_code}: {r.text[:200]}")
                return
            result.completed += 1
            data = r.json()
            if _fingerprint(data) != refs[index]:
                result.corrupted += 1
                if len(result.corruptions) < 5:
                    choice = data["choices"][0]
                    n = data["usage"]["completion_tokens"]
                    result.corruptions.append(f"prompt {index}: {n} tokens, finish_reason {choice['finish_reason']}")
        if progress is not None:
            progress()

    limits = httpx.Limits(max_connections=cfg.concurrency * 2)
    async with httpx.AsyncClient(timeout=120, limits=limits) as http:
        await asyncio.gather(*(one(http, i, a, t) for i, a, t in plan))
        result.seconds = time.perf_counter() - started
        result.pools_at_baseline, result.decode, result.prefill = await _settled(http, decode_url, prefill_url)
    return result


async def _settled(http: httpx.AsyncClient, decode_url: str, prefill_url: str) -> tuple[bool, dict, dict]:
    """Wait (at most 30 s) until neither instance holds a block for any request."""
    deadline = time.monotonic() + 30.0
    while True:
        decode = (await http.get(f"{decode_url}/pd/v1/stats")).json()
        prefill = (await http.get(f"{prefill_url}/pd/v1/stats")).json()
        idle = all(pool_idle(s) for s in (decode, prefill))
        if idle or time.monotonic() > deadline:
            return idle, decode, prefill
        await asyncio.sleep(0.2)


def pool_idle(stats: dict[str, Any]) -> bool:
    """From an instance's ``/pd/v1/stats``: no request runs, waits or holds a block."""
    busy = ("running", "waiting", "remote_waiting", "detached_blocks")
    return all(stats[k] == 0 for k in busy) and stats["free_blocks"] == stats["num_blocks"]
