"""The per-step description of a paged attention launch: each request's rows and the query tiles.

Built once per step on the host (the Triton backend's ``attention_plan``) and read by every layer's
launch of :mod:`kvwarden.layers.kernels.attention`, whose docstring gives the invariance argument the
tile grid serves: query tiles are aligned to absolute positions, ``block_q`` positions each. Which
``block_q`` (and how many warps run a tile) is the model's :class:`QueryTiles`: decode steps in tiles of
one position, every other step in tiles of 128 rows, where the GPU has shown both give the same bits
(:func:`query_tiles`); one ``BLOCK_Q`` for every step elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK_Q = 16  # query positions per tile (aligned to absolute position) where one tile serves every step
PREFILL_ROWS = 128  # a prefill tile's rows (positions x the padded GQA group) where decode tiles are smaller
PREFILL_WARPS, DECODE_WARPS, WARPS = 8, 1, 4
PREFILL_KEYS = 32  # keys per tile where the tiles are split (decode and prefill alike: one per model)


@dataclass(frozen=True)
class QueryTiles:
    """The query tiles of a model's attention launches: positions per tile and warps per program.

    A step whose every request computes one position (a decode, or a prompt chunk of one token) runs
    ``decode``-position tiles; every other step (prefill chunks, verify steps, mixed steps)
    ``prefill``-position tiles.

    NOTE(invariance): a row's bits must not depend on which of the two its step ran, so two different
    tile shapes are used only where :func:`query_tiles` says the GPU computes a row alike in both
    (``kvwarden bench attention_tiles --query-tiles`` measures it per head shape, every slot of a tile);
    elsewhere both are ``BLOCK_Q`` on ``WARPS`` warps: one compiled kernel for every step.
    """

    decode: int = BLOCK_Q
    prefill: int = BLOCK_Q
    decode_warps: int = WARPS
    prefill_warps: int = WARPS
    block_n: int = 0  # keys per tile for every step; 0: the head shape's (kernels/attention.key_tile)

    def __post_init__(self) -> None:
        for name in ("decode", "prefill", "decode_warps", "prefill_warps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"QueryTiles.{name} must be a power of two, got {value}")
        if self.prefill < BLOCK_Q:  # a graph's rows of one request (up to 16) must fit two prefill tiles
            raise ValueError(f"QueryTiles.prefill must be at least {BLOCK_Q} positions, got {self.prefill}")
        if self.block_n and (self.block_n & (self.block_n - 1) or self.block_n > 128):
            raise ValueError(f"QueryTiles.block_n must be 0 or a power of two up to 128, got {self.block_n}")

    def for_step(self, decode_only: bool) -> tuple[int, int]:
        """``(positions per tile, warps)`` of a step: all single-position decodes, or anything else."""
        return (self.decode, self.decode_warps) if decode_only else (self.prefill, self.prefill_warps)

    def meta_fields(self, decode_only: bool) -> dict[str, int]:
        """:class:`AttentionMeta`'s ``block_q``, ``warps`` and ``block_n`` for such a step."""
        block_q, warps = self.for_step(decode_only)
        return dict(block_q=block_q, warps=warps, block_n=self.block_n)


UNIFORM_TILES = QueryTiles()  # one BLOCK_Q tile on WARPS warps for every step
# GPU architectures (compute capabilities) where the split tiles were checked to give every decoded row the bits of
# its prefill row (`kvwarden bench attention_tiles --query-tiles` and the GPU tests; the shapes checked are listed in
# docs/architecture.md): Hopper.
SPLIT_TILE_ARCHS: frozenset[tuple[int, int]] = frozenset({(9, 0)})
# Where they are also faster: the (group, head sizes) pairs SPLIT_SHAPES names, each measured against the engine's
# uniform tile with `kvwarden bench attention_tiles` (figures in docs/performance.md and CHANGELOG.md); shapes not
# measured keep the uniform tile.
SPLIT_SHAPES: tuple[tuple[int, int, int], ...] = ((2, 1, 128), (8, 256, 256))  # (group, heads from, up to)


