"""The attention's query tiles: which tiles a model's steps get, and that a graph's buffers build the tiles an
eager step of the same requests builds.

Whether two tile shapes give a row the same bits is a property of the GPU's compiled kernels: the GPU tests
(tests/test_triton_engine.py's decode = prefill and graph = eager properties, in bfloat16) and
``kvwarden bench attention_tiles --query-tiles`` check it there. Here: the policy, and the tile grids.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch

from kvwarden.engine.graph_batch import GraphBatch
from kvwarden.engine.request import Request
from kvwarden.engine.scheduler import ScheduledChunk
from kvwarden.layers.kernels.attention_meta import (
    BLOCK_Q,
    SPLIT_TILE_ARCHS,
    UNIFORM_TILES,
    AttentionMeta,
    QueryTiles,
    query_tiles,
)

SPLIT_TILES = QueryTiles(decode=1, prefill=64, decode_warps=1, prefill_warps=8, block_n=32)


HOPPER = frozenset({(9, 0)})


def test_gpu_half_precision_gqa_2_gets_one_position_decode_tiles_beside_128_row_prefill_tiles() -> None:
    """Qwen3-0.6B's shape (16 query heads, 8 KV heads, head 128): 64-position prefill tiles, 32-key tiles."""
    for dtype in (torch.bfloat16, torch.float16):
        for heads, kv_heads, head_dim in ((16, 8, 128), (32, 16, 64), (4, 2, 16)):
            tiles = query_tiles(heads, kv_heads, head_dim, dtype, (9, 0), verified=HOPPER)
            assert tiles == QueryTiles(decode=1, prefill=64, decode_warps=1, prefill_warps=8, block_n=32)
            assert tiles.for_step(decode_only=True) == (1, 1) and tiles.for_step(decode_only=False) == (64, 8)


def test_qwen3_next_heads_get_one_position_decode_tiles_beside_16_position_prefill_tiles() -> None:
    """Qwen3-Next's 16 query heads over 2 KV heads of 256 (GQA 8): 16 positions x 8 = the same 128 rows."""
    tiles = query_tiles(16, 2, 256, torch.bfloat16, (9, 0), verified=HOPPER)
    assert tiles == QueryTiles(decode=1, prefill=16, decode_warps=1, prefill_warps=8, block_n=32)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"),
    [(32, 8, 128), (14, 2, 64), (8, 2, 256), (64, 8, 128), (16, 8, 256), (16, 16, 128), (32, 8, 256)],
    ids=["gqa4", "gqa7", "qwen3-next-preset-gqa4", "gqa8-head128", "head256", "mha", "gqa4-head256"],
)
def test_shapes_where_split_tiles_are_not_faster_or_not_measured_keep_one_tile(
    heads: int, kv_heads: int, head_dim: int
) -> None:
    assert query_tiles(heads, kv_heads, head_dim, torch.bfloat16, (9, 0), verified=HOPPER) == UNIFORM_TILES


def test_float32_the_cpu_and_unverified_gpus_keep_one_tile_for_every_step() -> None:
    assert query_tiles(16, 8, 128, torch.float32, (9, 0), verified=HOPPER) == UNIFORM_TILES
    assert query_tiles(16, 8, 128, torch.bfloat16, None, verified=HOPPER) == UNIFORM_TILES  # the CPU
    assert query_tiles(16, 8, 128, torch.bfloat16, (8, 0), verified=HOPPER) == UNIFORM_TILES  # not measured there
    # by default, the architectures recorded in attention_meta.SPLIT_TILE_ARCHS: Hopper
    assert SPLIT_TILE_ARCHS == HOPPER
    assert query_tiles(16, 8, 128, torch.bfloat16, (9, 0)).for_step(True) == (1, 1)
    assert query_tiles(16, 8, 128, torch.bfloat16, (1, 0)) == UNIFORM_TILES
    assert UNIFORM_TILES.for_step(True) == UNIFORM_TILES.for_step(False) == (BLOCK_Q, 4)
    assert UNIFORM_TILES.block_n == 0  # the head shape's key tile (kernels/attention.key_tile)


def test_a_step_of_decodes_only_gets_the_decode_tile_any_other_the_prefill_tile() -> None:
    blocks = list(range(8))
    decodes = [(0, 37, 1, blocks), (1, 64, 1, blocks), (2, 0, 1, blocks)]
    meta = AttentionMeta.for_step(decodes, "cpu", SPLIT_TILES)
    assert (meta.block_q, meta.warps, meta.block_n) == (1, 1, 32)
    assert meta.tile_seq.tolist() == [0, 1, 2] and meta.tile_pos0.tolist() == [37, 64, 0]
    # one request with a prompt chunk (or drafts) turns the whole step to prefill tiles, its decodes too
    mixed = [*decodes, (3, 60, 10, blocks)]
    meta = AttentionMeta.for_step(mixed, "cpu", SPLIT_TILES)
    assert (meta.block_q, meta.warps, meta.block_n) == (64, 8, 32)
    assert meta.tile_seq.tolist() == [0, 1, 2, 3, 3] and meta.tile_pos0.tolist() == [0, 64, 0, 0, 64]


