"""The deterministic top-k (the sparse-attention indexer's selection): set and order are a function of the scores.

Under Triton's interpreter on the CPU (``conftest.py`` sets ``TRITON_INTERPRET=1``), compiled on a GPU. The
Triton kernel must equal the stable-sort reference element for element, ties and masked (``-inf``) columns
included, whether one program or several own a row, and a row's result must not depend on the rows beside it.
"""

from __future__ import annotations

import pytest
import torch

from kvwarden.layers.kernels.topk import topk_reference, topk_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16]  # compared as float32 inside: bfloat16 scores tie far more often


def scores(seed: int, rows: int, n: int, dtype: torch.dtype, levels: int | None = None) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if levels is None:
        s = torch.randn(rows, n, generator=g)
    else:  # few distinct values: ties everywhere
        s = torch.randint(0, levels, (rows, n), generator=g).float() - levels / 2
    return s.to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("n", "k", "levels"),
    [(300, 17, None), (257, 64, 5), (64, 64, 3), (130, 1, 2), (9, 0, None), (9000, 100, None)],
)
def test_triton_top_k_equals_the_stable_order(dtype: torch.dtype, n: int, k: int, levels: int | None) -> None:
    s = scores(n + k, 5, n, dtype, levels)
    val, idx = topk_triton(s, k)
    ref_val, ref_idx = topk_reference(s, k)
    assert torch.equal(idx.cpu(), ref_idx.cpu())
    assert torch.equal(val.cpu(), ref_val.cpu())
    if k:
        chosen = s.float().gather(1, idx)
        assert torch.equal(chosen, val)  # the values are the chosen columns' scores
        for r in range(s.shape[0]):
            # the set: the first k of the total order (score descending, then column); returned in column order
            ranked = sorted(range(n), key=lambda c: (-float(s[r, c]), c))
            assert idx[r].tolist() == sorted(ranked[:k])


def test_split_rows_equal_one_program_per_row() -> None:
    # several programs per row (chunks of 256-2,048 columns) give the one-program answer, ties included; the
    # chunks' exact counts place each chunk's selection (ties at the threshold in several chunks)
    for dtype, levels, n, k in (
        (torch.float32, None, 5000, 300),
        (torch.bfloat16, 11, 4100, 700),
        (torch.float32, 3, 3000, 1),
    ):
        s = scores(n, 3, n, dtype, levels)
        want = topk_reference(s, k)
        shapes = ({"split": 0}, {"split": 1024, "block": 512}, {"split": 2048, "block": 1024, "masked": True})
        shapes += ({"split": 1024, "block": 512, "buckets": True}, {"split": 1024, "block": 512, "buckets": False})
        # chunks of 256: 12-20 splits a row, each split program re-deriving the prefix from all of them
        for shape in (*shapes, {"split": 256, "block": 256}, {"split": 256, "block": 256, "buckets": True}):
            got = topk_triton(s, k, **shape)
            assert torch.equal(got[1].cpu(), want[1].cpu()) and torch.equal(got[0].cpu(), want[0].cpu()), shape


SHAPES = [  # the kernel's shapes (kvwarden bench topk --variants times them): every one gives the same answer
    {"radix": 8, "block": 4096, "masked": False, "split": 0},
    {"radix": 11, "block": 1024, "masked": True, "split": 0},
    {"radix": 8, "block": 1024, "masked": False, "split": 2048},
    {"radix": 8, "block": 2048, "masked": False, "split": 0, "buckets": False},
    {"radix": 8, "block": 1024, "masked": False, "split": 2048, "buckets": True},
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "-".join(str(v) for v in s.values()))
def test_ties_at_the_threshold_are_taken_in_column_order_across_blocks(shape: dict) -> None:
    # 9,000 columns span several of the kernel's loop blocks (two to nine, by shape); 20 scores above the
    # threshold, 40 at it (10 in the first 4,096 columns, 30 later): k = 50 takes the first 30 of the 40 in
    # column order
    g = torch.Generator().manual_seed(3)
    s = -1.0 - torch.rand(1, 9000, generator=g)
    first, later = torch.randperm(4096, generator=g), 4096 + torch.randperm(4904, generator=g)
    tied = torch.cat([first[:10], later[:30]])
    high = torch.cat([first[10:20], later[30:40]])
    s[0, high] = torch.rand(20, generator=g) + 1.0
    s[0, tied] = 0.5
    s = s.to(DEVICE)
    val, idx = topk_triton(s, 50, **shape)
    ref_val, ref_idx = topk_reference(s, 50)
    assert torch.equal(idx.cpu(), ref_idx.cpu()) and torch.equal(val.cpu(), ref_val.cpu())
    assert idx[0].tolist() == sorted(high.tolist() + sorted(tied.tolist())[:30])


