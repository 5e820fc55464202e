"""A non-streaming OpenAI response put together from the backend's streamed chunks.

The guard streams from the backend even when the client did not ask to, so a
bad generation can be stopped after 128 tokens instead of after all of them;
the client still gets one JSON object, field for field what a non-streaming
request returns (text, logprobs, finish reason, usage, kvwarden's
``spec_decoding``).
"""

from __future__ import annotations

from typing import Any

from kvwarden.guard.chunks import Kind

# Per-choice fields whose last value stands (statistics are cumulative; stop_reason comes last).
_LAST_WINS = ("finish_reason", "stop_reason", "spec_decoding", "spec_accept_length", "spec_accept_rate")


def _merge_logprobs(into: dict[str, Any] | None, part: Any, kind: Kind) -> dict[str, Any] | None:
    if not isinstance(part, dict):
        return into
    if into is None:
        into = {"content": []} if kind == "chat" else {"tokens": [], "token_logprobs": [], "top_logprobs": []}
        if kind == "completions" and "text_offset" in part:
            into["text_offset"] = []
    for key, value in part.items():
        if isinstance(value, list):
            into.setdefault(key, []).extend(value)
    return into


def assemble(chunks: list[dict[str, Any]], kind: Kind) -> dict[str, Any]:
    """The non-streaming body equivalent to ``chunks`` (in order)."""
    head: dict[str, Any] = {}
    choices: dict[int, dict[str, Any]] = {}
    usage = None
    for chunk in chunks:
        for key in ("id", "created", "model", "system_fingerprint"):
            if key in chunk and key not in head:
                head[key] = chunk[key]
        if chunk.get("usage"):
            usage = chunk["usage"]
        for part in chunk.get("choices") or []:
            index = int(part.get("index", 0))
            choice = choices.setdefault(index, _empty_choice(index, kind))
            if kind == "completions":
                choice["text"] += part.get("text") or ""
            else:
                delta = part.get("delta") or {}
                choice["message"]["content"] += delta.get("content") or ""
                if delta.get("role"):
                    choice["message"]["role"] = delta["role"]
            choice["logprobs"] = _merge_logprobs(choice["logprobs"], part.get("logprobs"), kind)
            for key in _LAST_WINS:
                if part.get(key) is not None:
                    choice[key] = part[key]
    body = {
        "id": head.get("id", ""),
        "object": "text_completion" if kind == "completions" else "chat.completion",
        "created": head.get("created", 0),
        "model": head.get("model", ""),
        "choices": [choices[i] for i in sorted(choices)],
    }
    if "system_fingerprint" in head:
        body["system_fingerprint"] = head["system_fingerprint"]
    if usage is not None:
        body["usage"] = usage
    return body


def _empty_choice(index: int, kind: Kind) -> dict[str, Any]:
    # stop_reason: the stop string or token that ended the choice (vLLM's and kvwarden's field), null otherwise
    if kind == "completions":
        return {"index": index, "text": "", "logprobs": None, "finish_reason": None, "stop_reason": None}
    message = {"role": "assistant", "content": ""}
    return {"index": index, "message": message, "logprobs": None, "finish_reason": None, "stop_reason": None}