def test_a_tile_of_positions_that_are_not_a_power_of_two_is_refused() -> None:
    for bad in (0, 3, 48):
        with pytest.raises(ValueError, match=f"block_q must be a power of two.*got {bad}"):
            AttentionMeta.build([(0, 0, 4, [0])], "cpu", block_q=bad)


class _Tables:
    """Block tables by request id (the engine's own is ``BlockTables`` over the KV manager)."""

    def __init__(self, rows: dict[str, list[int]]) -> None:
        self.rows = {k: np.array(v, dtype=np.int32) for k, v in rows.items()}

    def block_row(self, request_id: str) -> np.ndarray:
        return self.rows[request_id]


def _tile_set(meta: AttentionMeta, requests: int) -> set[tuple[int, int]]:
    """The (request, first position) of every tile of a real request (a graph's spare tiles point past them)."""
    pairs = zip(meta.tile_seq.tolist(), meta.tile_pos0.tolist(), strict=True)
    return {(s, p) for s, p in pairs if s < requests}


@pytest.mark.parametrize("tiles", [UNIFORM_TILES, SPLIT_TILES], ids=["uniform", "split"])
def test_graph_buffers_build_the_tiles_an_eager_step_of_the_same_requests_builds(tiles: QueryTiles) -> None:
    gen = torch.Generator().manual_seed(3)
    block_size, size = 16, 4
    lengths = [70, 130, 5]  # tokens held; a decode computes the last, a prompt tail the last few
    reqs = [
        Request(request_id=f"r{i}", all_token_ids=torch.randint(0, 100, (n,), generator=gen).tolist())
        for i, n in enumerate(lengths)
    ]
    tables = _Tables({r.request_id: list(range(10 * i, 10 * i + 9)) for i, r in enumerate(reqs)})
    buffers = GraphBatch(torch.device("cpu"), size, 16, block_size, 144, 10_000, tiles, None)

    def eager(chunks: list[ScheduledChunk]) -> AttentionMeta:
        shares = [
            (i, c.start, c.num_tokens, tables.block_row(c.request.request_id).tolist()) for i, c in enumerate(chunks)
        ]
        return AttentionMeta.for_step(shares, "cpu", tiles)

    decode = [ScheduledChunk(r, r.num_tokens - 1, 1) for r in reqs]
    buffers.stage(decode, tables, size, 1)
    graph, want = buffers.forward_batch(size, 1).plan.meta, eager(decode)
    assert (graph.block_q, graph.warps) == (want.block_q, want.warps) == tiles.for_step(True)
    assert graph.block_n == want.block_n == tiles.block_n
    assert _tile_set(graph, len(reqs)) == _tile_set(want, len(reqs))
    assert graph.seq_start[: len(reqs)].tolist() == [n - 1 for n in lengths]

    tails = [ScheduledChunk(r, max(0, r.num_tokens - 12), min(12, r.num_tokens)) for r in reqs]  # 62..69, ...
    buffers.stage(tails, tables, size, 16)
    graph = buffers.forward_batch(size, 16).plan.meta
    # the graph pads every request to 16 rows: the eager step of 16-row chunks from the same starts
    want = eager([ScheduledChunk(c.request, c.start, 16) for c in tails])
    assert (graph.block_q, graph.warps) == (want.block_q, want.warps) == tiles.for_step(False)
    assert graph.block_n == want.block_n == tiles.block_n
    assert _tile_set(graph, len(reqs)) == _tile_set(want, len(reqs))


def test_query_tiles_refuse_shapes_the_kernel_cannot_run() -> None:
    for bad, match in (
        (dict(decode=3), "decode must be a power of two, got 3"),
        (dict(prefill=48), "prefill must be a power of two, got 48"),
        (dict(decode=1, prefill=8), "prefill must be at least 16 positions, got 8"),
        (dict(block_n=48), "block_n must be 0 or a power of two up to 128, got 48"),
        (dict(prefill_warps=6), "prefill_warps must be a power of two, got 6"),
    ):
        with pytest.raises(ValueError, match=match):
            QueryTiles(**bad)


