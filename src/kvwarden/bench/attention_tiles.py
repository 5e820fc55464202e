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
``--heads`` for others), bfloat16 (``--dtype``), 16-token blocks. Ends with one JSON line.

``--query-tiles DECODE,PREFILL`` (the check behind ``attention_meta.query_tiles``, which gives a
GPU model in half precision decode tiles of one position and prefill tiles of 128 rows) also
builds the decode metas with tiles of ``DECODE`` positions and the prefill's with ``PREFILL``
(``AttentionMeta.build(block_q=...)``), and reports, per candidate: whether the decode
of ~96 positions (tile and split edges, random ones), each in a ``DECODE``-position tile, equals the
prefill's rows in ``PREFILL``-position tiles (bitwise; how many do), whether that prefill equals the
``BLOCK_Q``-tile prefill on every row (else how many rows differ), and the decode timings with
``DECODE`` tiles and the prefill's with ``PREFILL`` tiles.
``--prefill-warps N`` runs the ``PREFILL``-tile prefill launches with ``N`` warps (default: the
candidate's), for large tiles (64 positions x GQA 2 = 128 rows x head 128).

    kvwarden bench attention_tiles
    kvwarden bench attention_tiles --heads 32,8,128 --candidate 32,4,2 --candidate 64,4,2   # Llama-3-8B's GQA 4
    kvwarden bench attention_tiles --candidate 64,4,2,1024 --candidate 64,4,2,256           # split lengths
    kvwarden bench attention_tiles --query-tiles 1,64 --candidate 64,4,2 --candidate 64,1,2 --prefill-warps 8
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch

from kvwarden.bench.floor import copy_bandwidth

CANDIDATES = [(32, 4, 2), (32, 4, 3), (64, 4, 2), (64, 4, 3), (64, 8, 3), (128, 8, 2), (128, 8, 3)]
BLOCK = 16


def decode_meta(perm: torch.Tensor, ctx: int, block_q: int | None = None) -> object:
    """Decode of position ``ctx - 1`` for each request of ``perm`` (tiles of ``block_q`` positions)."""
    from kvwarden.layers.kernels.attention import BLOCK_Q, AttentionMeta

    seqs = [(i, ctx - 1, 1, perm[i].tolist()) for i in range(perm.shape[0])]
    return AttentionMeta.build(seqs, "cuda", block_q=block_q or BLOCK_Q)


def setup(batch: int, ctx: int, heads: tuple[int, int, int], gen: torch.Generator, dtype: torch.dtype) -> tuple:
    """A cache holding ``batch`` contexts of ``ctx`` keys, shuffled blocks; decode queries at position ctx - 1."""
    hq, hkv, d = heads
    blocks = -(-ctx // BLOCK)
    perm = torch.randperm(batch * blocks, generator=gen).view(batch, blocks)
    k = (torch.randn((batch * blocks * BLOCK, hkv, d), generator=gen) * 0.5).to(dtype).cuda()
    v = torch.randn((batch * blocks * BLOCK, hkv, d), generator=gen).to(dtype).cuda()
    q = torch.randn((batch, hq, d), generator=gen).to(dtype).cuda()
    return q, k, v, decode_meta(perm, ctx), perm


def time_us(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: object, cand: tuple[int, ...]) -> float:
    from triton.testing import do_bench

    from kvwarden.layers.kernels.attention import paged_attention

    return do_bench(lambda: paged_attention(q, k, v, meta, BLOCK, q.shape[-1] ** -0.5, tiles=cand), rep=40) * 1e3


def summarize(figures: dict[str, Any]) -> list[tuple[str, str]]:
    """One (label, value) pair per line of the GPU script's summary: tiles per candidate, then --query-tiles'."""
    rows = figures["rows"]
    tiles = [(tuple(r["tiles"]), r["decode_equals_prefill"], _us(r), round(r["prefill_us"])) for r in rows]
    out = [("(tiles, decode=prefill, us, prefill us)", str(tiles))]
    qrows = [r for r in rows if "positions" in r.get("query_tiles", {})]
    if qrows:
        heads = ",".join(str(h) for h in figures.get("heads", ()))
        dec, pre = figures.get("query_tiles") or ("?", "?")
        label = f"query tiles {heads} {figures.get('dtype', '')} {dec},{pre}: "
        label += "(tiles, dec=pre rows, pre=16-tile pre, dec us, pre us)"
        out.append((label, str([_qtiles(r) for r in qrows])))
    return out


def _qtiles(r: dict[str, Any]) -> tuple:
    """One candidate's --query-tiles figures, then its 16-position tile's times beside them."""
    q = r["query_tiles"]
    rows_equal = f"{q['positions'] - q['decode_rows_differ']}/{q['positions']}"
    return (
        r["tiles"][0],
        rows_equal,
        q["prefill_equals_default"],
        _us(q),
        round(q["prefill_us"]),
        _us(r),
        round(r["prefill_us"]),
    )


def _us(r: dict[str, Any]) -> list[int]:
    return [round(v) for v in r["us"].values()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--candidate", action="append", default=None, help="BLOCK_N,warps,stages[,split] (repeatable)")
    p.add_argument("--heads", default="16,8,128", help="query heads, KV heads, head size (Llama-3-8B: 32,8,128)")
    p.add_argument("--query-tiles", default=None, help="DECODE,PREFILL: query tile positions to compare (e.g. 1,64)")
    p.add_argument("--prefill-warps", type=int, default=None, help="warps of the PREFILL-tile prefill launches")
    p.add_argument(
        "--base-warps",
        type=int,
        default=None,
        help="warps of the baseline (16-position tile) launches; default the candidate's (the engine: 4)",
    )
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"), help="q/k/v dtype")
    args = p.parse_args()
    qt = None
    if args.query_tiles:
        parts = args.query_tiles.split(",")
        qt = tuple(int(x) for x in parts) if all(x.strip().isdigit() for x in parts) else ()
        if len(qt) != 2 or any(x < 1 or x & (x - 1) for x in qt):  # tl.arange needs powers of two
            p.error(f"--query-tiles takes DECODE,PREFILL, two powers of two (e.g. 1,64), got {args.query_tiles!r}")
    if args.prefill_warps is not None and qt is None:
        p.error("--prefill-warps applies to --query-tiles' prefill launches: give --query-tiles too")
    if not torch.cuda.is_available():
        raise SystemExit("kvwarden bench attention_tiles times compiled kernels: it needs a CUDA GPU")
    heads = tuple(int(x) for x in args.heads.split(","))
    from kvwarden.layers.kernels.attention import AttentionMeta, paged_attention

    cands = [tuple(map(int, c.split(","))) for c in args.candidate] if args.candidate else CANDIDATES
    dtype, scale = getattr(torch, args.dtype), heads[2] ** -0.5
    gen = torch.Generator().manual_seed(0)
    bw = copy_bandwidth("cuda")
    shapes = (("b1x16K", 1, 16384), ("b1x1K", 1, 1025), ("b64x512", 64, 512), ("b256x640", 256, 640))
    cases = {name: setup(b, ctx, heads, gen, dtype) for name, b, ctx in shapes}
    # one 2,048-token prompt: the prefill chunk, and the decode of its last position from the same cache
    _, pk, pv, pmeta, pperm = setup(1, 2048, heads, gen, dtype)
    q_pre = torch.randn((2048, heads[0], heads[2]), generator=gen).to(dtype).cuda()
    blocks = pperm[0].tolist()
    pre_meta = AttentionMeta.build([(0, 0, 2048, blocks)], "cuda")
    if qt:  # the same launches with tiles of qt[0] (decode) and qt[1] (prefill) positions
        q_metas = {name: decode_meta(cases[name][4], ctx, qt[0]) for name, _, ctx in shapes}
        # decodes of many positions of the prompt (tile edges, split edges, random), one request each
        pos = sorted({0, 1, 15, 16, 17, 63, 64, 65, 127, 128, 511, 512, 513, 1023, 1024, 2046, 2047}
                     | set(torch.randint(0, 2048, (79,), generator=gen).tolist()))  # fmt: skip
        q_pmeta = AttentionMeta.build([(i, p, 1, blocks) for i, p in enumerate(pos)], "cuda", block_q=qt[0])
        q_pre_meta = AttentionMeta.build([(0, 0, 2048, blocks)], "cuda", block_q=qt[1])
    print(f"{torch.cuda.get_device_name()}, copy bandwidth {bw / 1e12:.2f} TB/s; heads {args.heads}, {args.dtype}")
    head = "| BLOCK_N, warps, stages[, split] | decode = prefill row | " + " | ".join(f"{n} us" for n in cases)
    extra = ""
    if qt:
        extra = f" decode({qt[0]}) = prefill({qt[1]}) rows | prefill({qt[1]}) = prefill | "
        extra += " | ".join(f"{n} us ({qt[0]})" for n in cases) + f" | prefill 2048 us ({qt[1]}) |"
    print(head + " | prefill 2048 us |" + extra)
    print("|---" * (3 + len(cases) + (3 + len(cases) if qt else 0)) + "|")
    floors = {n: c[1].numel() * 2 * c[1].element_size() / bw * 1e6 for n, c in cases.items()}
    print("| KV bytes at bandwidth | | " + " | ".join(f"{f:.1f}" for f in floors.values()) + " | |")
    rows = []
    for cand in cands:
        # the baseline column: the 16-position tile, on the candidate's warps or --base-warps (one warp at
        # 128 rows x head 256 spills and runs for minutes; the engine runs that tile on 4)
        base = (cand[0], args.base_warps or cand[1], *cand[2:])
        try:
            whole = paged_attention(q_pre, pk, pv, pre_meta, BLOCK, scale, tiles=base)
            last = paged_attention(q_pre[-1:], pk, pv, pmeta, BLOCK, scale, tiles=base)
            same = torch.equal(last, whole[-1:])
            us = {n: time_us(*c[:4], base) for n, c in cases.items()}
            us_pre = time_us(q_pre, pk, pv, pre_meta, base)
        except Exception as exc:  # a candidate that does not fit (shared memory, registers) is reported and skipped
            print(f"| {cand} | {type(exc).__name__}: {str(exc)[:80]} |")
            continue
        row = dict(tiles=list(cand), base_tiles=list(base), decode_equals_prefill=same, us=us, prefill_us=us_pre)
        line = f"| {cand} | {same} | " + " | ".join(f"{t:.1f}" for t in us.values()) + f" | {us_pre:.1f} |"
        if qt:
            pre_cand = (cand[0], args.prefill_warps or cand[1], *cand[2:])
            qrow: dict = dict(decode=qt[0], prefill=qt[1], prefill_tiles=list(pre_cand))
            try:
                whole_q = paged_attention(q_pre, pk, pv, q_pre_meta, BLOCK, scale, tiles=pre_cand)
                dec_q = paged_attention(q_pre[pos], pk, pv, q_pmeta, BLOCK, scale, tiles=cand)
                differ = int((whole_q != whole).flatten(1).any(1).sum())  # rows of the prefill off its bits
                dec_differ = int((dec_q != whole_q[pos]).flatten(1).any(1).sum())  # decodes off the prefill's
                qrow.update(decode_equals_prefill=dec_differ == 0, decode_rows_differ=dec_differ, positions=len(pos))
                qrow.update(prefill_equals_default=torch.equal(whole_q, whole), prefill_rows_differ=differ)
                qrow.update(us={n: time_us(*cases[n][:3], q_metas[n], cand) for n in cases})
                qrow.update(prefill_us=time_us(q_pre, pk, pv, q_pre_meta, pre_cand))
                eq = "True" if qrow["prefill_equals_default"] else f"False ({differ} rows differ)"
                line += f" {len(pos) - dec_differ}/{len(pos)} | {eq} | "
                line += " | ".join(f"{t:.1f}" for t in qrow["us"].values()) + f" | {qrow['prefill_us']:.1f} |"
            except Exception as exc:  # reported, not fatal: the candidate's BLOCK_Q row stands
                qrow["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                line += f" {type(exc).__name__}: {str(exc)[:80]} |"
            row["query_tiles"] = qrow
        print(line, flush=True)
        rows.append(row)
    result = {"bench": "attention_tiles", "device": torch.cuda.get_device_name(), "heads": heads, "dtype": args.dtype}
    result["bandwidth"] = bw
    if qt:
        result.update(query_tiles=list(qt), prefill_warps=args.prefill_warps)
    print(json.dumps({**result, "floors_us": floors, "rows": rows}))


if __name__ == "__main__":
    main()
