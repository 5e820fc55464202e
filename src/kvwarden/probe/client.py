"""One completion against any OpenAI-compatible server, normalised for fingerprinting.

Engines disagree on how they return top logprobs: OpenAI's legacy completions
shape (``top_logprobs``: a dict per token, keyed by token text, or by
``token_id:N`` with vLLM's/kvwarden's ``return_tokens_as_token_ids``) or the
chat-style ``content`` list (llama.cpp, with token ids). Either way a response
becomes, per generated token, a list of ``(token, logprob)`` in the server's
order, where ``token`` is an int id when the server gives one.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

TokenKey = int | str
TopList = list[tuple[TokenKey, float]]


@dataclass
class Response:
    text: str
    tokens: list[TokenKey]
    tops: list[TopList]
    cached_tokens: int | None
    prompt_tokens: int | None
    latency_s: float
    raw_usage: dict[str, Any] = field(default_factory=dict)


class ProbeError(RuntimeError):
    """A server answered with an error or an unreadable body."""


_ID = re.compile(r"^token_id:(-?\d+)$")


def _key(entry_token: Any, entry_id: Any = None) -> TokenKey:
    if isinstance(entry_id, int):
        return entry_id
    if isinstance(entry_token, str):
        match = _ID.match(entry_token)
        if match:
            return int(match.group(1))
        return entry_token
    return str(entry_token)


def parse_logprobs(logprobs: Any) -> tuple[list[TokenKey], list[TopList]]:
    """Tokens and top lists from either logprobs shape."""
    if not logprobs:
        return [], []
    if isinstance(logprobs, dict) and isinstance(logprobs.get("content"), list):
        tokens, tops = [], []
        for entry in logprobs["content"]:
            tokens.append(_key(entry.get("token"), entry.get("id")))
            tops.append(
                [(_key(t.get("token"), t.get("id")), float(t["logprob"])) for t in entry.get("top_logprobs", [])]
            )
        return tokens, tops
    if isinstance(logprobs, dict) and "top_logprobs" in logprobs:
        tokens = [_key(t) for t in logprobs.get("tokens") or []]
        tops = [[(_key(k), float(v)) for k, v in (top or {}).items()] for top in logprobs["top_logprobs"]]
        return tokens, tops
    raise ProbeError(f"unrecognised logprobs object: {str(logprobs)[:200]}")


class Client:
    """Minimal synchronous OpenAI-compatible client for the probe."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 300.0) -> None:
        self.base_url = base_url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(timeout=timeout, headers=headers)

    def close(self) -> None:
        self.http.close()

    def model_name(self) -> str:
        resp = self.http.get(f"{self.base_url}/v1/models")
        resp.raise_for_status()
        return resp.json()["data"][0]["id"]

    def complete(
        self, model: str, prompt: str | list[int], max_tokens: int, top_k: int, extra: dict[str, Any] | None = None
    ) -> Response:
        body: dict[str, Any] = {
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "logprobs": top_k,
            "return_tokens_as_token_ids": True,
            **(extra or {}),
        }
        start = time.perf_counter()
        resp = self.http.post(f"{self.base_url}/v1/completions", json=body)
        latency = time.perf_counter() - start
        if resp.status_code != 200:
            raise ProbeError(f"HTTP {resp.status_code} from {self.base_url}: {resp.text[:300]}")
        try:
            data = resp.json()
            choice = data["choices"][0]
        except (ValueError, KeyError, IndexError) as exc:
            raise ProbeError(f"unreadable completion from {self.base_url}: {resp.text[:300]}") from exc
        tokens, tops = parse_logprobs(choice.get("logprobs"))
        usage = data.get("usage") or {}
        details = usage.get("prompt_tokens_details") or {}
        cached = details.get("cached_tokens")
        return Response(
            text=choice.get("text", ""),
            tokens=tokens,
            tops=tops,
            cached_tokens=int(cached) if isinstance(cached, int) else None,
            prompt_tokens=usage.get("prompt_tokens"),
            latency_s=latency,
            raw_usage=usage,
        )

    def metric(self, name: str) -> float | None:
        """A counter from ``/metrics`` (the cached-tokens fallback), or None."""
        try:
            text = self.http.get(f"{self.base_url}/metrics").text
        except httpx.HTTPError:
            return None
        total = None
        for line in text.splitlines():
            if line.startswith(name) and not line.startswith("#"):
                total = (total or 0.0) + float(line.rsplit(" ", 1)[1])
        return total
