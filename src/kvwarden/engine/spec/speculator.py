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
from kvwarden.engine.verified_states import VerifiedStates


class Speculator:
    """Speculative decoding for one engine (built only when ``speculative_config`` is set)."""

    def __init__(self, spec: SpeculativeConfig, engine: SpecTarget, make_engine: EngineFactory) -> None:
        """``make_engine`` builds a draft model's engine (the target hands in its own class)."""
        self.spec = spec
        self.scheduler: Scheduler = engine.scheduler
        self.states: StatePool | None = engine.states
        self.max_model_len = engine.max_model_len
        # The batched (GPU) kernels keep a verify step's state after every token: no checkpoint, no recompute.
        self.token_states = engine.ops.batched_recurrent
        self.proposer = make_proposer(spec, engine, make_engine)
        self.totals = SpecStats()  # every request's, for /metrics

    def before_step(self, sched: SchedulerOutput, replayed: bool = False) -> None:
        """Checkpoint the recurrent working state of every request whose chunk carries drafts (not
        needed when the step replays a verify graph: it keeps every token's state)."""
        if self.states is None or replayed or self.token_states:
            return
        self.states.checkpoint_many([c.request.request_id for c in sched.chunks if c.num_spec])

    def commit(self, chunk: ScheduledChunk, accepted: int, kept: int, verified: VerifiedStates | None = None) -> None:
        """Record ``accepted`` drafts and advance past the ``kept`` ones (fewer when a stop cut the step).

        NOTE(invariance): the KV of accepted positions was computed from the
        tokens that stay, so it is kept; KV written for rejected positions lies
        past ``num_computed_tokens``, is never published and is overwritten. A
        recurrent state has advanced through every draft token, so after a
        rejection it returns to the state after the last kept token: in a
        verify graph (``verified``) and on the batched kernels that state was
        kept by the step; on the CPU's per-request scan it returns to the
        step's checkpoint and the next step recomputes the accepted tokens
        (same bits, by the numerics contract).
        """
        req = chunk.request
        assert req.spec_stats is not None
        req.spec_stats.record(chunk.num_spec, accepted)
        self.totals.record(chunk.num_spec, accepted)
        if verified is not None:
            verified.keep(req, chunk.start, kept)  # boundary states staged before advance() publishes them
            self.scheduler.advance(req, chunk.end + kept)
            return
        if self.states is not None and self.token_states:
            if kept < chunk.num_spec:
                self.states.return_to(req.request_id, chunk.end + kept)
            self.states.drop_tokens(req.request_id)
            self.scheduler.advance(req, chunk.end + kept)
            return
        if self.states is not None and kept < chunk.num_spec:
            self.states.rollback(req.request_id, chunk.start)
            self.scheduler.advance(req, chunk.start)
            return
        if self.states is not None:
            self.states.drop_checkpoint(req.request_id)
        self.scheduler.advance(req, chunk.end + kept)

    def propose(self, sched: SchedulerOutput, step: StepLogits, ready: list[Request]) -> None:
        """Ask the proposer for the next step's drafts (never more than a request may still emit).

        First, a verify graph's requests that rejected a draft return to their last kept token."""
        if step.verified is not None:
            step.verified.flush()
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
