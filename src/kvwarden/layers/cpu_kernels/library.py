"""The compiled CPU kernels as Python callables over torch tensors (``ctypes``, pointers and sizes).

Every wrapper checks what the C side assumes (float32, contiguous rows, shapes)
and raises ``ValueError`` naming the argument otherwise: a pointer handed to C
with the wrong layout would read the wrong memory, not fail.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass, field

import torch

from kvwarden.layers.cpu_kernels.build import BuildError, build

log = logging.getLogger(__name__)

F32 = torch.float32
_I64 = ctypes.c_int64
_P = ctypes.c_void_p
_INT = ctypes.c_int


def _threads() -> int:
    """The calling thread's operator threads, as torch counts them: OpenMP keeps a thread count per
    thread, and a thread that never ran a torch operator would otherwise take OpenMP's default (all
    cores) instead of ``torch.set_num_threads``'s (a server's engine thread, for one)."""
    return torch.get_num_threads()


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _rows(name: str, t: torch.Tensor) -> None:
    """Float32, on the CPU, rows of unit stride (the row stride may be anything)."""
    if t.dtype != torch.float32 or t.device.type != "cpu" or t.dim() != 2 or t.stride(1) != 1:
        raise ValueError(f"{name}: expected a float32 CPU matrix with contiguous rows, got {t.dtype} {tuple(t.shape)}")


# Bytes of packed weight panels an engine keeps (the first weights used, whole); the others are packed per
# call into a thread's buffer. The bits are the same either way: this trades memory for decode speed only.
PACK_BUDGET = 1 << 30


@dataclass
class PackedWeight:
    """A ``[n, k]`` weight's record: its 16-column panels (``kvw_pack_weight``) when they are kept, else
    None (packed per call), and its source tensor (kept alive so that its id cannot be reused by another
    weight while the record is cached)."""

    source: torch.Tensor
    panels: torch.Tensor | None
    n: int
    k: int


@dataclass
class CpuKernels:
    """The loaded library (:func:`load`); ``pack_budget``: bytes of packed weights kept (see PACK_BUDGET)."""

    lib: ctypes.CDLL
    rows_per_block: int
    pack_budget: int = PACK_BUDGET
    # keyed by the weight's id: its PackedWeight holds the weight, so the id cannot be reused while cached
    _packed: dict[int, PackedWeight] = field(default_factory=dict, repr=False)
    _packed_bytes: int = 0

    def pack(self, weight: torch.Tensor) -> PackedWeight:
        """The weight's record, made on first use: its panels packed and kept while the budget allows
        (weights do not change in an engine's life)."""
        got = self._packed.get(id(weight))
        if got is None or got.source is not weight:
            _rows("weight", weight)
            n, k = weight.shape
            size = ((n + 15) // 16) * k * 16
            panels = None
            if self._packed_bytes + 4 * size <= self.pack_budget:
                panels = torch.empty(size, dtype=torch.float32)
                self.lib.kvw_pack_weight(weight.data_ptr(), n, k, weight.stride(0), panels.data_ptr(), _threads())
                self._packed_bytes += 4 * size
            got = self._packed[id(weight)] = PackedWeight(weight, panels, n, k)
        return got

    @property
    def packed_bytes(self) -> int:
        """Bytes of packed weight panels kept."""
        return self._packed_bytes

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ weight.T (+ bias)``: each output row's bits depend on its input row and the weight only."""
        w = self.pack(weight)
        # NOTE: the checks the C side relies on, in one expression (this runs ~20 times a step)
        if x.dtype is not F32 or x.device.type != "cpu" or x.dim() != 2 or x.stride(1) != 1 or x.shape[1] != w.k:
            _rows("x", x)
            raise ValueError(f"x: {x.shape[1]} columns, the weight takes {w.k}")
        if bias is not None and (bias.dtype is not F32 or bias.numel() != w.n or not bias.is_contiguous()):
            raise ValueError(f"bias: expected {w.n} contiguous float32 values")
        m = x.shape[0]
        y = torch.empty(m, w.n)
        if m:
            src = w.source
            self.lib.kvw_gemm(
                x.data_ptr(), m, w.k, x.stride(0), src.data_ptr(), w.n, src.stride(0),
                None if w.panels is None else w.panels.data_ptr(), y.data_ptr(), w.n,
                None if bias is None else bias.data_ptr(), _threads(),
            )  # fmt: skip
        return y

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """RMSNorm of each row of ``x`` (after ``h = residual + x`` when given); ``(normed, h)``."""
        _rows("x", x)
        rows, n = x.shape
        if weight.dtype != torch.float32 or weight.numel() != n or not weight.is_contiguous():
            raise ValueError(f"weight: expected {n} contiguous float32 values")
        out = torch.empty((rows, n), dtype=torch.float32)
        h = None
        if residual is not None:
            _rows("residual", residual)
            if residual.shape != x.shape:
                raise ValueError(f"residual: shape {tuple(residual.shape)} differs from x's {tuple(x.shape)}")
            h = torch.empty((rows, n), dtype=torch.float32)
        lib_r = residual.stride(0) if residual is not None else 0
        self.lib.kvw_rms_norm(
            x.data_ptr(),
            x.stride(0),
            _ptr(residual),
            lib_r,
            weight.data_ptr(),
            rows,
            n,
            eps,
            out.data_ptr(),
            _ptr(h),
            _threads(),
        )
        return out, h

    def log_softmax(self, x: torch.Tensor) -> torch.Tensor:
        """Each row's log-softmax, every row reduced alone in one fixed order (the sampler's rows)."""
        _rows("x", x)
        rows, n = x.shape
        out = torch.empty((rows, n), dtype=torch.float32)
        if rows and n:
            self.lib.kvw_log_softmax(x.data_ptr(), x.stride(0), rows, n, out.data_ptr(), _threads())
        return out

    def draw(self, x: torch.Tensor, temperatures: list[float], keys: list[int]) -> list[int]:
        """Seeded temperature-only draws, one per row of ``x``: ``keys`` are the rows' 64-bit counter keys
        (``randomness.draw_key``); each row's token depends on its own logits, temperature and key only."""
        _rows("x", x)
        rows, n = x.shape
        if len(temperatures) != rows or len(keys) != rows:
            raise ValueError(f"temperatures, keys: expected {rows} each, got {len(temperatures)} and {len(keys)}")
        temps = torch.tensor(temperatures, dtype=torch.float32)
        key_arr = (ctypes.c_uint64 * rows)(*keys)
        scratch = torch.empty((rows, n), dtype=torch.float32)
        out = torch.empty(rows, dtype=torch.int64)
        if rows and n:
            self.lib.kvw_draw(
                x.data_ptr(), x.stride(0), rows, n, temps.data_ptr(), key_arr, scratch.data_ptr(), out.data_ptr(),
                _threads(),
            )  # fmt: skip
        return out.tolist()

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` row by row (``gate`` and ``up`` may be column slices of one matrix)."""
        _rows("gate", gate)
        _rows("up", up)
        if gate.shape != up.shape:
            raise ValueError(f"up: shape {tuple(up.shape)} differs from gate's {tuple(gate.shape)}")
        out = torch.empty(gate.shape, dtype=torch.float32)
        rows, n = gate.shape
        self.lib.kvw_silu_mul(
            gate.data_ptr(), gate.stride(0), up.data_ptr(), up.stride(0), rows, n, out.data_ptr(), _threads()
        )
        return out

    def rope_write_kv(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        tables: tuple[torch.Tensor, torch.Tensor] | None,
        norms: tuple[torch.Tensor, torch.Tensor, float] | None,
        kv: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        """Per-head norms (optional), rotary at ``positions`` (``tables``: cos, sin; None: no rope), K/V
        written at ``slots``; returns the rotated q ``[rows, Hq, D]``."""
        rows, hq, d = q.shape
        hkv = k.shape[1]
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t.dtype != torch.float32 or t.stride(2) != 1 or t.shape[2] != d:
                raise ValueError(f"{name}: expected float32 heads of {d} contiguous values, got {tuple(t.shape)}")
        if d > 1024:
            raise ValueError(f"head_dim: {d} is over the kernel's 1024")
        k_cache, v_cache = kv
        for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
            if t.dtype != torch.float32 or not t.is_contiguous() or t.shape[1:] != (hkv, d):
                raise ValueError(f"{name}: expected a contiguous float32 [slots, {hkv}, {d}] cache")
        cos, sin = tables if tables is not None else (None, None)
        rdim = cos.shape[1] if cos is not None else 0
        q_w, k_w, eps = norms if norms is not None else (None, None, 0.0)
        pos = positions.to(torch.int64).contiguous()
        sl = slots.to(torch.int64).contiguous()
        out = torch.empty((rows, hq, d), dtype=torch.float32)
        self.lib.kvw_rope_write_kv(
            q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), k.stride(0), k.stride(1),
            v.data_ptr(), v.stride(0), v.stride(1), rows, hq, hkv, d, pos.data_ptr(), sl.data_ptr(),
            _ptr(cos), _ptr(sin), rdim, _ptr(q_w), _ptr(k_w), eps,
            k_cache.data_ptr(), hkv * d, v_cache.data_ptr(), hkv * d, d, out.data_ptr(), _threads(),
        )  # fmt: skip
        return out

    def attention(
        self, q: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor], meta: CpuAttentionMeta, scale: float
    ) -> torch.Tensor:
        """Causal attention of ``q [rows, Hq, D]`` over the paged cache, read in place."""
        rows, hq, d = q.shape
        k_cache, v_cache = kv
        hkv = k_cache.shape[1]
        if q.dtype != torch.float32 or not q.is_contiguous():
            raise ValueError("q: expected a contiguous float32 [rows, heads, head_dim] tensor")
        if k_cache.dtype != torch.float32 or not k_cache.is_contiguous() or not v_cache.is_contiguous():
            raise ValueError("kv: expected contiguous float32 caches")
        if rows != meta.num_rows:
            raise ValueError(f"attention plan built for {meta.num_rows} rows, called with {rows}")
        if hq % hkv or v_cache.shape[:2] != k_cache.shape[:2] or v_cache.shape[2] != d or k_cache.shape[2] != d:
            raise ValueError(f"q: {hq} heads of {d} do not fit caches {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
        if (meta.max_block + 1) * meta.block_size > k_cache.shape[0]:
            raise ValueError(f"block {meta.max_block} is past the cache's {k_cache.shape[0]} slots")
        out = torch.empty_like(q)
        seqs, table = meta.num_seqs, meta.table.data_ptr()
        row0, nq, start, block_off = (table + 8 * seqs * i for i in range(4))  # the rows of the int64 table
        self.lib.kvw_attention(
            q.data_ptr(), hq, d, k_cache.data_ptr(), hkv * d, v_cache.data_ptr(), v_cache.stride(0),
            v_cache.stride(1), hkv, seqs, row0, nq, start, meta.blocks.data_ptr(), block_off, meta.block_size,
            scale, out.data_ptr(), _threads(),
        )  # fmt: skip
        return out


@dataclass(frozen=True)
class CpuAttentionMeta:
    """One step's requests for :meth:`CpuKernels.attention`, built once per step: ``table`` (int64
    ``[4, num_seqs]``) holds each request's first row, query count, first position and where its block table
    starts in ``blocks`` (every request's block table, one after another)."""

    table: torch.Tensor
    blocks: torch.Tensor
    block_size: int
    num_seqs: int
    num_rows: int
    max_block: int  # checked against the cache before the kernel reads through the tables

    @classmethod
    def build(
        cls, shares: list[tuple[int, int, int]], block_ids: list[list[int]], block_size: int, num_rows: int
    ) -> CpuAttentionMeta:
        """From ``(row_start, num_queries, start_pos)`` and the block table of every request.

        Raises:
            ValueError: a block table too short for the positions its request reads.
        """
        offsets, flat = [], []
        for (_, n, start), blocks in zip(shares, block_ids, strict=True):
            if len(blocks) * block_size < start + n:
                raise ValueError(f"block table of {len(blocks)} blocks: fewer than {start + n} positions")
            offsets.append(len(flat))
            flat.extend(blocks)
        rows = [[r for r, _, _ in shares], [n for _, n, _ in shares], [s for _, _, s in shares], offsets]
        return cls(
            table=torch.tensor(rows, dtype=torch.int64).reshape(4, len(shares)),
            blocks=torch.tensor(flat, dtype=torch.int64),
            block_size=block_size,
            num_seqs=len(shares),
            num_rows=num_rows,
            max_block=max(flat, default=-1),
        )


def _declare(lib: ctypes.CDLL) -> None:
    lib.kvw_gemm_rows_per_block.restype = ctypes.c_int
    lib.kvw_pack_weight.argtypes = [_P, _I64, _I64, _I64, _P, _INT]
    lib.kvw_pack_weight.restype = None
    # x, m, k, ldx, w, n, ldw, packed, y, ldy, bias, threads
    lib.kvw_gemm.argtypes = [_P, _I64, _I64, _I64, _P, _I64, _I64, _P, _P, _I64, _P, _INT]
    lib.kvw_gemm.restype = None
    f32 = ctypes.c_float
    lib.kvw_rms_norm.argtypes = [_P, _I64, _P, _I64, _P, _I64, _I64, f32, _P, _P, _INT]
    lib.kvw_silu_mul.argtypes = [_P, _I64, _P, _I64, _I64, _I64, _P, _INT]
    lib.kvw_log_softmax.argtypes = [_P, _I64, _I64, _I64, _P, _INT]
    lib.kvw_draw.argtypes = [_P, _I64, _I64, _I64, _P, _P, _P, _P, _INT]
    lib.kvw_rope_write_kv.argtypes = [_P, _I64, _I64, _P, _I64, _I64, _P, _I64, _I64, _I64, _I64, _I64, _I64]
    lib.kvw_rope_write_kv.argtypes += [_P, _P, _P, _P, _I64, _P, _P, f32, _P, _I64, _P, _I64, _I64, _P, _INT]
    # q, hq, d, k, k_stride, v, v_stride, v_head, hkv, nseq, row0, nq, start, blocks, block_off, block_size,
    # scale, out, threads
    lib.kvw_attention.argtypes = [_P, _I64, _I64, _P, _I64, _P, _I64, _I64, _I64, _I64, _P, _P, _P, _P, _P, _I64]
    lib.kvw_attention.argtypes += [f32, _P, _INT]
    for fn in (lib.kvw_rms_norm, lib.kvw_silu_mul, lib.kvw_log_softmax, lib.kvw_draw, lib.kvw_rope_write_kv):
        fn.restype = None
    lib.kvw_attention.restype = None


def load() -> CpuKernels:
    """Build (or find in the cache) and open the library.

    Raises:
        BuildError: it could not be compiled or opened here (the reason is the message).
    """
    path = build()
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        raise BuildError(f"the CPU kernels at {path} do not load: {exc}") from exc
    _declare(lib)
    return CpuKernels(lib, lib.kvw_gemm_rows_per_block())
