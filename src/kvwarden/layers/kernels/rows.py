"""Row kernels: RMSNorm (with the residual add fused), softmax, log-softmax, sums, L2 norms, cumsums.

NOTE(invariance), by construction: one program per row, and a program never
reads another row. A row of length ``H`` is reduced either as one block of
``next_power_of_2(H)`` elements (``tl.sum``'s tree over a fixed block shape)
or, for long rows (a vocabulary), in tiles of a fixed ``TILE`` walked from
element 0 upwards with a per-lane float32 accumulator and one final
``tl.sum``. Block and tile sizes depend on ``H`` only, so a row's result is the
same whichever other rows share the launch. Maxima are exact in any order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

TILE = 2048  # elements per step of a long row's loop
ONE_BLOCK_MAX = 8192  # rows up to this length are reduced as one block


def _block(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


def _warps(block: int) -> int:
    return 8 if block >= 4096 else 4 if block >= 1024 else 1


@triton.jit(do_not_specialize=["rows"])
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, y_ptr, res_out_ptr, rows, H, eps, HAS_RES: tl.constexpr, W_F32: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    x = tl.load(x_ptr + row * H + cols, mask=mask, other=0.0)
    if HAS_RES:
        # h = h + mixed in the model's dtype (rounded once, as the CPU path and transformers do)
        x = (x.to(tl.float32) + tl.load(res_ptr + row * H + cols, mask=mask, other=0.0).to(tl.float32)).to(x.dtype)
        tl.store(res_out_ptr + row * H + cols, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / H
    normed = xf * (1.0 / tl.sqrt(var + eps))
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if W_F32:  # Qwen3-Next: scale in float32, round once
        y = w * normed
    else:  # Llama, Qwen3: cast the normalised row back to the input dtype, then scale by the weight
        y = w * normed.to(x.dtype).to(tl.float32)
    tl.store(y_ptr + row * H + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RMSNorm of ``x [rows, H]`` (of ``x + residual`` when given, which is also returned)."""
    x = x.contiguous()
    rows, h = x.shape
    w_f32 = weight.dtype == torch.float32 and x.dtype != torch.float32
    y = torch.empty_like(x, dtype=x.dtype if w_f32 else torch.promote_types(x.dtype, weight.dtype))
    res_out = torch.empty_like(x) if residual is not None else None
    if rows:
        block = _block(h)
        res_in = residual.contiguous() if residual is not None else x
        _rms_norm_kernel[(rows,)](
            x, res_in, weight, y, res_out if res_out is not None else x, rows, h, eps,
            HAS_RES=residual is not None, W_F32=w_f32, BLOCK=block, num_warps=_warps(block),
        )  # fmt: skip
    return y, res_out