def query_tiles(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    capability: tuple[int, int] | None,
    verified: frozenset[tuple[int, int]] = SPLIT_TILE_ARCHS,
) -> QueryTiles:
    """A model's query tiles: one-position decode tiles beside 128-row prefill tiles where they keep the
    bits and are faster, else ``BLOCK_Q`` for every step.

    Args:
        num_heads, num_kv_heads, head_dim: the attention's shape (the GQA group sets a tile's rows).
        dtype: the model's (q, K and V).
        capability: the CUDA GPU's compute capability, None off a GPU.
        verified: the compute capabilities on which the split tiles were shown to keep the bits.

    Split tiles only in bfloat16 or float16 on a verified GPU architecture, for the GQA groups and head
    sizes in ``SPLIT_SHAPES``: GQA 2 with heads up to 128, GQA 8 with heads of 256. Whether a one-position
    tile on one warp and a 128-row tile on eight order a row's sums alike is up to the code Triton
    generates for the architecture, so it is measured (``kvwarden bench attention_tiles --query-tiles``, every
    slot of a tile, on real checkpoints' head shapes; the GPU tests' decode = prefill properties), not
    assumed. float32 runs the products on the CUDA cores (``input_precision="ieee"``), another layout, not
    part of that measurement; Triton's CPU interpreter multiplies with NumPy, whose blocking follows the
    matrix's rows (a one-position tile changed 94 of 95 rows there). Both keep the one tile.
    """
    rep = num_heads // num_kv_heads
    rp = 1 << max(0, rep - 1).bit_length()  # the group padded to a power of two, as the kernel pads it
    if capability not in verified or dtype not in (torch.bfloat16, torch.float16):
        return UNIFORM_TILES
    if not any(rep == group and low <= head_dim <= high for group, low, high in SPLIT_SHAPES):
        return UNIFORM_TILES
    # 128 rows: 64 positions x the group of 2, 16 x 8. Keys 32 a tile: a one-warp decode tile walks 16K keys
    # in 57 us against 54 at 64, 256 requests over 640 keys in 247 against 270, and the 64-position prefill
    # tile a 2,048-token chunk in 123 us against 132 (H100, GQA 2, head 128); at GQA 8 x 256 173 against 282
    # (b256 x 640), the decode tile over 16K keys 108 against 99, prefill 260 against 224.
    return QueryTiles(1, max(BLOCK_Q, PREFILL_ROWS // rp), decode_warps=DECODE_WARPS, prefill_warps=PREFILL_WARPS,
                      block_n=PREFILL_KEYS)  # fmt: skip


@dataclass(frozen=True)
class AttentionMeta:
    """Device tensors describing one step's requests and query tiles (built once per step).

    Attributes:
        seq_row0, seq_start, seq_nq: per request, its first row in the batch, the
            absolute position of its first query and its number of queries.
        block_tables: ``[requests, max_blocks]`` int32 KV block ids.
        tile_seq, tile_pos0: per query tile, its request and the absolute position
            of its first slot (a multiple of ``block_q``).
        max_keys: a bound on the step's longest context, which sizes the parallel splits: the
            exact figure in an eager step, the longest context served in a captured graph (whose
            steps' contexts vary; splits past a tile's keys then exit at once). 0: walk the splits.
        block_q: the query positions per tile the tiles were built for (the launch's tile size).
        warps: the warps of a tile's program (with ``block_q``, the model's :class:`QueryTiles`).
        block_n: keys per tile (the model's; 0: ``kernels/attention.key_tile`` of its head shape).
    """

    seq_row0: torch.Tensor
    seq_start: torch.Tensor
    seq_nq: torch.Tensor
    block_tables: torch.Tensor
    tile_seq: torch.Tensor
    tile_pos0: torch.Tensor
    max_keys: int = 0
    block_q: int = BLOCK_Q
    warps: int = WARPS
    block_n: int = 0

    @classmethod
    def build(
        cls,
        seqs: list[tuple[int, int, int, list[int]]],
        device: torch.device | str,
        block_q: int = BLOCK_Q,
        warps: int = WARPS,
        block_n: int = 0,
    ) -> AttentionMeta:
        """From ``(row_start, start_pos, num_queries, block_ids)`` per request; tiles of ``block_q`` positions
        (a power of two), each run by ``warps`` warps over ``block_n`` keys at a time."""
        if block_q < 1 or block_q & (block_q - 1):
            raise ValueError(f"block_q must be a power of two (a tile's rows are a tl.arange), got {block_q}")
        max_blocks = max((len(b) for *_, b in seqs), default=1) or 1
        tables = [b + [0] * (max_blocks - len(b)) for *_, b in seqs]
        tile_seq, tile_pos0 = [], []
        for i, (_, start, nq, _) in enumerate(seqs):
            for t in range(start // block_q, (start + nq - 1) // block_q + 1):
                tile_seq.append(i)
                tile_pos0.append(t * block_q)

        def t(values: list) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int32).to(device, non_blocking=True)

        return cls(
            seq_row0=t([s[0] for s in seqs]),
            seq_start=t([s[1] for s in seqs]),
            seq_nq=t([s[2] for s in seqs]),
            block_tables=t(tables),
            tile_seq=t(tile_seq),
            tile_pos0=t(tile_pos0),
            max_keys=max((start + nq for _, start, nq, _ in seqs), default=0),
            block_q=block_q,
            warps=warps,
            block_n=block_n,
        )

    @classmethod
    def for_step(
        cls, seqs: list[tuple[int, int, int, list[int]]], device: torch.device | str, tiles: QueryTiles
    ) -> AttentionMeta:
        """:meth:`build` with the tiles ``tiles`` gives a step of these requests."""
        return cls.build(seqs, device, **tiles.meta_fields(all(nq == 1 for _, _, nq, _ in seqs)))
