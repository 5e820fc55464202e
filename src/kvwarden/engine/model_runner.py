"""Turns a scheduled step into tensors, runs the model, returns logits rows.

Owns the KV tensors: per attention layer a flat ``[num_blocks * block_size + 1,
kv_heads, head_dim]`` K and a V with one extra column of ones. The extra last
slot stays zero forever; the canonical attention kernel points every key past a
request's context at it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from kvwarden.cache.state_pool import StatePool
from kvwarden.config import NumericsConfig
from kvwarden.engine.scheduler import SchedulerOutput
from kvwarden.layers.attention import SeqAttn, build_plan
from kvwarden.models.common import TraceSink
from kvwarden.models.decoder import DecoderModel, ForwardBatch, SeqSlice


class KVCacheView(Protocol):
    """What the runner needs from the cache manager: a request's block table."""

    def block_ids(self, request_id: str) -> list[int]: ...


@dataclass
class StepLogits:
    """Logits the sampler needs from one step.

    Attributes:
        logits: ``[rows, vocab]`` float32.
        sample_rows: request id -> row whose logits give its next token.
        prompt_rows: request id -> (first prompt position, logits rows) for
            requests that want scores of their prompt positions.
    """

    logits: torch.Tensor
    sample_rows: dict[str, int]
    prompt_rows: dict[str, tuple[int, list[int]]]


def kv_bytes_per_block(model: DecoderModel, block_size: int) -> int:
    heads, dim = model.kv_shape()
    elem = torch.empty((), dtype=model.dtype).element_size()
    return model.num_attention_layers * block_size * heads * (2 * dim + 1) * elem


class ModelRunner:
    def __init__(
        self,
        model: DecoderModel,
        num_blocks: int,
        block_size: int,
        numerics: NumericsConfig,
        states: StatePool | None = None,
    ) -> None:
        self.model = model
        self.states = states
        self.tracer: TraceSink | None = None  # set by tools that trace activations
        self.block_size = block_size
        self.numerics = numerics
        heads, dim = model.kv_shape()
        self.null_slot = num_blocks * block_size
        slots = self.null_slot + 1
        # V carries a ones column so the attention kernel gets softmax row sums from
        # the same fixed-shape product as the numerator; the null slot stays all zero.
        self.kv_caches = [
            (torch.zeros(slots, heads, dim, dtype=model.dtype), torch.zeros(slots, heads, dim + 1, dtype=model.dtype))
            for _ in range(model.num_attention_layers)
        ]

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, kv: KVCacheView) -> StepLogits:
        ids: list[int] = []
        positions: list[int] = []
        slot_list: list[torch.Tensor] = []
        seqs: list[SeqAttn] = []
        slices: list[SeqSlice] = []
        sample_rows: dict[str, int] = {}
        prompt_rows: dict[str, tuple[int, list[int]]] = {}
        want_rows: list[int] = []
        for chunk in out.chunks:
            req = chunk.request
            row0 = len(ids)
            ids.extend(req.all_token_ids[chunk.start : chunk.end])
            positions.extend(range(chunk.start, chunk.end))
            slots = self._slots(kv.block_ids(req.request_id), chunk.end)
            slot_list.append(slots[chunk.start : chunk.end])
            seqs.append(SeqAttn(row0, chunk.num_tokens, chunk.start, slots))
            slices.append(SeqSlice(req.request_id, row0, chunk.num_tokens, chunk.start))
            scored = min(chunk.end, req.num_prompt_tokens) - chunk.start
            if req.wants_prompt_scores and scored > 0:
                # Row of position j holds the distribution of token j+1.
                prompt_rows[req.request_id] = (chunk.start, list(range(len(want_rows), len(want_rows) + scored)))
                want_rows.extend(range(row0, row0 + scored))
            if chunk.completes:
                sample_rows[req.request_id] = len(want_rows)
                want_rows.append(row0 + chunk.num_tokens - 1)
        plan = build_plan(seqs, len(ids), self.numerics.row_tile, self.numerics.key_tile, self.null_slot)
        batch = ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.long),
            positions=torch.tensor(positions, dtype=torch.long),
            slot_mapping=torch.cat(slot_list),
            plan=plan,
            seqs=slices,
            states=self.states,
            block_size=self.block_size,
            scan_chunk=self.numerics.scan_chunk,
            tracer=self.tracer,
        )
        hidden = self.model.forward(batch, self.kv_caches)
        if want_rows:
            logits = self.model.logits(hidden[torch.tensor(want_rows, dtype=torch.long)])
        else:
            logits = torch.empty((0, 0))
        return StepLogits(logits=logits, sample_rows=sample_rows, prompt_rows=prompt_rows)

    def _slots(self, block_ids: list[int], num_tokens: int) -> torch.Tensor:
        """Flat cache slot of every position ``[0, num_tokens)``."""
        blocks = torch.tensor(block_ids, dtype=torch.long)
        pos = torch.arange(num_tokens)
        return blocks[pos // self.block_size] * self.block_size + pos % self.block_size
