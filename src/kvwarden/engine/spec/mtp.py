"""MTP speculation: Qwen3-Next's own multi-token-prediction head drafts the next tokens.

The head's attention layer keeps its own KV cache, laid out like the target's
(one more paged tensor, addressed through the target's block tables), so after
every step the head runs over every row the target computed (prefill chunks
included), with the tokens shifted by one. Then, for each request that decodes
next, its last row's output gives draft 1 and ``k - 1`` more passes of the head
over its own output give the rest.

NOTE: the head's KV at the last position of a block depends on the first token
of the next block, which the block's hash does not cover, so a prefix hit may
bring a head KV entry written for another continuation. That can only lower
acceptance: drafts never change the answer (:mod:`kvwarden.engine.spec.verify`).
"""

from __future__ import annotations

import torch

from kvwarden.engine.model_runner import BatchEntry, StepLogits
from kvwarden.engine.request import Request
from kvwarden.engine.sampler import sample_row
from kvwarden.engine.sampling_params import SamplingParams
from kvwarden.engine.scheduler import SchedulerOutput
from kvwarden.engine.spec.mtp_graphs import MtpGraphs
from kvwarden.engine.spec.target import SpecTarget
from kvwarden.models.loader import TORCH_DTYPES, unread
from kvwarden.models.mtp import MtpHead, has_mtp, mtp_names

_GREEDY = SamplingParams(temperature=0.0, max_tokens=1)


