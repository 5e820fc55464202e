"""Continuous batching with chunked prefill under a token budget.

One invariant drives everything: each scheduled request computes the next
``n`` of its tokens, ``num_computed_tokens -> num_computed_tokens + n``, until
it has computed all of them. Prefill, decode, resumption after preemption and
prefix hits are all the same move; there is no separate phase.

Order: running requests first (oldest first), then waiting ones (FIFO). When the
pool runs out, the newest running request is preempted by recompute: its blocks
are freed and it goes back to the front of the queue, keeping its generated
tokens (recomputing them gives the same KV bitwise, by the numerics contract).

Disaggregated decode adds one move: a waiting request marked
``remote_prefill`` gets the blocks of its whole prompt at admission and waits
in ``remote`` (not scheduled) while a prefill instance writes the KV of
``prompt[:-1]`` into them; :meth:`Scheduler.remote_done` then sets its computed
count to ``len(prompt) - 1`` and it runs like any other request.

Speculative decoding adds one move: a request whose chunk reaches its last
token may also score its draft tokens (``Request.spec_token_ids``) in the same
step, if the budget and the pool allow; otherwise the drafts are dropped. The
engine decides afterwards how far ``num_computed_tokens`` advances.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvwarden.cache.kv_cache_manager import KVCacheManager
from kvwarden.config import SchedulerConfig
from kvwarden.engine.chunking import ChunkingRule, make_chunking_rule
from kvwarden.engine.request import Request, Status

if TYPE_CHECKING:
    from kvwarden.cache.block_pool import Block
    from kvwarden.cache.host_tier import HostHit


@dataclass(frozen=True)
class ScheduledChunk:
    """``num_tokens`` tokens of ``request`` starting at ``start`` are computed this step.

    ``num_spec`` draft tokens follow them (only when the chunk completes the request's tokens).
    """

    request: Request
    start: int
    num_tokens: int
    num_spec: int = 0

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def completes(self) -> bool:
        """True when this chunk reaches the request's last token (logits are sampled)."""
        return self.end == self.request.num_tokens


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    out_of_memory: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_tokens + c.num_spec for c in self.chunks)

    def __bool__(self) -> bool:
        return bool(self.chunks)


