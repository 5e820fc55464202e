"""The stepping engine: ``add_request`` / ``step`` / ``abort``.

One ``step()`` = schedule -> run the model on the scheduled chunks -> sample for
requests whose chunk reached their last token -> apply stop conditions. The
server drives this loop in a background thread; :class:`kvwarden.LLM` drives it
until every request it added has finished.
"""

from __future__ import annotations

import itertools
import logging
import random
from typing import TYPE_CHECKING, Any

from kvwarden.cache.kv_cache_manager import KVCacheManager
from kvwarden.config import EngineConfig, resolve_device
from kvwarden.engine.engine_parts import attach_host_tier, build_cache, build_runner
from kvwarden.engine.engine_stats import engine_stats
from kvwarden.engine.memory import context_limit
from kvwarden.engine.model_runner import StepLogits
from kvwarden.engine.outputs import RequestOutput
from kvwarden.engine.overlap import AheadStep, Overlap, why_not_overlapped
from kvwarden.engine.prompt_ids import Prompt, prompt_ids
from kvwarden.engine.remote_kv import RemoteKV
from kvwarden.engine.request import Request, Status
from kvwarden.engine.row_math import row_math_for
from kvwarden.engine.sampler import NonFiniteLogits, RowTops, Sample, sample_from_tops
from kvwarden.engine.sampling_params import SamplingParams
from kvwarden.engine.scheduler import ScheduledChunk, Scheduler, SchedulerOutput
from kvwarden.engine.spec.speculator import Speculator
from kvwarden.engine.spec.verify import verify
from kvwarden.engine.spec_stats import SpecStats
from kvwarden.engine.step_sampling import launch_tops, record_prompt_scores
from kvwarden.engine.stop import update_text_and_check_stop
from kvwarden.engine.structured.grammars import Grammars
from kvwarden.engine.structured.state import GrammarFailure
from kvwarden.layers.backends import make_ops
from kvwarden.layers.cpu_ops import CompiledCpuOps
from kvwarden.models.loader import LoadedModel, load_for

if TYPE_CHECKING:
    from kvwarden.engine.faults import FaultInjector

log = logging.getLogger(__name__)


