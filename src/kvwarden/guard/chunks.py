"""Reading and rewriting the backend's streamed chunks.

The guard always asks the backend to stream (so it can stop a bad generation
early) with usage in the last chunk, and asks for chosen-token logprobs when the
client did not (the token count and the garbage monitor need them). What the
guard added is stripped before the client sees it: the client gets what it
asked for, no more.
"""

from __future__ import annotations

import json
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any, Literal

from kvwarden.guard.monitors import ChoiceWatch
from kvwarden.server.protocol import ApiError

Kind = Literal["completions", "chat"]
FINISH_ABORT = "guard_abort"  # finish_reason (and error type) of a stream the guard ended


@dataclass(frozen=True)
class Upstream:
    """The body sent to the backend and what the guard added to it."""

    body: dict[str, Any]
    added_logprobs: bool
    added_usage: bool
    client_streams: bool


def prepare(body: dict[str, Any], kind: Kind, want_logprobs: bool) -> Upstream:
    """The backend's request: streaming, usage at the end, chosen-token logprobs when ``want_logprobs``."""
    out = dict(body)
    client_streams = bool(body.get("stream"))
    options = body.get("stream_options") if client_streams else None
    asked_usage = isinstance(options, dict) and bool(options.get("include_usage"))
    out["stream"] = True
    out["stream_options"] = {**(options if isinstance(options, dict) else {}), "include_usage": True}
    added = False
    if want_logprobs:
        if kind == "completions" and body.get("logprobs") is None:
            out["logprobs"] = 0  # the chosen token's logprob only
            added = True
        elif kind == "chat" and not body.get("logprobs"):
            out["logprobs"] = True
            out.pop("top_logprobs", None)
            added = True
    return Upstream(
        out, added_logprobs=added, added_usage=client_streams and not asked_usage, client_streams=client_streams
    )


def sse_events(line: str) -> dict[str, Any] | str | None:
    """One SSE line: the JSON payload, ``"[DONE]"``, or ``None`` for anything else (comments, blanks)."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if data == "[DONE]":
        return data
    try:
        payload = json.loads(data)
    except ValueError:
        return None
    return payload if isinstance(payload, dict) else None


def _tokens(logprobs: Any, kind: Kind) -> tuple[list[Hashable], list[float]]:
    """Token identities and chosen-token logprobs from either logprobs shape."""
    if not isinstance(logprobs, dict):
        return [], []
    if isinstance(logprobs.get("content"), list):
        entries = [e for e in logprobs["content"] if isinstance(e, dict)]
        tokens: list[Hashable] = [e.get("id", e.get("token")) for e in entries]
        return tokens, [float(e["logprob"]) for e in entries if isinstance(e.get("logprob"), (int, float))]
    tokens = list(logprobs.get("tokens") or [])
    values = [float(v) for v in logprobs.get("token_logprobs") or [] if isinstance(v, (int, float))]
    return tokens, values


def _text(choice: dict[str, Any], kind: Kind) -> str:
    if kind == "completions":
        return choice.get("text") or ""
    delta = choice.get("delta") or {}
    return delta.get("content") or ""


def observe(chunk: dict[str, Any], watches: dict[int, ChoiceWatch], kind: Kind) -> None:
    """Update each choice's watch with what this chunk adds."""
    for choice in chunk.get("choices") or []:
        if not isinstance(choice, dict):
            continue
        watch = watches.setdefault(int(choice.get("index", 0)), ChoiceWatch())
        tokens, logprobs = _tokens(choice.get("logprobs"), kind)
        if tokens:
            watch.tokens.extend(tokens)
            watch.logprobs.extend(logprobs)
            watch.num_tokens += len(tokens)
        else:
            text = _text(choice, kind)
            if text:  # no logprobs from this backend: a chunk stands for a token
                watch.tokens.append(text)
                watch.num_tokens += 1
        # kvwarden: per-choice ``spec_decoding``; SGLang: ``spec_accept_length`` / ``spec_accept_rate``.
        spec = choice.get("spec_decoding")
        if isinstance(spec, dict) and spec.get("num_drafts"):
            watch.accept_length = float(spec["accept_length"])
            watch.accept_rate = float(spec["accept_rate"])
        elif isinstance(choice.get("spec_accept_length"), (int, float)):
            watch.accept_length = float(choice["spec_accept_length"])
            rate = choice.get("spec_accept_rate")
            watch.accept_rate = float(rate) if isinstance(rate, (int, float)) else None
        if choice.get("finish_reason") is not None:
            watch.finished = True


def for_client(chunk: dict[str, Any], upstream: Upstream) -> dict[str, Any] | None:
    """The chunk as the client asked for it (``None``: drop it, it only carries what the guard asked for)."""
    if upstream.added_usage and not chunk.get("choices"):
        return None  # the usage-only last chunk
    if upstream.added_usage and "usage" in chunk:
        chunk = {k: v for k, v in chunk.items() if k != "usage"}
    if upstream.added_logprobs:
        chunk = dict(chunk)
        chunk["choices"] = [{**c, "logprobs": None} for c in chunk.get("choices") or []]
    return chunk


def abort_chunks(head: dict[str, Any], kind: Kind, watches: dict[int, ChoiceWatch]) -> list[dict[str, Any]]:
    """One last chunk per unfinished choice, with ``finish_reason: "guard_abort"``."""
    ids = {"id": head.get("id", ""), "created": head.get("created", 0), "model": head.get("model", "")}
    chunks = []
    for index, watch in sorted(watches.items()):
        if watch.finished:
            continue
        if kind == "completions":
            choice = {"index": index, "text": "", "logprobs": None, "finish_reason": FINISH_ABORT}
            chunks.append({**ids, "object": "text_completion", "choices": [choice]})
        else:
            choice = {"index": index, "delta": {}, "logprobs": None, "finish_reason": FINISH_ABORT}
            chunks.append({**ids, "object": "chat.completion.chunk", "choices": [choice]})
    return chunks


def error_event(message: str, code: str) -> dict[str, Any]:
    """The SSE error event that ends a stream the guard stopped (the ``openai`` client raises on it)."""
    return ApiError(502, message, None, code, FINISH_ABORT).body()
