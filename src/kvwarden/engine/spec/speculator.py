"""The engine's speculative-decoding bookkeeping: checkpoints, commits, proposals, totals.

Verification itself (which tokens to keep) is :mod:`kvwarden.engine.spec.verify`;
this owns what happens around it: the recurrent-state checkpoint before a
verify step, how far ``num_computed_tokens`` advances after it, and asking the
proposer for the next step's drafts.
"""

from __future__ import annotations

from kvwarden.cache.state_pool import StatePool
from kvwarden.config import SpeculativeConfig
from kvwarden.engine.model_runner import StepLogits
from kvwarden.engine.request import Request
from kvwarden.engine.scheduler import ScheduledChunk, Scheduler, SchedulerOutput
from kvwarden.engine.spec.proposers import make_proposer
from kvwarden.engine.spec.target import EngineFactory, SpecTarget
from kvwarden.engine.spec_stats import SpecStats


class Speculator:
    """Speculative decoding for one engine (built only when ``speculative_config`` is set)."""

    def __init__(self, spec: SpeculativeConfig, engine: SpecTarget, make_engine: EngineFactory) -> None:
        """``make_engine`` builds a draft model's engine (the target hands in its own class)."""
        self.spec = spec
        self.scheduler: Scheduler = engine.scheduler
        self.states: StatePool | None = engine.states
        self.max_model_len = engine.max_model_len
        self.proposer = make_proposer(spec, engine, make_engine)
        self.totals = SpecStats()  # every request's, for /metrics

    def before_step(self, sched: SchedulerOutput) -> None:
        """Checkpoint the recurrent working state of every request whose chunk carries drafts."""
        if self.states is None:
            return
        self.states.checkpoint_many([c.request.request_id for c in sched.chunks if c.num_spec])

    def commit(self, chunk: ScheduledChunk, accepted: int, kept: int) -> None:
        """Record ``accepted`` drafts and advance past the ``kept`` ones (fewer when a stop cut the step).

        NOTE(invariance): the KV of accepted positions was computed from the
        tokens that stay, so it is kept; KV written for rejected positions lies
        past ``num_computed_tokens``, is never published and is overwritten. A
        recurrent state has advanced through every draft token, so after a
        rejection it returns to the step's start and the next step recomputes
        the accepted tokens (same bits, by the numerics contract).
        """
        req = chunk.request
        assert req.spec_stats is not None
        req.spec_stats.record(chunk.num_spec, accepted)
        self.totals.record(chunk.num_spec, accepted)
        if self.states is not None and kept < chunk.num_spec:
            self.states.rollback(req.request_id, chunk.start)
            self.scheduler.advance(req, chunk.start)
            return
        if self.states is not None:
            self.states.drop_checkpoint(req.request_id)
        self.scheduler.advance(req, chunk.end + kept)

    def propose(self, sched: SchedulerOutput, step: StepLogits, ready: list[Request]) -> None:
        """Ask the proposer for the next step's drafts (never more than a request may still emit)."""
        pairs = []
        for req in ready:
            room = min(
                self.spec.num_speculative_tokens,
                req.params.max_tokens - len(req.output_token_ids) - 1,
                self.max_model_len - req.num_tokens - 1,
            )
            if room > 0:
                pairs.append((req, room))
        self.proposer.propose(sched, step, pairs)
        for req, room in pairs:
            del req.spec_token_ids[room:]

    def release(self, request_id: str) -> None:
        self.proposer.release(request_id)