@triton.jit(do_not_specialize=["rows"])
def _rms_norm_gated_kernel(
    x_ptr, w_ptr, z_ptr, y_ptr, rows, D, eps, z_row, z_group, z_base,
    HEADS: tl.constexpr, REP: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0)  # one program per (token, head): row r = token * HEADS + head
    token = r // HEADS
    head = r % HEADS
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    x = tl.load(x_ptr + r * D + cols, mask=mask, other=0.0)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / D
    normed = xf * (1.0 / tl.sqrt(var + eps))
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = (w * normed.to(x.dtype).to(tl.float32)).to(x.dtype).to(tl.float32)
    z_off = token.to(tl.int64) * z_row + (head // REP) * z_group + z_base + (head % REP) * D
    z = tl.load(z_ptr + z_off + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + r * D + cols, (y * (z / (1.0 + tl.exp(-z)))).to(y_ptr.dtype.element_ty), mask=mask)


def rms_norm_gated(
    x: torch.Tensor, weight: torch.Tensor, eps: float, z: torch.Tensor, z_group: int, z_base: int, rep: int
) -> torch.Tensor:
    """Qwen3-Next's gated norm: ``(weight * rms_norm(x)) * silu(z)`` per head, rounded as transformers does.

    ``x [tokens, heads, D]``; head ``h``'s gate is ``D`` columns of row ``token`` of ``z`` starting at
    ``(h // rep) * z_group + z_base + (h % rep) * D`` (the ``z`` part of ``in_proj_qkvz``, read in place).
    """
    tokens, heads, d = x.shape
    x = x.contiguous()
    y = torch.empty_like(x)
    if tokens:
        block = _block(d)
        _rms_norm_gated_kernel[(tokens * heads,)](
            x, weight, z, y, tokens * heads, d, eps, z.stride(0), z_group, z_base,
            HEADS=heads, REP=rep, BLOCK=block, num_warps=_warps(block),
        )  # fmt: skip
    return y


@triton.jit(do_not_specialize=["rows"])
def _row_reduce_kernel(x_ptr, y_ptr, rows, H, eps, OP: tl.constexpr, BLOCK: tl.constexpr):
    """OP 0: sum (keepdim), 1: l2 norm sqrt(sum(x*x) + eps) (keepdim), 2: softmax, 3: log-softmax."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    if OP == 0:
        x = tl.load(x_ptr + row * H + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + row, tl.sum(x, axis=0))
    elif OP == 1:
        x = tl.load(x_ptr + row * H + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + row, tl.sqrt(tl.sum(x * x, axis=0) + eps))
    else:
        x = tl.load(x_ptr + row * H + cols, mask=mask, other=float("-inf")).to(tl.float32)
        shifted = x - tl.max(x, axis=0)
        e = tl.where(mask, tl.exp(shifted), 0.0)
        total = tl.sum(e, axis=0)
        if OP == 2:
            tl.store(y_ptr + row * H + cols, e / total, mask=mask)
        else:
            tl.store(y_ptr + row * H + cols, shifted - tl.log(total), mask=mask)


@triton.jit(do_not_specialize=["rows"])
def _long_row_softmax_kernel(x_ptr, y_ptr, rows, H, LOG: tl.constexpr, TILE_: tl.constexpr):
    """(Log-)softmax of rows too long for one block: three passes over fixed tiles from element 0."""
    row = tl.program_id(0)
    base = x_ptr + row * H
    lanes = tl.arange(0, TILE_)
    m = tl.full((TILE_,), float("-inf"), tl.float32)
    for start in range(0, H, TILE_):
        x = tl.load(base + start + lanes, mask=start + lanes < H, other=float("-inf")).to(tl.float32)
        m = tl.maximum(m, x)
    mx = tl.max(m, axis=0)
    acc = tl.zeros((TILE_,), tl.float32)
    for start in range(0, H, TILE_):
        x = tl.load(base + start + lanes, mask=start + lanes < H, other=float("-inf")).to(tl.float32)
        acc += tl.where(start + lanes < H, tl.exp(x - mx), 0.0)
    total = tl.sum(acc, axis=0)
    log_total = tl.log(total)
    for start in range(0, H, TILE_):
        mask = start + lanes < H
        x = tl.load(base + start + lanes, mask=mask, other=0.0).to(tl.float32)
        if LOG:
            out = (x - mx) - log_total
        else:
            out = tl.exp(x - mx) / total
        tl.store(y_ptr + row * H + start + lanes, out, mask=mask)


def _reduce(x: torch.Tensor, op: int, eps: float = 0.0) -> torch.Tensor:
    x = x.contiguous()
    rows, h = x.shape
    keep = op in (0, 1)
    y = torch.empty((rows, 1) if keep else (rows, h), dtype=torch.float32, device=x.device)
    if rows == 0:
        return y
    if h <= ONE_BLOCK_MAX or keep:
        block = _block(h)
        _row_reduce_kernel[(rows,)](x, y, rows, h, eps, OP=op, BLOCK=block, num_warps=_warps(block))
    else:
        _long_row_softmax_kernel[(rows,)](x, y, rows, h, LOG=op == 3, TILE_=TILE, num_warps=8)
    return y


def row_sum(x: torch.Tensor) -> torch.Tensor:
    """``x.sum(-1, keepdim=True)`` in float32."""
    return _reduce(x, 0)


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``sqrt((x * x).sum(-1, keepdim=True) + eps)`` in float32."""
    return _reduce(x, 1, eps)


def softmax(x: torch.Tensor) -> torch.Tensor:
    """Row softmax in float32."""
    return _reduce(x, 2)


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    """Row log-softmax in float32."""
    return _reduce(x, 3)


@triton.jit(do_not_specialize=["rows"])
def _cumsum_kernel(x_ptr, y_ptr, rows, H, TILE_: tl.constexpr):
    """Inclusive prefix sums along a row: fixed tiles from element 0, a float32 carry between tiles."""
    row = tl.program_id(0)
    lanes = tl.arange(0, TILE_)
    carry = tl.zeros((1,), tl.float32)
    for start in range(0, H, TILE_):
        mask = start + lanes < H
        x = tl.load(x_ptr + row * H + start + lanes, mask=mask, other=0.0).to(tl.float32)
        c = tl.cumsum(x, axis=0) + carry
        tl.store(y_ptr + row * H + start + lanes, c, mask=mask)
        carry = tl.sum(tl.where(lanes == TILE_ - 1, c, 0.0), axis=0, keep_dims=True)


def cumsum(x: torch.Tensor) -> torch.Tensor:
    """Row-wise inclusive cumsum in float32 (the sampler's top-p mass)."""
    x = x.contiguous()
    rows, h = x.shape
    y = torch.empty((rows, h), dtype=torch.float32, device=x.device)
    if rows:
        _cumsum_kernel[(rows,)](x, y, rows, h, TILE_=1024, num_warps=4)
    return y
