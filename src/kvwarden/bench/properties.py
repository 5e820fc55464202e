"""The invariance properties (a)-(i), as one reusable check.

kvwarden's contract: the top-k logprob lists of a request are bitwise the same
however the engine got there. Each property runs the same request under one
circumstance and compares it with the reference run - cold, alone, prefix
caching off - by the IEEE-754 bytes of every (token id, logprob) pair:

(a) cold, alone (the reference itself, run twice on two engines)
(b) a repeat after its own warm-up (a prefix hit on its own blocks)
(c) after another request warmed a shared prefix that ends mid-block
(d) prefix caching on vs off (the first, cold run of an engine with caching on)
(e) other step budgets (the prompt cut into chunks of other sizes)
(f) batch partners joining while it runs
(g) preempted and recomputed (a KV pool too small for everyone)
(h) the contamination scenario: A (a prefix of the prompt, just under two
    blocks) once, then the request twice
(i) a multi-turn follow-up that reuses blocks written during decode, cold vs warm

(j) speculative decoding: all of the above with speculation on, compared with
    the reference run with speculation off (``reference=``).

Used by the CPU tests, the Triton-backend tests (under the interpreter in CI,
compiled on a GPU) and ``kvwarden bench invariance``, which also runs it with
``numerics="shape-dependent"`` to show what the fast path does.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from kvwarden.engine.outputs import RequestOutput
from kvwarden.engine.sampling_params import SamplingParams
from kvwarden.intmath import cdiv
from kvwarden.llm import LLM

PROPERTIES = ("a", "b", "c", "d", "e", "f", "g", "h", "i")
MakeLLM = Callable[..., LLM]


@dataclass
class Outcome:
    """One property's result: identical to the reference, or where and by how much it differed."""

    identical: bool
    first_divergent_token: int | None = None
    max_abs_diff: float = 0.0
    note: str = ""


@dataclass
class PropertyReport:
    outcomes: dict[str, Outcome] = field(default_factory=dict)

    @property
    def all_identical(self) -> bool:
        return all(o.identical for o in self.outcomes.values())

    def failures(self) -> dict[str, Outcome]:
        return {k: o for k, o in self.outcomes.items() if not o.identical}

    def to_dict(self) -> dict[str, Any]:
        return {k: asdict(o) for k, o in self.outcomes.items()}


def compare(ref: RequestOutput, other: RequestOutput, note: str = "") -> Outcome:
    """Bitwise comparison of token ids and top-k lists (floats by their bytes)."""
    a, b = ref.logprobs or [], other.logprobs or []
    first, worst = None, 0.0
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        bx = [(t, struct.pack("<d", v)) for t, v in x]
        by = [(t, struct.pack("<d", v)) for t, v in y]
        if bx != by:
            first = i if first is None else first
            dy = dict(y)
            worst = max([worst] + [abs(v - dy[t]) for t, v in x if t in dy])
    if first is None and (ref.token_ids != other.token_ids or len(a) != len(b)):
        pairs = enumerate(zip(ref.token_ids, other.token_ids, strict=False))
        first = next((i for i, (s, t) in pairs if s != t), min(len(ref.token_ids), len(other.token_ids)))
    return Outcome(first is None, first, worst, note)


def check_properties(
    make: MakeLLM,
    prompt: list[int],
    params: SamplingParams,
    block_size: int,
    partners: list[list[int]],
    only: tuple[str, ...] = PROPERTIES,
    reference: RequestOutput | None = None,
) -> PropertyReport:
    """Run the chosen properties for one prompt; ``make(**overrides)`` builds an engine.

    ``prompt`` should be longer than two blocks; ``partners`` are unrelated
    prompts used as batch partners and to fill the pool in (g). ``reference``
    replaces the cold run of ``make`` as what every run must equal (property
    (j): ``make`` speculates, the reference does not).
    """
    report = PropertyReport()
    ref = reference or make(enable_prefix_caching=False).generate([prompt], params)[0]

    def record(name: str, out: RequestOutput, note: str = "") -> None:
        if name in only:
            report.outcomes[name] = compare(ref, out, note)

    if "a" in only:
        record("a", make(enable_prefix_caching=False).generate([prompt], params)[0], "a second cold engine")
    if {"b", "d"} & set(only):
        llm = make()
        first = llm.generate([prompt], params)[0]
        record("d", first, "caching on, cold")
        again = llm.generate([prompt], params)[0]
        record("b", again, f"cached {again.num_cached_tokens} tokens")
    if "c" in only:
        llm = make()
        shared = block_size + block_size // 2 + 1  # ends mid-block
        llm.generate([prompt[:shared] + partners[0][:5]], _partner_params(0))
        out = llm.generate([prompt], params)[0]
        record("c", out, f"cached {out.num_cached_tokens} tokens")
    if "e" in only:
        for budget in (max(1, block_size // 2 - 1), 3 * block_size + 1):
            out = make(max_num_batched_tokens=budget).generate([prompt], params)[0]
            record("e", out, f"budget {budget}")
            if not report.outcomes["e"].identical:
                break
    if "f" in only:
        record("f", _with_partners(make(), prompt, params, partners), f"{len(partners)} partners")
    if "g" in only:
        record("g", *_preempted(make, prompt, params, partners, block_size))
    if "h" in only:
        llm = make()
        llm.generate([prompt[: 2 * block_size - 2]], _partner_params(1))  # A: just under two blocks
        outs = [llm.generate([prompt], params)[0] for _ in range(2)]
        bad = next((o for o in outs if not compare(ref, o).identical), outs[-1])
        record("h", bad, f"A then B twice; cached {[o.num_cached_tokens for o in outs]}")
    if "i" in only:
        follow = prompt + ref.token_ids + partners[1][:7]
        cold = make(enable_prefix_caching=False).generate([follow], params)[0]
        llm = make()
        llm.generate([prompt], params)
        warm = llm.generate([follow], params)[0]
        report.outcomes["i"] = compare(cold, warm, f"follow-up cached {warm.num_cached_tokens} tokens")
    return report


def _partner_params(i: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=1000 + i, max_tokens=3, logprobs=2, ignore_eos=True)


def _with_partners(llm: LLM, prompt: list[int], params: SamplingParams, partners: list[list[int]]) -> RequestOutput:
    """The request runs while partners join at different steps (stepping API)."""
    engine = llm.engine
    target = engine.add_request(prompt, params)
    result, step, pending = None, 0, list(enumerate(partners))
    while result is None:
        if pending and step % 2 == 0:
            i, p = pending.pop(0)
            engine.add_request(p, _partner_params(i))
        for out in engine.step():
            if out.request_id == target and out.finished:
                result = out
        step += 1
        if step > 10_000:
            raise RuntimeError("the request never finished")
    while engine.has_unfinished_requests():
        engine.step()
    return result


def _preempted(
    make: MakeLLM, prompt: list[int], params: SamplingParams, partners: list[list[int]], block_size: int
) -> tuple[RequestOutput, str]:
    """The request among partners in a pool too small for all of them: someone is preempted."""
    need = cdiv(len(prompt) + (params.max_tokens or 0), block_size) + 1
    llm = make(num_blocks=need + 2, max_num_batched_tokens=4 * block_size)
    plist = [_partner_params(i) for i in range(len(partners))]
    outs = llm.generate([*partners, prompt], [*plist, params])
    return outs[-1], f"{llm.engine.scheduler.num_preemptions} preemptions"