@pytest.mark.parametrize("shape", SHAPES[1:], ids=lambda s: "-".join(str(v) for v in s.values()))
def test_every_shape_equals_the_stable_order_under_ties(shape: dict) -> None:
    s = scores(5, 4, 300, torch.bfloat16, levels=9)
    val, idx = topk_triton(s, 70, **shape)
    ref_val, ref_idx = topk_reference(s, 70)
    assert torch.equal(idx.cpu(), ref_idx.cpu()) and torch.equal(val.cpu(), ref_val.cpu())


def f32(x: float | torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(x, dtype=torch.float32)


def buckets(s: torch.Tensor, lo: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    b = torch.where(s > lo, (s - lo) * scale, f32(0.0)).to(torch.int32).clamp(max=254) + 1
    return torch.where(s > float("-inf"), b, 0)


def choose(counts: torch.Tensor, need: int) -> tuple[int, int]:
    """The bucket holding the need-th largest key, and the count in the buckets above it."""
    from_top = counts.flip(0).cumsum(0).flip(0)
    b = int((from_top >= need).nonzero().max())
    return b, int(from_top[b] - counts[b])


def kernel_path(row: torch.Tensor, k: int) -> str:
    """The way the one-program kernel finds a row's threshold, computed here as the kernel does (float32
    arithmetic, same order), to show a test's rows take the branches they are meant to."""
    s = row.float().cpu()
    finite = s[s > float("-inf")]
    lo, hi = (finite.min(), s.max()) if len(finite) else (f32(float("inf")), f32(-float("inf")))
    width = hi - lo
    scale = f32(255.0) / width if width > 0 else f32(0.0)
    if not (width < 3.0e38 and scale < 3.0e38):
        return "passes"
    outer = buckets(s, lo, scale)
    b1, above = choose(torch.bincount(outer, minlength=256), k)
    if b1 == 0:
        return "-inf"
    if above + int((outer == b1).sum()) <= 2 * k:
        return "buckets"
    lo2 = lo + f32(b1 - 1) / scale
    hi2 = hi if b1 == 255 else lo + f32(b1) / scale
    width2 = hi2 - lo2
    scale2 = f32(255.0) / width2 if width2 > 0 else f32(0.0)
    if not scale2 < 3.0e38:
        return "passes"
    inner = buckets(s[outer == b1], lo2, scale2)
    b2, above2 = choose(torch.bincount(inner, minlength=256), k - above)
    return "sub-buckets" if above + above2 + int((inner == b2).sum()) <= 2 * k else "passes"


# the interpreter computes both sides of the kernel's guarded arithmetic in numpy (inf - inf, ...)
@pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")
def test_the_bucket_shortcut_and_the_whole_row_passes_agree_on_every_branch() -> None:
    # rows built for each branch of the one-program kernel: the threshold's bucket narrows the row to <= 2k
    # columns (the shortcut), or its sub-buckets do (a sink far above the rest), the threshold is -inf
    # (fewer than k visible keys; every score -inf), or the passes over the row: one score so far above
    # the rest that even the sub-buckets hold them all, heavy ties, every score equal, or no buckets at all
    # (+inf present, a range that overflows float32, a range of subnormals)
    g = torch.Generator().manual_seed(11)
    n, k = 5000, 64

    def normal() -> torch.Tensor:
        return torch.randn(n, generator=g)

    sink, outlier, masked, overflow, plus_inf = normal(), normal(), normal(), normal(), normal()
    sink[17] = 2000.0
    outlier[17] = 1.0e30
    masked[40:] = float("-inf")
    overflow[3], overflow[9] = 3.0e38, -3.0e38
    plus_inf[100] = float("inf")
    rows = {
        "fits": (normal(), "buckets"),
        "sink": (sink, "sub-buckets"),
        "masked": (masked, "-inf"),
        "all -inf": (torch.full((n,), float("-inf")), "-inf"),
        "outlier": (outlier, "passes"),
        "ties": (torch.randint(0, 3, (n,), generator=g).float(), "passes"),
        "equal": (torch.full((n,), 2.5), "passes"),
        "+inf": (plus_inf, "passes"),
        "overflow": (overflow, "passes"),
        "subnormal": (normal() * 1e-44, "passes"),
    }
    for name, (row, path) in rows.items():
        assert kernel_path(row, k) == path, name
    s = torch.stack([r for r, _ in rows.values()]).to(DEVICE)
    want = topk_reference(s, k)
    # one program a row with and without the shortcut, and the shortcut split over chunks of 1,024 columns:
    # every chunk derives the same range, buckets and sub-buckets from the chunks' exact counts (the row's
    # path above is the split form's too: its range is the minimum and maximum of its chunks')
    for shape in ({"buckets": True, "split": 0}, {"buckets": False, "split": 0}, {"buckets": True, "split": 1024}):
        got = topk_triton(s, k, block=1024, **shape)
        for i, name in enumerate(rows):
            assert torch.equal(got[1][i].cpu(), want[1][i].cpu()), (shape, name)
            assert torch.equal(got[0][i].cpu(), want[0][i].cpu()), (shape, name)


def test_split_buckets_place_each_chunks_share_from_the_counts_before_it() -> None:
    # the split shortcut's offsets: a list gathered over chunks holding none, some or many of its columns; and
    # rows whose threshold is -inf (fewer than k finite scores) compacted chunk by chunk, the -inf fill taken
    # from the lowest columns, inside one chunk or across two
    g = torch.Generator().manual_seed(5)
    n = 3000
    spread = torch.full((n,), -5.0) - torch.rand(n, generator=g)  # the 40 best: 25 in chunk 1, 15 in chunk 5
    spread[torch.randperm(512, generator=g)[:25] + 512] = torch.rand(25, generator=g) + 2.0
    spread[torch.randperm(440, generator=g)[:15] + 2560] = torch.rand(15, generator=g) + 2.0
    few = torch.full((n,), float("-inf"))
    few[500:530] = torch.randn(30, generator=g)  # 30 finite in chunks 0 and 1: the fill is columns 0-9
    across = torch.full((n,), float("-inf"))  # 230 finite in chunk 0 and 40 in chunk 5 (k = 300, chunks of 256):
    across[:230] = torch.randn(230, generator=g)  # the fill is 26 columns of chunk 0 and 4 of chunk 1
    across[1300:1340] = torch.randn(40, generator=g)
    for rows, k, chunk in (((spread, few), 40, 512), ((across,), 300, 256)):
        s = torch.stack(rows).to(DEVICE)
        want = topk_reference(s, k)
        got = topk_triton(s, k, split=chunk, block=256, buckets=True)
        for i in range(s.shape[0]):
            assert torch.equal(got[1][i].cpu(), want[1][i].cpu()), (k, i)
            assert torch.equal(got[0][i].cpu(), want[0][i].cpu()), (k, i)
    assert got[1][0].tolist() == list(range(230)) + list(range(230, 260)) + list(range(1300, 1340))
    assert torch.isinf(got[0][0, 230:260]).all()


def test_the_shape_picks_a_form_and_each_default_form_gives_the_same_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    # the automatic choice (split=None): the radix split for few rows, the bucket split for long rows the radix
    # split leaves to one program, one program otherwise; thresholds lowered so each runs at an interpreter size
    from kvwarden.layers.kernels import topk

    assert topk.split_plan(1, 65536) == (4096, False) and topk.split_plan(64, 65536) == (16384, True)
    assert topk.split_plan(128, 131072) == (16384, True) and topk.split_plan(256, 65536) == (0, topk.BUCKETS)
    assert topk.split_plan(64, 4096) == (0, topk.BUCKETS) and topk.split_plan(64, 1 << 20) == (0, topk.BUCKETS)
    # the caller's choice of the shortcut limits the forms to those with it, or without it
    assert topk.split_plan(64, 65536, False) == (0, False) and topk.split_plan(1, 65536, True) == (16384, True)
    assert topk.split_plan(1, 8192, True) == (0, True) and topk.split_plan(1, 8192, False) == (2048, False)
    # 11-bit digits run in one program per row whatever the shape (the split forms are 8-bit)
    wide = scores(3, 1, 3072, torch.float32)
    monkeypatch.setattr(topk, "SPLIT_FROM", 2048)
    want = topk_reference(wide, 200)
    assert all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(topk_triton(wide, 200, radix=11), want, strict=True))
    monkeypatch.undo()
    monkeypatch.setattr(topk, "SPLIT_SHAPES", ((None, 1024, 4),))
    monkeypatch.setattr(topk, "SPLIT_FROM", 2048)
    monkeypatch.setattr(topk, "SPLIT_PROGRAMS", 8)
    monkeypatch.setattr(topk, "BUCKET_SPLIT_FROM", 3000)
    monkeypatch.setattr(topk, "BUCKET_SPLIT_TO", 8000)
    monkeypatch.setattr(topk, "BUCKET_SPLIT_ROWS", 4)
    monkeypatch.setattr(topk, "BUCKET_SPLIT_SHAPE", (2048, 4))
    for rows, n, plan in ((2, 3072, (1024, False)), (4, 3072, (2048, True)), (5, 5000, (0, topk.BUCKETS))):
        assert topk.split_plan(rows, n) == plan
        s = scores(rows + n, rows, n, torch.bfloat16, 9)
        want, got = topk_reference(s, 200), topk_triton(s, 200)
        assert torch.equal(got[1].cpu(), want[1].cpu()) and torch.equal(got[0].cpu(), want[0].cpu()), plan


def test_signed_zeros_and_infinities_keep_the_order() -> None:
    # -0.0 and 0.0 are one score (ties by column); -inf ranks last, +inf first
    s = torch.tensor([[0.0, -0.0, 1.0, float("-inf"), -0.0, float("inf"), -1.0, 0.0]], device=DEVICE)
    for k, want in ((8, list(range(8))), (5, [0, 1, 2, 4, 5]), (4, [0, 1, 2, 5]), (7, [0, 1, 2, 4, 5, 6, 7])):
        val, idx = topk_triton(s, k)
        assert idx[0].tolist() == want, k
        assert torch.equal(val.cpu(), s[:, idx[0]].cpu())
        ref = topk_reference(s, k)
        assert torch.equal(ref[1].cpu(), idx.cpu()) and torch.equal(ref[0].cpu(), val.cpu())


def test_masked_columns_fill_last_in_column_order() -> None:
    s = scores(1, 3, 40, torch.float32)
    s[:, 7:] = float("-inf")  # a query that sees only 7 keys, asked for 10
    val, idx = topk_triton(s, 10)
    ref_val, ref_idx = topk_reference(s, 10)
    assert torch.equal(idx.cpu(), ref_idx.cpu()) and torch.equal(val.cpu(), ref_val.cpu())
    assert sorted(idx[0, :7].tolist()) == list(range(7))
    assert idx[0, 7:].tolist() == [7, 8, 9]
    assert torch.isinf(val[:, 7:]).all()


def test_a_rows_selection_does_not_depend_on_its_neighbours_or_the_batch() -> None:
    s = scores(2, 8, 200, torch.float32, levels=7)
    alone = [topk_triton(s[i : i + 1], 20) for i in range(8)]
    together = topk_triton(s, 20)
    for i, (val, idx) in enumerate(alone):
        assert torch.equal(idx[0], together[1][i]) and torch.equal(val[0], together[0][i])
    twice = topk_triton(s, 20)
    assert torch.equal(twice[1], together[1]) and torch.equal(twice[0], together[0])


def test_bad_shapes_and_k_name_the_problem() -> None:
    with pytest.raises(ValueError, match="radix must be 8 or 11"):
        topk_triton(torch.zeros(2, 4, device=DEVICE), 2, radix=9)
    with pytest.raises(ValueError, match=r"split \(1000\) must be a multiple of block \(512\)"):
        topk_triton(torch.zeros(2, 4, device=DEVICE), 2, split=1000, block=512)
    with pytest.raises(ValueError, match=r"radix 11 runs in one program per row \(split=0\)"):
        topk_triton(torch.zeros(2, 4, device=DEVICE), 2, split=1024, radix=11)
    with pytest.raises(ValueError, match=r"k must be in \[0, 4\]"):
        topk_triton(torch.zeros(2, 4, device=DEVICE), 5)
    with pytest.raises(ValueError, match=r"scores must be \[rows, n\]"):
        topk_reference(torch.zeros(4, device=DEVICE), 1)


def test_the_bench_prints_its_table_and_a_json_line_and_refuses_graphs_off_the_gpu() -> None:
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", "kvwarden", "bench", "topk", "--device", "cpu", "--quick", "--no-models"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=root)
    assert done.returncode == 0, done.stderr[-2000:]
    last = json.loads(done.stdout.strip().splitlines()[-1])
    assert last["bench"] == "topk" and last["graphs"] is False
    assert [(r["keys"], r["rows"]) for r in last["selection"]] == [(4096, 1), (4096, 16)]
    assert all(r["torch_topk_ms"] > 0 and r["deterministic_ms"] > 0 for r in last["selection"])
    refused = subprocess.run([*cmd, "--graphs"], capture_output=True, text=True, timeout=120, cwd=root)
    assert refused.returncode == 2 and "--graphs times the --variants shapes on a CUDA device" in refused.stderr