class MtpProposer:
    """Proposes with the checkpoint's MTP head (``speculative_config={"method": "mtp"}``)."""

    def __init__(self, target: SpecTarget) -> None:
        weights, cfg = target.loaded.mtp_weights, target.model_config
        if not has_mtp(cfg, weights):
            where = f"no {mtp_names(cfg).fc}; Qwen3-Next, GLM-5 and DeepSeek-V3.2 checkpoints carry one"
            raise ValueError(
                f"speculative_config.method: 'mtp' needs a multi-token-prediction head, and {target.loaded.source} "
                f"has none ({where}); use 'draft' or 'ngram'"
            )
        dtype, device = TORCH_DTYPES[target.config.dtype], target.ops.device

        def get(name: str) -> torch.Tensor | None:
            t = weights.get(name)
            if t is None:
                return None
            # as the loader keeps them: GLM-5's router and indexer head weights stay float32
            want = torch.float32 if name.endswith(cfg.fp32_weights) and t.dtype == torch.float32 else dtype
            return t.to(want).contiguous().to(device)

        self.target = target
        self.head = MtpHead(cfg, get, target.loaded.model)
        unused = unread(weights, self.head.asked)
        if unused:  # a tensor of the head that the head would ignore: refused, as the loader refuses the model's
            raise ValueError(
                f"checkpoint: MTP tensor {unused[0]!r} is not used by {cfg.architecture}'s MTP head; kvwarden "
                "refuses to draft with a head it would partly ignore"
            )
        runner = target.runner
        # like the target's: the null slot, then a slot no block owns (the drafting graph's padding rows)
        self.kv_caches = [target.loaded.model.new_kv_cache(runner.null_slot + 2)]
        spec = target.config.speculative
        self.k = spec.num_speculative_tokens if spec is not None else 1
        self.graphs: MtpGraphs | None = None
        if runner.graphs is not None and self.k + 1 in runner.graphs.widths:
            self.graphs = MtpGraphs(
                self.head, self.kv_caches, runner.null_slot + 1, runner.graphs, self.k, target.max_model_len,
                capture=runner.graphs.capture,
            )  # fmt: skip

    @torch.inference_mode()
    def propose(self, sched: SchedulerOutput, step: StepLogits, ready: list[tuple[Request, int]]) -> None:
        rooms = self._graph_rooms(sched, step, ready)
        if rooms is not None:
            assert self.graphs is not None and step.hidden is not None
            drafts = self.graphs.run(sched.chunks, rooms, step.hidden, self._block_ids)
            for c, tokens in zip(sched.chunks, drafts, strict=True):
                c.request.spec_token_ids.extend(tokens)
            return
        out = self._fill(sched, step)
        if out is None:
            return
        hidden, last_row = out
        work = [(req, self._room(req, k)) for req, k in ready if req.request_id in last_row]
        rows = [last_row[req.request_id] for req, _ in work]
        current = hidden[torch.tensor(rows, dtype=torch.long, device=hidden.device)] if rows else hidden[:0]
        for round_ in range(max((k for _, k in work), default=0)):
            logits = self.head.logits(current)
            drafts = []
            for i, (req, _) in enumerate(work):
                pos = req.num_tokens + round_
                # A structured request drafts what its grammar allows after the drafts so far.
                if req.grammar is not None:
                    allowed = req.grammar.mask_after(req.spec_token_ids, logits.device)
                    token = sample_row(logits[i], _GREEDY, 0, pos, self.target.row_math, allowed=allowed).token_id
                else:  # the drafting graph's pick: the same argmax, so both draft the same tokens
                    token = int(logits[i].argmax())
                req.spec_token_ids.append(token)
                drafts.append(token)
            keep = [i for i, (_, k) in enumerate(work) if round_ + 1 < k]
            if not keep:
                break
            work = [work[i] for i in keep]
            # the head's next input: the draft just made (at position p + 1) and its own output at p
            entries = [
                BatchEntry(req.request_id, [drafts[i]], req.num_tokens - 1 + round_, self._blocks(req))
                for i, req in ((i, work[j][0]) for j, i in enumerate(keep))
            ]
            current = self._run(entries, current[torch.tensor(keep, dtype=torch.long, device=current.device)])

    def _graph_rooms(
        self, sched: SchedulerOutput, step: StepLogits, ready: list[tuple[Request, int]]
    ) -> list[int | None] | None:
        """Drafts per chunk when the drafting graph serves this step, else None: the step replayed a verify
        graph and no request that goes on has a grammar (its mask is applied on the host). A request that
        finished is a padding request (None); one with no room left (0: its last token next) still has the
        head run over its kept rows, as the eager fill does (their head KV may be published); one with less
        room than ``k`` keeps the first drafts of the graph's ``k`` (rows are independent: the eager
        proposer's rounds compute the same ones)."""
        if self.graphs is None or step.replayed != self.k + 1 or step.hidden is None:
            return None
        want = {req.request_id: (req, k) for req, k in ready}
        if len(want) != len(ready) or any(req.grammar is not None for req, _ in ready):
            return None
        chunk_ids = {c.request.request_id for c in sched.chunks}
        if not want or any(rid not in chunk_ids for rid in want):
            return None
        rooms: list[int | None] = []
        for c in sched.chunks:
            got = want.get(c.request.request_id)
            if got is not None:
                rooms.append(self._room(got[0], got[1]))
            else:
                rooms.append(None if c.request.is_finished else 0)
        return rooms

    def _block_ids(self, request_id: str) -> list[int]:
        return self.target.kv.block_ids(request_id)

    def _fill(self, sched: SchedulerOutput, step: StepLogits) -> tuple[torch.Tensor, dict[str, int]] | None:
        """Run the head over every target row of the step whose next token is known (writes its KV)."""
        if step.hidden is None or step.hidden_rows is None:
            return None
        entries, rows = [], []
        last_row: dict[str, int] = {}
        for chunk in sched.chunks:
            req = chunk.request
            if req.is_finished:
                continue
            # position p needs the token at p + 1 and a hidden state computed from kept tokens only
            end = min(chunk.end + chunk.num_spec, req.num_tokens - 1)
            if end <= chunk.start:
                continue
            row0 = step.hidden_rows[req.request_id]
            entries.append(
                BatchEntry(req.request_id, req.all_token_ids[chunk.start + 1 : end + 1], chunk.start, self._blocks(req))
            )
            rows.extend(range(row0, row0 + end - chunk.start))
            if end == req.num_tokens - 1:
                last_row[req.request_id] = len(rows) - 1
        if not entries:
            return None
        hidden = step.hidden[torch.tensor(rows, dtype=torch.long, device=step.hidden.device)]
        return self._run(entries, hidden, fill=True), last_row

    def _run(self, entries: list[BatchEntry], hidden: torch.Tensor, fill: bool = False) -> torch.Tensor:
        # the fill in the prefill tiles, as the drafting graph's first round (mtp_graphs.py) runs it
        batch = self.target.runner.make_batch(entries, with_states=False, prefill_tiles=fill)
        batch.states = None  # the head has no recurrent layer
        batch.tracer = None
        return self.head.forward(batch, hidden, self.kv_caches)

    def _room(self, req: Request, k: int) -> int:
        """Drafts 2..k write the head's KV past the computed tokens: make sure those slots exist."""
        need = req.num_tokens + k - 2 - req.num_computed_tokens
        if k > 1 and need > 0 and self.target.kv.allocate_slots(req, need) is None:
            return 1
        return k

    def _blocks(self, req: Request) -> list[int]:
        return self.target.kv.block_ids(req.request_id)

    def release(self, request_id: str) -> None:
        return None
