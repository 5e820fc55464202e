"""Built-in probe scenarios: contamination, batch, budget, spec, topk, repeat (docs/production-story.md §2).

``topk`` is the batch scenario aimed at sparse attention's key selection (GLM-5, DeepSeek-V3.2): B alone,
then B among concurrent requests, at temperature 0. A selection kernel that keeps equal scores in thread
arrival order makes B's answer follow its batch partners (the first incident, docs/sparse-attention.md).

Prompts are built from the bundled documents. With a tokenizer (the served
model's, when the probe knows it) prompts are token-id lists of exact lengths,
so the block arithmetic of a scheduling rule can be aimed at; without one they
are text of about that many words.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvwarden.models.bundled import documents
from kvwarden.models.tokenizer import Tokenizer
from kvwarden.probe.launchers import ServerSettings
from kvwarden.probe.scenario import Arm, Request, Scenario, Step

BUILTINS = ("contamination", "batch", "budget", "spec", "topk", "repeat")


@dataclass(frozen=True)
class Shape:
    """Lengths (tokens with a tokenizer, words without) of the built-in requests."""

    a_len: int = 28
    b_len: int = 44
    shared: int = 24
    document: int = 3  # bundled document the shared prefix comes from
    other: int = 7  # bundled document B continues with


def _pieces(tokenizer: Tokenizer | None, number: int) -> list[int] | list[str]:
    doc = next(d for d in documents() if d.number == number)
    return tokenizer.encode(doc.text) if tokenizer is not None else doc.text.split()


def _join(pieces: list) -> str | list[int]:
    return pieces if pieces and isinstance(pieces[0], int) else " ".join(pieces)


def prompts(shape: Shape, tokenizer: Tokenizer | None) -> tuple[str | list[int], str | list[int]]:
    """A = the document's first ``a_len``; B = its first ``shared`` + another document, ``b_len`` in all."""
    if not 0 < shape.shared <= min(shape.a_len, shape.b_len):
        raise ValueError(f"--shared must be in (0, min(--a-len, --b-len)], got {shape.shared}")
    doc = _pieces(tokenizer, shape.document)
    other = _pieces(tokenizer, shape.other)
    if max(shape.a_len, shape.shared) > len(doc) or shape.b_len - shape.shared > len(other):
        raise ValueError(f"lengths exceed the bundled documents ({len(doc)} and {len(other)} pieces)")
    a = doc[: shape.a_len]
    b = doc[: shape.shared] + other[: shape.b_len - shape.shared]
    return _join(a), _join(b)


def build(
    name: str,
    base: ServerSettings,
    tokenizer: Tokenizer | None = None,
    shape: Shape | None = None,
    repeats: int = 5,
    max_tokens: int = 8,
    budgets: tuple[int, int] = (32, 512),
    noise: int = 6,
    ignore_eos: bool = False,
) -> Scenario:
    """A built-in scenario by name (see :data:`BUILTINS`)."""
    if name not in BUILTINS:
        raise ValueError(f"--scenario: unknown built-in {name!r}; expected one of {BUILTINS} or a .yaml/.toml file")
    if repeats < 2:
        raise ValueError("--repeats must be >= 2 (stability needs at least two runs)")
    shape = shape or Shape()
    a, b = prompts(shape, tokenizer)
    requests = {"A": Request("A", a), "B": Request("B", b)}
    b_runs = Step("B", repeats)
    if name == "contamination":
        arms = (
            Arm("clean", (b_runs,), base),
            Arm("contaminated", (Step("A"), b_runs), base),
            Arm("no-cache", (b_runs,), base.replace(prefix_caching=False)),
        )
        compare: tuple[str, ...] = ("clean", "contaminated")
    elif name in ("batch", "topk"):
        arms = (Arm("alone", (b_runs,), base), Arm("among-noise", (Step("B", repeats, concurrent_noise=noise),), base))
        compare = ("alone", "among-noise")
    elif name == "budget":
        arms = tuple(Arm(f"budget-{x}", (b_runs,), base.replace(max_num_batched_tokens=x)) for x in budgets)
        compare = tuple(arm.name for arm in arms)
    elif name == "spec":
        arms = (
            Arm("spec-off", (b_runs,), base.replace(speculative=False)),
            Arm("spec-on", (b_runs,), base.replace(speculative=True)),
        )
        compare = ("spec-off", "spec-on")
    else:
        arms = (Arm("repeat", (b_runs,), base),)
        compare = ()
    notes = {"shape": shape.__dict__, "token_prompts": tokenizer is not None}
    return Scenario(name, requests, arms, max_tokens, 20, compare, notes, ignore_eos)


def noise_prompts(count: int, tokenizer: Tokenizer | None, length: int = 40) -> list[str | list[int]]:
    """Unrelated prompts for batch partners."""
    out = []
    docs = documents()
    for i in range(count):
        pieces = _pieces(tokenizer, docs[(i + 9) % len(docs)].number)
        start = (i * 37) % max(1, len(pieces) - length)
        out.append(_join(pieces[start : start + length + i]))
    return out