def test_the_model_runner_hands_its_tiles_to_every_plan_and_to_its_graphs(
    llama_tiny: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the CPU a model gets the one tile; with the split tiles chosen (as on a Hopper GPU), eager plans,
    the MTP head's fill (``prefill_tiles``) and the graphs' buffers all carry them. Plans only: the
    interpreter's products are not the GPU's, so no forward runs here."""
    from kvwarden import LLM
    from kvwarden.engine import model_runner
    from kvwarden.engine.model_runner import BatchEntry

    make = partial(LLM, str(llama_tiny), device="cpu", kernels="triton", cuda_graphs="emulate", num_blocks=64)
    assert make().engine.runner.query_tiles == UNIFORM_TILES
    monkeypatch.setattr(model_runner, "query_tiles", lambda *_: SPLIT_TILES)
    runner = make().engine.runner
    assert runner.query_tiles == SPLIT_TILES
    assert runner.graphs is not None and runner.graphs.tiles == SPLIT_TILES
    assert runner.graphs.buffers.query_tiles == SPLIT_TILES
    blocks = [0, 1, 2, 3]
    decodes = [BatchEntry("a", [5], 20, blocks), BatchEntry("b", [6], 9, blocks)]
    meta = runner.make_batch(decodes).plan.meta
    assert (meta.block_q, meta.warps, meta.block_n) == (1, 1, 32)
    meta = runner.make_batch(decodes, with_states=False, prefill_tiles=True).plan.meta
    assert (meta.block_q, meta.warps, meta.block_n) == (64, 8, 32)
    meta = runner.make_batch([*decodes, BatchEntry("c", [1, 2, 3], 0, blocks)]).plan.meta
    assert (meta.block_q, meta.warps, meta.block_n) == (64, 8, 32)


def test_the_mtp_drafting_graph_builds_the_tiles_its_eager_drafting_builds(
    qwen3_next_tiny: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The MTP head's drafting graph (emulated: its static buffers, staged as on a GPU) with the split tiles:
    round 0, each request's kept rows, in the prefill tiles the eager fill builds (``prefill_tiles``); the
    next round, one row a request, in the decode tiles an eager step of single rows builds. Plans only, as
    above; the two tile sizes differ here, so staging either round in the other's tiles fails."""
    from kvwarden import LLM
    from kvwarden.engine import model_runner
    from kvwarden.engine.model_runner import BatchEntry

    monkeypatch.setattr(model_runner, "query_tiles", lambda *_: SPLIT_TILES)
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    llm = LLM(str(qwen3_next_tiny), device="cpu", kernels="triton", cuda_graphs="emulate", num_blocks=64,
              block_size=16, max_num_seqs=4, speculative_config=spec)  # fmt: skip
    runner, graphs = llm.engine.runner, llm.engine.speculator.proposer.graphs
    assert graphs is not None and graphs.tiles == SPLIT_TILES
    gen = torch.Generator().manual_seed(5)
    lengths, starts = [66, 130, 5], [63, 126, 2]  # kept rows 63-64 (across a 64-position tile), 126-128, 2-3
    reqs = [
        Request(request_id=f"r{i}", all_token_ids=torch.randint(0, 100, (n,), generator=gen).tolist())
        for i, n in enumerate(lengths)
    ]
    blocks = {r.request_id: list(range(10 * i, 10 * i + 9)) for i, r in enumerate(reqs)}
    chunks = [ScheduledChunk(r, p, r.num_tokens - p) for r, p in zip(reqs, starts, strict=True)]
    size = graphs.target.size_for(len(chunks))
    graphs._stage(chunks, [2, 2, 2], size, blocks.__getitem__)

    fill = graphs._batch(size, 0, graphs.longs[0, : size * graphs.q]).plan.meta
    entries = [
        BatchEntry(r.request_id, r.all_token_ids[p + 1 :], p, blocks[r.request_id])
        for r, p in zip(reqs, starts, strict=True)
    ]
    want = runner.make_batch(entries, with_states=False, prefill_tiles=True).plan.meta
    assert (fill.block_q, fill.warps, fill.block_n) == (want.block_q, want.warps, want.block_n) == (64, 8, 32)
    assert _tile_set(fill, len(reqs)) == _tile_set(want, len(reqs)) == {(0, 0), (0, 64), (1, 64), (1, 128), (2, 0)}

    round1 = graphs._batch(size, 1, torch.zeros(size, dtype=torch.long)).plan.meta
    singles = [BatchEntry(r.request_id, [0], r.num_tokens - 1, blocks[r.request_id]) for r in reqs]
    want = runner.make_batch(singles, with_states=False).plan.meta
    assert (round1.block_q, round1.warps, round1.block_n) == (want.block_q, want.warps, want.block_n) == (1, 1, 32)
    assert _tile_set(round1, len(reqs)) == _tile_set(want, len(reqs)) == {(i, n - 1) for i, n in enumerate(lengths)}