class Scheduler:
    """Decides which tokens of which requests run in the next step."""

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, block_size: int, speculative: bool = False) -> None:
        self.config = config
        self.kv = kv
        self.block_size = block_size
        self.rule: ChunkingRule = make_chunking_rule(config, block_size, speculative)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.remote: list[Request] = []  # waiting for another instance to write their prompt's KV
        self.newly_remote: list[Request] = []  # admitted to ``remote`` since the caller last took them
        self.num_preemptions = 0

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = self.rule.chunk(req, req.num_computed_tokens, min(req.num_tokens_to_compute, budget))
            if n > 0:
                spec = self._num_spec(req, n, budget)
                if spec and self.kv.allocate_slots(req, n + spec) is None:
                    req.spec_token_ids, spec = [], 0  # drafts never cost another request its blocks
                fits = True if spec else self._allocate_or_preempt(req, n, out)
                if req.status is Status.WAITING:
                    break  # req itself was preempted: it was the last running request
                if fits:
                    out.chunks.append(ScheduledChunk(req, req.num_computed_tokens, n, spec))
                    budget -= n + spec
            i += 1
        if out.preempted:
            return out  # memory is tight: admit nothing new this step
        while self.waiting and budget > 0 and len(self.running) + len(self.remote) < self.config.max_num_seqs:
            req = self.waiting[0]
            req.spec_token_ids = []  # drafts are only scored from a running request's decode step
            hits, num_hit = self.kv.get_computed_blocks(req) if req.num_computed_tokens == 0 else ([], 0)
            start = req.num_computed_tokens + num_hit
            if req.remote_prefill and start < req.num_tokens - 1:
                if not self._admit_remote(req, hits, num_hit):
                    break
                continue
            req.remote_prefill = False  # cached here up to the last token (or resumed): computed locally
            n = self.rule.chunk(req, start, min(req.num_tokens - start, budget))
            if n <= 0 or self.kv.allocate_slots(req, n, hits) is None:
                break
            self._take_waiting(req, start, num_hit, Status.RUNNING)
            self.running.append(req)
            out.chunks.append(ScheduledChunk(req, start, n))
            budget -= n
        return out

    def _admit_remote(self, req: Request, hits: list[Block | HostHit], num_hit: int) -> bool:
        """Blocks for the whole prompt, then wait in ``remote``; False if the pool cannot hold it."""
        if self.kv.allocate_slots(req, req.num_tokens - num_hit, hits) is None:
            return False
        self._take_waiting(req, num_hit, num_hit, Status.REMOTE)
        self.remote.append(req)
        self.newly_remote.append(req)
        return True

    def _take_waiting(self, req: Request, start: int, num_hit: int, status: Status) -> None:
        """The head of the queue got its blocks: it leaves the queue with ``start`` tokens computed."""
        self.waiting.popleft()
        self.kv.record_query(req.num_tokens, num_hit)
        req.num_computed_tokens = start
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = num_hit
        req.status = status

    def remote_done(self, req: Request) -> None:
        """The prompt's KV but its last token is written: publish the full blocks and run the request.

        NOTE(invariant): the last prompt token is always computed here, so the
        step that samples the first token is this instance's own, and the KV
        the prefill instance wrote is what this instance would have computed
        (canonical numerics do not depend on where a chunk boundary falls).
        """
        self.remote.remove(req)
        req.remote_prefill = False  # a later preemption recomputes it here
        req.num_computed_tokens = req.num_tokens - 1
        self.kv.cache_computed_blocks(req)
        req.status = Status.RUNNING
        self.running.append(req)

    def _num_spec(self, req: Request, n: int, budget: int) -> int:
        """Draft tokens scored beside the chunk: all of them when the chunk completes and they fit, else none."""
        spec = len(req.spec_token_ids)
        if spec and (req.num_computed_tokens + n != req.num_tokens or n + spec > budget):
            req.spec_token_ids = []
            return 0
        return spec

    def _allocate_or_preempt(self, req: Request, n: int, out: SchedulerOutput) -> bool:
        """Allocate for ``req``, preempting the newest running requests as needed.

        Returns False if ``req`` got no slots: it was preempted itself, or it is
        the only running request and larger than the whole pool (reported in
        ``out.out_of_memory``) or waits for blocks that requests in ``remote`` hold.
        """
        while self.kv.allocate_slots(req, n) is None:
            if self.running[-1] is req and len(self.running) == 1:
                if not self.remote:  # nothing will give blocks back: it can never fit
                    out.out_of_memory.append(req)
                return False  # else it waits: a finished transfer makes a preemptible request
            victim = self.running.pop()
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.spec_token_ids = []
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = Status.WAITING
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    def update(self, out: SchedulerOutput) -> list[ScheduledChunk]:
        """Advance computed counts after the step; returns chunks whose logits are sampled.

        A chunk's draft tokens are not counted here: the engine advances past
        the accepted ones (:meth:`advance`) once it has verified them.
        """
        completed = []
        for chunk in out.chunks:
            req = chunk.request
            req.num_computed_tokens = chunk.end
            self.kv.cache_computed_blocks(req)
            if chunk.completes:
                completed.append(chunk)
        return completed

    def advance(self, req: Request, num_computed_tokens: int) -> None:
        """Set a request's computed count after verification and publish what became full."""
        req.num_computed_tokens = num_computed_tokens
        self.kv.cache_computed_blocks(req)

    def finish(self, req: Request, reason: str, free: bool = True) -> None:
        """Remove a request (finished or aborted) and return its blocks (unless ``free`` is False:
        then the caller frees them later with ``kv.free``)."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        elif req in self.remote:
            self.remote.remove(req)
        if req in self.newly_remote:
            self.newly_remote.remove(req)
        if free:
            self.kv.free(req)
        req.status = Status.FINISHED
        req.finish_reason = reason
