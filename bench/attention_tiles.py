"""The paged attention kernel's key tile, warps and stages, timed on decode and prefill shapes.

Each candidate ``(BLOCK_N, num_warps, num_stages[, split])`` is one compiled form of
``kernels/attention.py`` (``paged_attention(tiles=...)``; the split length defaults to the
module's ``SPLIT``). ``BLOCK_N`` and the split move the online softmax's rescale and fold
points, so a change of either changes the bits of every step alike: the engine uses one for
every step. For each candidate this checks
the property that matters (a decode step of position ``p`` equals row ``p`` of
the prefill that wrote the cache, bitwise) and times: decode at batch 1 over a
16K and a 1K context (the splits in parallel), batch 64 over 512 keys, batch 256 over
640, and one 2,048-token prefill chunk, beside the KV bytes at the measured copy
bandwidth. Qwen3-0.6B's attention shape by default (16 query heads, 8 KV heads, head 128;
``--heads`` for others), bfloat16, 16-token blocks. Ends with one JSON line.

    python bench/attention_tiles.py
    python bench/attention_tiles.py --heads 32,8,128 --candidate 32,4,2 --candidate 64,4,2   # Llama-3-8B's GQA 4
    python bench/attention_tiles.py --candidate 64,4,2,1024 --candidate 64,4,2,256           # split lengths
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_rows import copy_bandwidth

CANDIDATES = [(32, 4, 2), (32, 4, 3), (64, 4, 2), (64, 4, 3), (64, 8, 3), (128, 8, 2), (128, 8, 3)]
BLOCK = 16


def setup(batch: int, ctx: int, heads: tuple[int, int, int], gen: torch.Generator, dtype: torch.dtype) -> tuple:
    """A cache holding ``batch`` contexts of ``ctx`` keys, shuffled blocks; decode queries at position ctx - 1."""
    from kvwarden.layers.kernels.attention import AttentionMeta

    hq, hkv, d = heads
    blocks = -(-ctx // BLOCK)
    perm = torch.randperm(batch * blocks, generator=gen).view(batch, blocks)
    k = (torch.randn((batch * blocks * BLOCK, hkv, d), generator=gen) * 0.5).to(dtype).cuda()
    v = torch.randn((batch * blocks * BLOCK, hkv, d), generator=gen).to(dtype).cuda()
    q = torch.randn((batch, hq, d), generator=gen).to(dtype).cuda()
    meta = AttentionMeta.build([(i, ctx - 1, 1, perm[i].tolist()) for i in range(batch)], "cuda")
    return q, k, v, meta, perm


def time_us(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: object, cand: tuple[int, ...]) -> float:
    from triton.testing import do_bench

    from kvwarden.layers.kernels.attention import paged_attention

    return do_bench(lambda: paged_attention(q, k, v, meta, BLOCK, q.shape[-1] ** -0.5, tiles=cand), rep=40) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--candidate", action="append", default=None, help="BLOCK_N,warps,stages[,split] (repeatable)")
    p.add_argument("--heads", default="16,8,128", help="query heads, KV heads, head size (Llama-3-8B: 32,8,128)")
    args = p.parse_args()
    heads = tuple(int(x) for x in args.heads.split(","))
    from kvwarden.layers.kernels.attention import AttentionMeta, paged_attention

    cands = [tuple(map(int, c.split(","))) for c in args.candidate] if args.candidate else CANDIDATES
    dtype, scale = torch.bfloat16, heads[2] ** -0.5
    gen = torch.Generator().manual_seed(0)
    bw = copy_bandwidth("cuda")
    cases = {
        name: setup(b, ctx, heads, gen, dtype)
        for name, b, ctx in (("b1x16K", 1, 16384), ("b1x1K", 1, 1025), ("b64x512", 64, 512), ("b256x640", 256, 640))
    }
    # one 2,048-token prompt: the prefill chunk, and the decode of its last position from the same cache
    _, pk, pv, pmeta, pperm = setup(1, 2048, heads, gen, dtype)
    q_pre = torch.randn((2048, heads[0], heads[2]), generator=gen).to(dtype).cuda()
    pre_meta = AttentionMeta.build([(0, 0, 2048, pperm[0].tolist())], "cuda")
    print(f"{torch.cuda.get_device_name()}, copy bandwidth {bw / 1e12:.2f} TB/s; heads {args.heads}, bfloat16")
    head = "| BLOCK_N, warps, stages[, split] | decode = prefill row | " + " | ".join(f"{n} us" for n in cases)
    print(head + " | prefill 2048 us |")
    print("|---" * (3 + len(cases)) + "|")
    floors = {n: c[1].numel() * 2 * c[1].element_size() / bw * 1e6 for n, c in cases.items()}
    print("| KV bytes at bandwidth | | " + " | ".join(f"{f:.1f}" for f in floors.values()) + " | |")
    rows = []
    for cand in cands:
        try:
            whole = paged_attention(q_pre, pk, pv, pre_meta, BLOCK, scale, tiles=cand)
            last = paged_attention(q_pre[-1:], pk, pv, pmeta, BLOCK, scale, tiles=cand)
            same = torch.equal(last, whole[-1:])
            us = {n: time_us(*c[:4], cand) for n, c in cases.items()}
            us_pre = time_us(q_pre, pk, pv, pre_meta, cand)
        except Exception as exc:  # a candidate that does not fit (shared memory, registers) is reported and skipped
            print(f"| {cand} | {type(exc).__name__}: {str(exc)[:80]} |")
            continue
        print(f"| {cand} | {same} | " + " | ".join(f"{t:.1f}" for t in us.values()) + f" | {us_pre:.1f} |", flush=True)
        rows.append(dict(tiles=list(cand), decode_equals_prefill=same, us=us, prefill_us=us_pre))
    result = {"bench": "attention_tiles", "device": torch.cuda.get_device_name(), "heads": heads, "bandwidth": bw}
    print(json.dumps({**result, "floors_us": floors, "rows": rows}))


if __name__ == "__main__":
    main()
