"""A request's prompt as token ids, checked against the model and the cache before it is queued.

Checked at ``add_request`` so that a prompt the engine cannot serve is a clear
error for that request alone, never a failure inside a later step that would
take the batch's other requests with it.
"""

from __future__ import annotations

from typing import Any

from kvwarden.intmath import cdiv

Prompt = str | list[int]


class ContextLengthError(ValueError):
    """A prompt with no room left to generate within ``max_model_len`` (the server's context_length_exceeded)."""


def prompt_ids(
    prompt: Prompt, tokenizer: Any, vocab: int, max_model_len: int, block_size: int, num_blocks: int
) -> list[int]:
    """Token ids of ``prompt`` (text is encoded with ``tokenizer``), validated.

    Raises:
        ValueError: naming ``prompt`` for empty prompts, non-integer ids, ids outside
            [0, ``vocab``), prompts that leave no room to generate within ``max_model_len``,
            or prompts needing more KV blocks than the cache has.
    """
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt: must not be empty")
        ids = tokenizer.encode(prompt)
    elif isinstance(prompt, (list, tuple)):
        ids = list(prompt)
        if any(isinstance(t, bool) or not isinstance(t, int) for t in ids):
            raise ValueError("prompt: token ids must be integers")
    else:
        raise ValueError(f"prompt: expected a string or a list of token ids, got {type(prompt).__name__}")
    if not ids:
        raise ValueError("prompt: must not be empty")
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"prompt: token id {bad[0]} is outside the vocabulary [0, {vocab})")
    if len(ids) >= max_model_len:
        raise ContextLengthError(
            f"This model's maximum context length is {max_model_len} tokens; the prompt has {len(ids)}, which "
            "leaves no room to generate"
        )
    blocks = cdiv(len(ids) + 1, block_size)  # + 1: the first generated token's slot
    if blocks > num_blocks:
        raise ValueError(f"prompt: needs {blocks} KV blocks but the cache has {num_blocks}")
    return ids
