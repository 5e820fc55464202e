"""Where draft tokens come from: the proposer seam and the n-gram (prompt lookup) proposer.

A proposer is asked once per engine step, after sampling, for the requests
that will decode next: it sets ``Request.spec_token_ids``. What it proposes can
change how many tokens a step emits, never which tokens (see
:mod:`kvwarden.engine.spec.verify`). The draft-model and MTP proposers live in
their own modules; :func:`make_proposer` is the one place that knows them all.
"""

from __future__ import annotations

from typing import Protocol

from kvwarden.config import SpeculativeConfig
from kvwarden.engine.model_runner import StepLogits
from kvwarden.engine.request import Request
from kvwarden.engine.scheduler import SchedulerOutput
from kvwarden.engine.spec.target import EngineFactory, SpecTarget


class Proposer(Protocol):
    def propose(self, sched: SchedulerOutput, step: StepLogits, ready: list[tuple[Request, int]]) -> None:
        """Set ``spec_token_ids`` (at most the paired count) for each ready request.

        Args:
            sched: the step that just ran (the MTP head reads every row of it).
            step: its logits and hidden states.
            ready: requests that decode next, each with the most drafts it may take.
        """
        ...

    def release(self, request_id: str) -> None:
        """Forget a finished or aborted request."""
        ...


class NgramProposer:
    """Prompt lookup: find the latest earlier occurrence of the request's last n tokens, propose what followed.

    n runs from ``prompt_lookup_max`` down to ``prompt_lookup_min``; the first n
    with a match wins (vLLM's n-gram proposer, with the most recent match).
    """

    def __init__(self, lookup_min: int, lookup_max: int) -> None:
        self.lookup_min = lookup_min
        self.lookup_max = lookup_max

    def propose(self, sched: SchedulerOutput, step: StepLogits, ready: list[tuple[Request, int]]) -> None:
        for req, k in ready:
            drafts = self.lookup(req.all_token_ids, k)
            if req.grammar is not None and drafts:  # a draft the grammar refuses could never be accepted
                drafts = drafts[: req.grammar.valid_prefix(drafts)]
            req.spec_token_ids = drafts

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        total = len(tokens)
        for n in range(min(self.lookup_max, total - 1), self.lookup_min - 1, -1):
            suffix = tokens[total - n :]
            # latest start i < total - n with tokens[i : i + n] == suffix
            for i in range(total - n - 1, -1, -1):
                if tokens[i : i + n] == suffix:
                    return tokens[i + n : i + n + k]
        return []

    def release(self, request_id: str) -> None:
        return None


def make_proposer(spec: SpeculativeConfig, engine: SpecTarget, make_engine: EngineFactory) -> Proposer:
    """The proposer a speculative config names, built against the target engine."""
    if spec.method == "ngram":
        return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
    if spec.method == "draft":
        from kvwarden.engine.spec.draft import DraftModelProposer

        return DraftModelProposer(spec, engine, make_engine)
    from kvwarden.engine.spec.mtp import MtpProposer

    return MtpProposer(engine)
