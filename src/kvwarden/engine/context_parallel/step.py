"""One step on this rank: its share of the rows through the model, the caches kept whole or split."""

from __future__ import annotations

import torch

from kvwarden.engine.context_parallel.exchange import KVExchange
from kvwarden.engine.context_parallel.group import RankGroup
from kvwarden.engine.context_parallel.layer_split import LayerSplitKV, SplitExchange, StepView
from kvwarden.engine.context_parallel.shares import num_rows, split_entries
from kvwarden.engine.model_runner import BatchEntry, ModelRunner


def shares_of(entries: list[BatchEntry], world: int, split: bool) -> list[list[BatchEntry]]:
    """The rows of each rank: split evenly, or (a short step under the layer split) all on rank 0."""
    if split:
        return split_entries(entries, world)
    return [list(entries)] + [[] for _ in range(world - 1)]


def forward_share(
    runner: ModelRunner, entries: list[BatchEntry], group: RankGroup, split: bool, layers: LayerSplitKV | None
) -> tuple[torch.Tensor, list[int]]:
    """This rank's share of the step through the model: ``(hidden [own rows, hidden], rows per rank)``.

    Without the layer split every step that reaches here is split and each rank reads its full cache
    copy. With it, each rank reads the step's view buffers; a rank without rows still takes part in
    every layer's broadcast and exchange (its layers' owners are needed by the others).
    """
    shares = shares_of(entries, group.world, split)
    counts = [num_rows(s) for s in shares]
    own = shares[group.rank]
    # NOTE(invariance): attention's query tiles are the step's choice, never a share's: a rank whose share
    # holds only one-row entries of a step with longer ones runs the prefill tiles, as one GPU would
    prefill = any(len(e.token_ids) > 1 for e in entries)
    if layers is None:
        slots = [runner.slot_rows(share).to(runner.device) for share in shares]
        batch = runner.make_batch(own, with_states=False, prefill_tiles=prefill)
        batch.kv_exchange = KVExchange(group, slots)
        return runner.model.forward(batch, runner.kv_caches), counts
    view = StepView.of(entries, runner.block_size)
    view_slots = [runner.slot_rows(view.remap(share)).to(runner.device) for share in shares]
    layers.begin(view, torch.cat(view_slots))
    pool_slots = runner.slot_rows(entries).to(runner.device)
    exchange = SplitExchange(layers, group, view_slots, pool_slots)
    if own:
        batch = runner.make_batch(view.remap(own), with_states=False, null_slot=layers.null_slot, prefill_tiles=prefill)
        batch.kv_exchange = exchange
        hidden = runner.model.forward(batch, layers)  # type: ignore[arg-type]  # indexed like PagedKV
    else:
        for layer in range(len(layers)):
            exchange(layers[layer])
        cfg = runner.model.cfg
        hidden = torch.empty((0, cfg.hidden_size), dtype=runner.model.dtype, device=runner.device)
    layers.settle()
    return hidden, counts
