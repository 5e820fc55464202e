"""Draft-model speculation: a small model sharing the tokenizer, run by its own engine.

The draft model gets a full engine of its own (built by the factory the target
hands in) (weights, KV pool, prefix cache, recurrent states), whose scheduler is
not used: for every target request that decodes next, this proposer keeps a
*shadow* request holding the target's committed tokens, and drafts ``k`` tokens
greedily in ``k`` batched forward passes of the draft model.

NOTE(invariant): a shadow's ``all_token_ids`` is always a prefix of its
target's; draft tokens are appended only while drafting and removed before any
block is published, so the draft's prefix cache only ever holds committed
tokens. A hybrid draft model's state is checkpointed at the committed length
and restored after drafting.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from kvwarden.config import ParallelConfig, SpeculativeConfig
from kvwarden.engine.model_runner import StepLogits
from kvwarden.engine.request import Request, Status
from kvwarden.engine.sampler import sample_row
from kvwarden.engine.sampling_params import SamplingParams
from kvwarden.engine.scheduler import ScheduledChunk, SchedulerOutput
from kvwarden.engine.spec.target import EngineFactory, SpecTarget

_GREEDY = SamplingParams(temperature=0.0, max_tokens=1)


class DraftModelProposer:
    """Proposes with a separate draft model (``speculative_config={"method": "draft", "model": ...}``)."""

    def __init__(self, spec: SpeculativeConfig, target: SpecTarget, make_engine: EngineFactory) -> None:
        assert spec.model is not None
        # As many blocks as the target: a shadow never needs more than its target. On a GPU the
        # target sized its pool first, so leave room with a lower gpu_memory_utilization.
        # The draft keeps its own KV pool only (a host tier for drafts would cost memory and copies for nothing).
        cache = replace(
            target.config.cache,
            num_blocks=target.num_blocks,
            host_cache_bytes=0,
            unsafe_host_load=False,
            unsafe_indexer_load=False,
        )
        self.draft = make_engine(
            replace(target.config, model=spec.model, speculative=None, cache=cache, parallel=ParallelConfig())
        )
        self.target_vocab = target.model_config.vocab_size
        _check_vocabulary(spec.model, self.draft, target)
        self.shadows: dict[str, Request] = {}

    def propose(self, sched: SchedulerOutput, step: StepLogits, ready: list[tuple[Request, int]]) -> None:
        live = {req.request_id for req, _ in ready}
        work = [(req, shadow, k) for req, k in ready if (shadow := self._sync(req, k, live)) is not None]
        committed = {shadow.request_id: shadow.num_tokens for _, shadow, _ in work}
        states = self.draft.states
        for round_ in range(max((k for _, _, k in work), default=0)):
            active = [(req, shadow) for req, shadow, k in work if round_ < k]
            if round_ == 1 and states is not None:  # the state at the committed length, restored after drafting
                states.checkpoint_many([shadow.request_id for _, shadow in active])
            chunks = [
                ScheduledChunk(shadow, shadow.num_computed_tokens, shadow.num_tokens - shadow.num_computed_tokens)
                for _, shadow in active
            ]
            out = self.draft.runner.execute(SchedulerOutput(chunks=chunks), self.draft.kv)
            for (req, _), chunk in zip(active, chunks, strict=True):
                shadow = chunk.request
                row = out.logits[out.sample_rows[shadow.request_id][0]]
                # A structured request drafts what its grammar allows after the drafts so far.
                made = shadow.all_token_ids[committed[shadow.request_id] :]
                allowed = req.grammar.mask_after(made, row.device) if req.grammar is not None else None
                if allowed is not None and allowed.numel() != row.numel():  # another logits width (padding rows)
                    allowed = _resized(allowed, row.numel())
                token = sample_row(row, _GREEDY, 0, shadow.num_tokens, self.draft.row_math, allowed=allowed).token_id
                shadow.num_computed_tokens = chunk.end
                shadow.all_token_ids.append(token)
        for req, shadow, k in work:
            rid = shadow.request_id
            n = committed[rid]
            drafts = shadow.all_token_ids[n:]
            del shadow.all_token_ids[n:]
            if states is not None and k > 1:
                states.rollback(rid, n)
            shadow.num_computed_tokens = n
            self.draft.kv.cache_computed_blocks(shadow)
            # A draft vocabulary larger than the target's (padding rows) may propose ids the target lacks.
            valid = next((i for i, t in enumerate(drafts) if t >= self.target_vocab), len(drafts))
            req.spec_token_ids = drafts[:valid]

    def _sync(self, req: Request, k: int, live: set[str]) -> Request | None:
        """The request's shadow with the target's new tokens and slots for ``k`` drafting rounds."""
        rid = req.request_id
        kv = self.draft.kv
        shadow = self.shadows.get(rid)
        if shadow is None:
            shadow = Request(
                request_id=rid,
                all_token_ids=list(req.all_token_ids),
                prompt_token_ids=list(req.prompt_token_ids),
                params=_GREEDY,
                cache_salt=req.cache_salt,
                status=Status.RUNNING,
            )
            for attempt in range(2):  # a full draft pool: drop the shadows of idle requests, try once more
                hits, num_hit = kv.get_computed_blocks(shadow)
                if kv.allocate_slots(shadow, shadow.num_tokens - num_hit + k - 1, hits) is not None:
                    break
                if attempt:
                    return None
                self._evict(live)
            shadow.num_computed_tokens = num_hit
            self.shadows[rid] = shadow
            return shadow
        shadow.all_token_ids.extend(req.all_token_ids[shadow.num_tokens :])
        if kv.allocate_slots(shadow, shadow.num_tokens - shadow.num_computed_tokens + k - 1) is None:
            self.release(rid)  # the draft pool is full: this request decodes without drafts for now
            return None
        return shadow

    def _evict(self, live: set[str]) -> None:
        for rid in [r for r in self.shadows if r not in live]:
            self.release(rid)

    def release(self, request_id: str) -> None:
        shadow = self.shadows.pop(request_id, None)
        if shadow is not None:
            self.draft.kv.free(shadow)


def _resized(allowed: torch.Tensor, width: int) -> torch.Tensor:
    """A mask over the target's logits as one over the draft's: ids past either width are never allowed."""
    out = torch.zeros(width, dtype=torch.bool, device=allowed.device)
    n = min(width, allowed.numel())
    out[:n] = allowed[:n]
    return out


def _check_vocabulary(name: str, draft: SpecTarget, target: SpecTarget) -> None:
    """A draft must tokenize exactly as the target does, or its tokens mean something else."""
    mine = draft.tokenizer.backend.get_vocab(with_added_tokens=True)
    theirs = target.tokenizer.backend.get_vocab(with_added_tokens=True)
    if mine != theirs:
        differ = sum(1 for tok, i in theirs.items() if mine.get(tok) != i)
        raise ValueError(
            f"speculative_config.model: {name} has another vocabulary than the target "
            f"({len(mine)} vs {len(theirs)} tokens, {differ} of the target's tokens differ); "
            "a draft model must share the target's tokenizer"
        )
