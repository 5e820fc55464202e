"""Seeded request streams the benchmarks share, so two scripts that say "nano-vllm's workload" mean one thing.

Token-id workloads (``uniform``, ``nano_vllm``, ``mixed``, ``shared_prefix``) draw
ids uniformly, which any model of at least that vocabulary accepts and which
no cache has seen; text workloads (``documents``, ``multi_turn``) slice the
bundled documents, so they run against a server of any tokenizer. Every
generator takes its own seed: the same arguments give the same requests on
every machine.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

FIRST_ID = 3  # ids below are special tokens (pad/bos/eos) in the bundled tokenizer


@dataclass(frozen=True)
class Request:
    """One completion to send: the prompt (token ids or text) and exactly how many tokens to generate."""

    prompt: list[int] | str
    max_tokens: int
    kind: str = ""  # a label the benchmark groups figures by ("long_prompt", "group-3", ...)


@dataclass(frozen=True)
class Conversation:
    """A multi-turn chat: user turns sent one after another, each prompt the whole history so far."""

    turns: tuple[str, ...]
    max_tokens: int


def span(text: str) -> tuple[int, int]:
    """``"MIN,MAX"`` (or ``"N"``) as an inclusive (MIN, MAX) range."""
    lo, _, hi = text.partition(",")
    low, high = int(lo), int(hi or lo)
    if not 0 < low <= high:
        raise ValueError(f"expected MIN,MAX with 0 < MIN <= MAX, got {text!r}")
    return low, high


def random_tokens(rng: random.Random, length: int, vocab: int) -> list[int]:
    """``length`` ids drawn uniformly from [FIRST_ID, vocab)."""
    return [rng.randrange(FIRST_ID, vocab) for _ in range(length)]


def uniform(
    num: int, input_len: tuple[int, int], output_len: tuple[int, int], vocab: int, seed: int = 0
) -> list[Request]:
    """Random-id prompts and output lengths, each uniform in its inclusive range."""
    rng = random.Random(seed)
    out = []
    for _ in range(num):
        n_in, n_out = rng.randint(*input_len), rng.randint(*output_len)
        out.append(Request(random_tokens(rng, n_in, vocab), n_out))
    return out


def nano_vllm(num: int = 256, max_input: int = 1024, max_output: int = 1024, vocab: int = 10_001) -> list[Request]:
    """nano-vllm's ``bench.py`` workload: 256 prompts of 100..1024 random ids, 100..1024 output tokens.

    Drawn in its order (all prompts, then all lengths) from ``random.seed(0)``, ids in
    [0, 10000] capped by ``vocab``. nano-vllm samples at temperature 0.6; the caller picks
    the sampling, the requests are the same.
    """
    rng = random.Random(0)
    top = min(10_000, vocab - 1)
    prompts = [[rng.randint(0, top) for _ in range(rng.randint(100, max_input))] for _ in range(num)]
    lengths = [rng.randint(100, max_output) for _ in range(num)]
    return [Request(p, n) for p, n in zip(prompts, lengths, strict=True)]


def mixed(
    num: int,
    long_prompt: tuple[int, int],
    short_output: int,
    short_prompt: tuple[int, int],
    long_output: int,
    vocab: int,
    rng: random.Random,
) -> list[Request]:
    """Half long prompts with short outputs (``long_prompt``), half short prompts with long generations
    (``long_gen``), shuffled: the prefill/decode interference disaggregation is meant to remove."""
    n_long = num // 2
    out = [
        Request(random_tokens(rng, rng.randint(*long_prompt), vocab), short_output, "long_prompt")
        for _ in range(n_long)
    ]
    out += [
        Request(random_tokens(rng, rng.randint(*short_prompt), vocab), long_output, "long_gen")
        for _ in range(num - n_long)
    ]
    rng.shuffle(out)
    return out


def shared_prefix(
    groups: int, per_group: int, prefix_len: int, suffix_len: int, max_tokens: int, vocab: int, seed: int = 0
) -> list[Request]:
    """``groups`` system prompts of ``prefix_len`` ids, each shared by ``per_group`` requests that add
    their own ``suffix_len`` ids; shuffled, so a group's requests arrive among the others' (the
    prefix cache's hits and the batch's composition both vary, which is what must not change answers)."""
    rng = random.Random(seed)
    prefixes = [random_tokens(rng, prefix_len, vocab) for _ in range(groups)]
    out = [
        Request(prefixes[g] + random_tokens(rng, suffix_len, vocab), max_tokens, f"group-{g}")
        for g in range(groups)
        for _ in range(per_group)
    ]
    rng.shuffle(out)
    return out


def _words() -> list[str]:
    from kvwarden.models.bundled import documents

    return " ".join(d.text for d in documents()).split()


def documents(num: int, words: tuple[int, int], output_len: tuple[int, int], seed: int = 0) -> list[Request]:
    """Text prompts: slices of the bundled documents of a word count in ``words`` (any tokenizer)."""
    rng = random.Random(seed)
    corpus = _words()
    out = []
    for _ in range(num):
        n = rng.randint(*words)
        start = rng.randrange(0, max(1, len(corpus) - n))
        out.append(Request(" ".join(corpus[start : start + n]), rng.randint(*output_len), "documents"))
    return out


def multi_turn(conversations: int, turns: int, words: int, max_tokens: int, seed: int = 0) -> list[Conversation]:
    """Chats of ``turns`` user turns of ``words`` words each (text, any tokenizer).

    The client sends turn k as the history (every earlier turn and the answer it got)
    followed by the new turn, so each turn's prompt extends the last one's: the prefix
    cache should serve all but the newest turn and the answer.
    """
    rng = random.Random(seed)
    corpus = _words()
    out = []
    for _ in range(conversations):
        starts = [rng.randrange(0, max(1, len(corpus) - words)) for _ in range(turns)]
        out.append(Conversation(tuple(" ".join(corpus[s : s + words]) for s in starts), max_tokens))
    return out