class LLMEngine:
    """Owns model, cache, scheduler; advances all requests one step at a time."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        self.ops = make_ops(config.numerics, self.device)
        # the sampler's log-softmax from the same kernels as the model's (the compiled CPU ones where they run)
        compiled = self.ops.compiled if isinstance(self.ops, CompiledCpuOps) else None
        self.row_math = row_math_for("cuda" if config.numerics.kernels == "triton" else self.device, compiled)
        self.loaded: LoadedModel = load_for(config, self.ops)
        self.model_config = self.loaded.config
        self.tokenizer = self.loaded.tokenizer
        self.grammars = Grammars(self.tokenizer, self.model_config.vocab_size)  # compiled on first use
        self.max_model_len = context_limit(config.max_model_len, self.model_config)
        cache = config.cache
        parts = build_cache(config, self.device, self.ops, self.loaded)
        self.num_blocks, self.pool, self.kv, self.states = parts.num_blocks, parts.pool, parts.kv, parts.managed_states
        self.spec = config.speculative
        self.scheduler = Scheduler(config.scheduler, self.kv, cache.block_size, speculative=self.spec is not None)
        self.runner, self.parallel = build_runner(config, self.loaded, parts, self.max_model_len)
        self.host = attach_host_tier(config, self.loaded, self.runner, parts)
        self.speculator: Speculator | None = None
        if self.spec is not None:  # a draft model's engine is one of ours: the factory is this class
            self.speculator = Speculator(self.spec, self, LLMEngine)
        self.overlap: Overlap | None = None  # the next decode step launched before this one's tokens are read
        why = why_not_overlapped(self.runner, self.spec is not None, self.host is not None)
        if config.scheduler.async_scheduling and why is None:
            assert isinstance(self.kv, KVCacheManager)
            self.overlap = Overlap(self.scheduler, self.kv, self.runner, self.max_model_len)
        elif config.scheduler.async_scheduling and self.runner.graphs is not None:
            log.info("decode steps are not overlapped with the host: %s", why)
        self._ahead: AheadStep | None = None
        self.requests: dict[str, Request] = {}
        self.remote = RemoteKV(self.scheduler, self.kv, self.states, self.requests, cache.block_size)
        # Testing only (``kvwarden serve --inject-fault``): breaks invariance on purpose when set.
        self.faults: FaultInjector | None = None
        self._prompts: dict[str, str | None] = {}
        self._counter = itertools.count()
        self._seed_rng = random.Random(config.seed)
        self.num_steps = 0
        self.last_scheduled: list[tuple[str, int, int]] = []  # (request, start, end) of the last step
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0

    # ------------------------------------------------------------------ requests
    def tokenize(self, prompt: Prompt) -> list[int]:
        """Token ids of a prompt, validated against the model.

        Raises:
            ValueError: naming ``prompt`` for empty prompts, ids outside the
                vocabulary, or prompts that leave no room to generate.
        """
        vocab, block_size = self.model_config.vocab_size, self.config.cache.block_size
        return prompt_ids(prompt, self.tokenizer, vocab, self.max_model_len, block_size, self.num_blocks)

    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
        capture_logits: bool = False,
        final_only: bool = False,
        remote_prefill: bool = False,
        hold_blocks: bool = False,
    ) -> str:
        """Queue a request; returns its id. Raises ``ValueError`` for bad input.

        ``capture_logits`` returns the float32 logits of every prompt position in
        the output (see :meth:`kvwarden.LLM.score`); like prompt logprobs it
        disables prefix hits for the request, as cached positions have no logits.
        ``final_only``: :meth:`step` returns the request's output only when it
        finishes (saves copying its lists and decoding its text every step).
        ``remote_prefill`` / ``hold_blocks``: the decode and prefill sides of
        disaggregated serving (see :class:`kvwarden.engine.request.Request`).
        """
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError("params: expected a SamplingParams")
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise ValueError("cache_salt: must be a non-empty string")
        ids = self.tokenize(prompt)
        request_id = request_id or f"req-{next(self._counter)}"
        if request_id in self.requests:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        req = Request(
            request_id=request_id,
            all_token_ids=list(ids),
            cache_salt=cache_salt,
            skip_prefix_hit=params.prompt_logprobs is not None or capture_logits,
            prompt_token_ids=list(ids),
            params=params,
            seed=seed,
            capture_logits=capture_logits,
            final_only=final_only,
            spec_stats=SpecStats() if self.spec is not None else None,
            # prompt scores need every position computed here
            remote_prefill=remote_prefill and not (params.prompt_logprobs is not None or capture_logits),
            hold_blocks=hold_blocks,
            grammar=self.grammars.state(so) if (so := params.structured_outputs) is not None else None,
        )
        if params.prompt_logprobs is not None:
            req.prompt_logprobs = [None]
        self.requests[request_id] = req
        self._prompts[request_id] = prompt if isinstance(prompt, str) else None
        self.scheduler.add(req)
        if self.faults is not None:
            self.faults.on_add(request_id)
        return request_id

    def abort(self, request_id: str, free_blocks: bool = True) -> RequestOutput | None:
        """Stop a request now and return its blocks; ``None`` if it is unknown or done.

        ``free_blocks=False`` keeps its blocks (and working state) allocated in
        ``remote.detached`` until ``remote.release``: another instance may
        still be writing into them.
        """
        req = self.requests.get(request_id)
        if req is None or req.is_finished:
            return None
        self.scheduler.finish(req, "abort", free=free_blocks)
        if not free_blocks:
            self.remote.hold(req)
        return self._release(req)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns outputs of requests that progressed or finished."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None and (live := ahead.live()):  # launched by the last call: its outputs now
            assert self.overlap is not None
            self.overlap.dropped_rows += len(ahead.chunks) - len(live)
            self.last_scheduled = [(c.request.request_id, c.start, c.end) for c in live]
            return self._after_forward(SchedulerOutput(live), ahead.logits, [])
        sched = self.scheduler.schedule()
        self.last_scheduled = [(c.request.request_id, c.start, c.end) for c in sched.chunks]
        outputs = [self._finish(req, "length") for req in sched.out_of_memory]
        if not sched:
            return outputs
        if self.speculator is not None:
            self.speculator.before_step(sched, self.runner.will_replay(sched))
        if self.host is not None:
            self.host.flush()  # write-backs of reused blocks, queued before the forward overwrites them
        try:
            step_logits = self.runner.execute(sched, self.kv)
        finally:
            if self.host is not None:
                self.host.end_step()  # no copy outlives its step: blocks may change hands after this
        return self._after_forward(sched, step_logits, outputs)

    def _after_forward(
        self, sched: SchedulerOutput, step_logits: StepLogits, outputs: list[RequestOutput]
    ) -> list[RequestOutput]:
        """Sample and apply stop conditions for a step the device ran (or is running)."""
        self.num_steps += 1
        completed = self.scheduler.update(sched)
        record_prompt_scores(sched, step_logits, self.row_math)
        # faults rewrite rows per request: those steps sample row by row
        pending = launch_tops(completed, step_logits, self.row_math) if self.faults is None else None
        if pending is not None and self.overlap is not None:
            self._ahead = self.overlap.launch(sched, completed, pending)  # before the host reads this step
        tops = pending.collect() if pending is not None else None
        ready = []
        for chunk in completed:
            if self.faults is not None:
                self._inject(chunk.request)
            out = self._sample(chunk, step_logits, tops)
            if out is not None:
                outputs.append(out)
            if not chunk.request.is_finished:
                ready.append(chunk.request)
        if self.speculator is not None:
            self.speculator.propose(sched, step_logits, ready)
        if self._ahead is not None and not self._ahead.live():
            self._ahead = None  # every request of it ended with this step
        return outputs

    def _sample(self, chunk: ScheduledChunk, step: StepLogits, tops: dict[int, RowTops] | None) -> RequestOutput | None:
        req = chunk.request
        try:
            samples, accepted = self._choose(chunk, step, tops)
        except (GrammarFailure, NonFiniteLogits) as exc:
            return self._fail(chunk, exc, step)
        if len(req.output_token_ids) == 0:
            self.prompt_tokens_total += req.num_prompt_tokens
        reason = None
        for sample in samples:
            if req.grammar is not None:
                try:
                    req.grammar.accept(sample.token_id)
                except GrammarFailure as exc:
                    return self._fail(chunk, exc, step)
            req.append_token(sample.token_id)
            req.sampled_logprobs.append(sample.logprob)
            if req.params.logprobs is not None:
                req.logprobs.append(sample.top)
            self.generation_tokens_total += 1
            reason = update_text_and_check_stop(req, self.tokenizer, self.max_model_len)
            if reason is not None:
                break
        if chunk.num_spec and self.speculator is not None:
            kept = min(accepted, req.num_tokens - 1 - chunk.end)
            self.speculator.commit(chunk, accepted, kept, step.verified)
        req.spec_token_ids = []
        if reason is not None:
            return self._finish(req, reason)
        if req.final_only:
            return None
        return RequestOutput.of(req, self._prompts.get(req.request_id))

    def _choose(
        self, chunk: ScheduledChunk, step: StepLogits, tops: dict[int, RowTops] | None
    ) -> tuple[list[Sample], int]:
        """The chunk's tokens (its drafts verified) and how many drafts were accepted."""
        req = chunk.request
        row_ids = step.sample_rows[req.request_id]
        drafts = req.spec_token_ids[: chunk.num_spec]
        pre = [tops[r] for r in row_ids] if tops is not None else None
        if pre is not None and not drafts and req.grammar is None:
            # Each token is keyed by the absolute position it takes (not by the step, the batch or the drafts).
            got = sample_from_tops(pre[0], req.params, req.num_tokens)  # the step chose it: no row needed
            if got is not None:
                return [got], 0
        rows = step.logits[row_ids[0] : row_ids[-1] + 1]  # consecutive (StepLogits): a view, no gather per request
        if self.faults is not None:
            rows = self.faults.bias(req, rows, drafts)
        masks = req.grammar.masks(drafts, rows.device) if req.grammar is not None else None
        acceptance = self.spec.acceptance if self.spec is not None else "match"
        return verify(rows, drafts, req.params, req.seed, req.num_tokens, self.row_math, acceptance, pre, masks)

    def _fail(self, chunk: ScheduledChunk, exc: Exception, step: StepLogits) -> RequestOutput:
        """End a request that cannot go on (a grammar with no way forward, non-finite logits; its error says
        why); the rest of the batch is untouched."""
        req = chunk.request
        if chunk.num_spec and self.speculator is not None:
            self.speculator.commit(chunk, 0, 0, step.verified)  # nothing of the step's drafts is kept
        req.spec_token_ids = []
        req.error = str(exc)
        req.error_code = getattr(exc, "code", "request_failed")
        return self._finish(req, "abort")

    def _inject(self, req: Request) -> None:
        """Testing only: let the fault injector corrupt a request's KV after its prefill."""
        assert self.faults is not None
        blocks = self.kv.req_blocks.get(req.request_id, [])
        block_size = self.config.cache.block_size
        for block in self.faults.after_prefill(req, blocks, self.runner.kv_caches, block_size):
            self.pool.forget(block)

    def _finish(self, req: Request, reason: str) -> RequestOutput:
        self.scheduler.finish(req, reason, free=not req.hold_blocks)
        if req.hold_blocks:
            self.remote.hold(req)  # a transfer reads them: freed by remote.release
        return self._release(req)

    def _release(self, req: Request) -> RequestOutput:
        if req.final_only and not req.params.stop:  # its text was left for the end
            req.text = self.tokenizer.decode(req.output_token_ids, skip_special_tokens=req.params.skip_special_tokens)
        out = RequestOutput.of(req, self._prompts.pop(req.request_id, None))
        del self.requests[req.request_id]
        req.spec_token_ids = []
        if self.speculator is not None:
            self.speculator.release(req.request_id)
        if self.faults is not None:
            self.faults.release(req.request_id)
        return out

    # -------------------------------------------------------------- inspection
    def check_integrity(self) -> None:
        """Raise ``AssertionError`` if the cache's bookkeeping is inconsistent (both tiers)."""
        self.kv.check_integrity()
        if self.host is not None:
            self.host.check_integrity()
        for req in self.scheduler.running:
            assert req.status is Status.RUNNING
            assert req.request_id in self.kv.req_blocks or req.num_computed_tokens == 0

    def stats(self) -> dict[str, Any]:
        """Counters and gauges of the engine's parts (``/metrics``, the probe): see :func:`engine_stats`."""
        return engine_stats(self)

    def close(self) -> None:
        """Stop what the engine started outside this process (context-parallel workers); idempotent."""
        if self.parallel is not None:
            self.parallel.close()
