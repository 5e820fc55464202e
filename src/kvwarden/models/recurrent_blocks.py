"""Recurrent mixers: Qwen3-Next's gated DeltaNet and Granite's Mamba2, over the state pool.

Each block projects all rows at once (row-tiled GEMMs). On the CPU it then
walks the batch's requests one by one: causal conv from the request's conv
window, then the scan through :mod:`kvwarden.layers.chunked_scan` (canonical or
vendor-style). Per token, everything the scan needs is packed into one feature
row, which is what the canonical driver keeps for the pending rows of an
unfinished grid chunk. On the GPU backends (``Ops.batched_recurrent``) the conv
and the scan run once per layer for every request of the step
(:mod:`kvwarden.models.recurrent_batched`), with the gates inside the scan.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvwarden.cache.state_spec import RecurrentLayerSpec
from kvwarden.layers import gated_delta, mamba2
from kvwarden.layers.chunked_scan import canonical_scan, vendor_scan
from kvwarden.layers.conv1d import causal_conv1d, shape_dependent_conv1d
from kvwarden.layers.numerics import Ops
from kvwarden.models.common import ForwardBatch, WeightGetter, require
from kvwarden.models.config import GatedDeltaNetConfig, ModelConfig
from kvwarden.models.recurrent_batched import (
    boundary_windows,
    conv_columns,
    keep_token_states,
    stage_captures,
    trace_states_in,
    window_rows,
)
from kvwarden.models.tensor_shard import TensorShard


class _RecurrentBlock:
    """Shared walk over the batch's requests: conv window, scan, boundary capture."""

    ops: Ops
    conv_w: torch.Tensor
    conv_b: torch.Tensor | None
    shard: TensorShard
    name: str = "rec"

    def _scan_requests(self, mixed: torch.Tensor, batch: ForwardBatch, layer: int, features: Callable) -> torch.Tensor:
        """Per request: conv (from its window) -> features -> scan; returns scan outputs per row."""
        states = batch.states
        assert states is not None, "a recurrent layer needs the state pool"
        canonical = self.ops.name == "canonical"
        batch.trace(f"{self.name}.in_proj", mixed)
        outs = []
        for seq in batch.seqs:
            rows = mixed[seq.row_start : seq.row_start + seq.num_tokens]
            conv_state, scan_state = states.views(seq.request_id, layer)
            if batch.tracer is not None:  # the state this chunk starts from (restored or carried)
                batch.tracer.record_at(f"{self.name}.state_in", seq.request_id, seq.start, scan_state.ssm)
                batch.tracer.record_at(f"{self.name}.conv_in", seq.request_id, seq.start, conv_state)
            window = torch.cat([conv_state.to(rows.dtype), rows])
            if canonical:
                conv_out, new_conv = causal_conv1d(rows, conv_state, self.conv_w, self.conv_b, self._silu)
            else:
                conv_out, new_conv = shape_dependent_conv1d(rows, conv_state, self.conv_w, self.conv_b)
            k1 = conv_state.shape[0]

            def capture(pos: int, ssm: torch.Tensor, seq=seq, window=window, k1=k1) -> None:
                at = pos - seq.start
                states.stage(seq.request_id, pos, layer, window[at : at + k1], ssm)

            feats = features(conv_out, seq.row_start)
            if self.ops.scan_mode == "chunked":
                out = canonical_scan(
                    feats, seq.start, scan_state, batch.scan_chunk, batch.block_size, self._chunk_kernel, capture
                )
            else:
                out = vendor_scan(feats, seq.start, scan_state, batch.block_size, self._vendor_kernel, capture)
            conv_state.copy_(new_conv)
            outs.append(out)
        result = torch.cat(outs)
        batch.trace(f"{self.name}.scan", result)
        return result

    def _silu(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.silu(x)

    def _chunk_kernel(self, rows: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def _vendor_kernel(self, rows: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError


class GatedDeltaNetBlock(_RecurrentBlock):
    """Qwen3-Next linear attention: conv -> gated delta rule -> gated RMSNorm -> out_proj."""

    def __init__(
        self, cfg: ModelConfig, get: WeightGetter, prefix: str, ops: Ops, shard: TensorShard | None = None
    ) -> None:
        """``shard``: under tensor parallelism ``cfg`` holds this rank's key-head groups and ``get`` their rows."""
        assert cfg.gated_deltanet is not None
        self.g, self.ops, self.eps, self.shard = cfg.gated_deltanet, ops, cfg.rms_norm_eps, shard or TensorShard()
        if get(f"{prefix}.in_proj_qkv.weight") is not None:  # Qwen3.5: four separate projections
            self.w_qkvz, self.w_ba = _fuse_qwen3_5(get, prefix, cfg.gated_deltanet)
        else:
            self.w_qkvz = require(get, f"{prefix}.in_proj_qkvz.weight")
            self.w_ba = require(get, f"{prefix}.in_proj_ba.weight")
        self.conv_w = require(get, f"{prefix}.conv1d.weight").squeeze(1)
        self.conv_b = get(f"{prefix}.conv1d.bias")
        self.dt_bias = require(get, f"{prefix}.dt_bias").float()
        self.neg_a = -torch.exp(require(get, f"{prefix}.A_log").float())
        self.norm = require(get, f"{prefix}.norm.weight")
        self.w_out = require(get, f"{prefix}.out_proj.weight")
        hk, dk, vd = self.g.num_key_heads, self.g.key_head_dim, self.g.num_value_heads // self.g.num_key_heads
        vd *= self.g.value_head_dim
        self.group = 2 * dk + 2 * vd  # in_proj_qkvz per key head: q (dk), k (dk), v (rep dv), z (rep dv)
        # The conv's channels q | k | v, read in place from in_proj_qkvz's output (batched path).
        cols = conv_columns((hk, dk, self.group, 0), (hk, dk, self.group, dk), (hk, vd, self.group, 2 * dk))
        self.conv_cols = torch.tensor(cols, dtype=torch.int32, device=ops.device)

    def spec(self) -> RecurrentLayerSpec:
        g = self.g
        return RecurrentLayerSpec(
            conv_shape=(g.conv_kernel - 1, g.conv_dim),
            ssm_shape=(g.num_value_heads, g.key_head_dim, g.value_head_dim),
            feature_dim=g.conv_dim + 2 * g.num_value_heads,  # also the GPU ring's raw row: q | k | v, b | a
            grid_ring=True,
            scan_scratch=True,
        )

    def __call__(self, h: torch.Tensor, batch: ForwardBatch, layer: int) -> torch.Tensor:
        g, ops = self.g, self.ops
        rows = h.shape[0]
        hk, hv, dk, dv = g.num_key_heads, g.num_value_heads, g.key_head_dim, g.value_head_dim
        rep = hv // hk
        if batch.recurrent is not None:
            return self._batched(h, batch, layer)
        qkvz = ops.linear(h, self.w_qkvz).view(rows, hk, 2 * dk + 2 * rep * dv)
        q, k, v, z = torch.split(qkvz, [dk, dk, rep * dv, rep * dv], dim=-1)
        ba = ops.linear(h, self.w_ba).view(rows, hk, 2 * rep)
        b, a = ba[..., :rep].reshape(rows, hv), ba[..., rep:].reshape(rows, hv)
        mixed = torch.cat([q.reshape(rows, -1), k.reshape(rows, -1), v.reshape(rows, -1)], dim=-1)
        beta = ops.sigmoid(b.float())
        decay = self.neg_a * ops.softplus(a.float() + self.dt_bias)
        gb = torch.cat([decay, beta], dim=-1)

        def features(conv_out: torch.Tensor, r0: int) -> torch.Tensor:
            return torch.cat([conv_out.float(), gb[r0 : r0 + conv_out.shape[0]]], dim=-1)

        core = self._scan_requests(mixed, batch, layer, features).view(rows * hv, dv)
        normed = ops.rms_norm(core.to(h.dtype), self.norm, self.eps)
        gated = normed.float() * self._silu(z.reshape(rows * hv, dv).float())
        return self.shard.output_linear(ops, gated.to(h.dtype).reshape(rows, hv * dv), self.w_out)

    def _batched(self, h: torch.Tensor, batch: ForwardBatch, layer: int) -> torch.Tensor:
        """Every request at once: conv, then the scan with its gates, then the gated norm (GPU backends)."""
        g, ops, meta, states = self.g, self.ops, batch.recurrent, batch.states
        assert meta is not None and states is not None
        rows = h.shape[0]
        qkvz = ops.linear(h, self.w_qkvz)
        ba = ops.linear(h, self.w_ba)
        if batch.tracer is not None:
            batch.trace(f"{self.name}.in_proj", qkvz.index_select(1, self.conv_cols))
        trace_states_in(batch, meta, self.name, layer)
        windows = boundary_windows(qkvz, self.conv_cols, states.conv[layer], meta) if meta.captures else []
        inputs = window_rows(qkvz, self.conv_cols, states.conv[layer], meta) if meta.per_token else None
        mixed = ops.causal_conv(qkvz, self.conv_cols, states.conv[layer], self.conv_w, self.conv_b, meta)
        ring = states.pending[layer] if states.pending else None  # the canonical GPU scan's pending rows
        core, caps = ops.gated_delta_step(
            mixed, ba, self.neg_a, self.dt_bias, states.ssm[layer], meta, g.num_key_heads, ring=ring
        )
        stage_captures(states, meta, layer, windows, caps)
        keep_token_states(batch, meta, inputs, caps)
        batch.trace(f"{self.name}.scan", core.view(rows, -1))
        rep = g.num_value_heads // g.num_key_heads
        gated = ops.rms_norm_gated(
            core, self.norm, self.eps, qkvz, self.group, 2 * g.key_head_dim + rep * g.value_head_dim, rep
        )
        return self.shard.output_linear(ops, gated.view(rows, -1), self.w_out)

    def _unpack(self, rows: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Packed features -> per-head q, k, v [Hv, L, d], g, beta [Hv, L] (q, k l2-normalised)."""
        g = self.g
        hk, hv, dk, dv = g.num_key_heads, g.num_value_heads, g.key_head_dim, g.value_head_dim
        length = rows.shape[0]
        key_dim = hk * dk
        q = rows[:, :key_dim].reshape(length, hk, dk)
        k = rows[:, key_dim : 2 * key_dim].reshape(length, hk, dk)
        v = rows[:, 2 * key_dim : 2 * key_dim + hv * dv].reshape(length, hv, dv)
        decay = rows[:, g.conv_dim : g.conv_dim + hv]
        beta = rows[:, g.conv_dim + hv :]
        q = _l2norm(q, self.ops) * dk**-0.5
        k = _l2norm(k, self.ops)
        if hv != hk:
            q = q.repeat_interleave(hv // hk, dim=1)
            k = k.repeat_interleave(hv // hk, dim=1)
        return q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), decay.t(), beta.t()

    def _chunk_kernel(self, rows: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, v, decay, beta = (x.contiguous() for x in self._unpack(rows))
        out, end = gated_delta.chunk_step(q, k, v, decay, beta, state, self.ops.exp)
        return out.transpose(0, 1).reshape(rows.shape[0], -1), end

    def _vendor_kernel(self, rows: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, v, decay, beta = (x.contiguous() for x in self._unpack(rows))
        out, end = gated_delta.shape_dependent_scan(q, k, v, decay, beta, state)
        return out.transpose(0, 1).reshape(rows.shape[0], -1), end


class Mamba2Block(_RecurrentBlock):
    """Granite's Mamba2 mixer: in_proj -> conv -> SSD scan -> gated group RMSNorm -> out_proj."""

    def __init__(
        self, cfg: ModelConfig, get: WeightGetter, prefix: str, ops: Ops, shard: TensorShard | None = None
    ) -> None:
        """``shard``: under tensor parallelism ``cfg`` holds this rank's groups and heads, ``get`` their rows."""
        assert cfg.mamba2 is not None
        self.m, self.ops, self.eps, self.shard = cfg.mamba2, ops, cfg.rms_norm_eps, shard or TensorShard()
        self.w_in, self.b_in = require(get, f"{prefix}.in_proj.weight"), get(f"{prefix}.in_proj.bias")
        self.conv_w = require(get, f"{prefix}.conv1d.weight").squeeze(1)
        self.conv_b = get(f"{prefix}.conv1d.bias")
        self.dt_bias = require(get, f"{prefix}.dt_bias").float()
        self.a = -torch.exp(require(get, f"{prefix}.A_log").float())
        self.d = require(get, f"{prefix}.D").float()
        self.norm = require(get, f"{prefix}.norm.weight")
        self.w_out, self.b_out = require(get, f"{prefix}.out_proj.weight"), get(f"{prefix}.out_proj.bias")
        m = self.m  # in_proj: gate (inner) | x B C (conv_dim) | dt (heads); the conv reads x B C in place
        self.conv_cols = torch.arange(m.inner, m.inner + m.conv_dim, dtype=torch.int32, device=ops.device)

    def spec(self) -> RecurrentLayerSpec:
        m = self.m
        return RecurrentLayerSpec(
            conv_shape=(m.conv_kernel - 1, m.conv_dim),
            ssm_shape=(m.num_heads, m.head_dim, m.state_size),
            feature_dim=m.conv_dim + m.num_heads,  # also the GPU ring's raw row: x | B | C, dt
            grid_ring=True,
        )

    def __call__(self, h: torch.Tensor, batch: ForwardBatch, layer: int) -> torch.Tensor:
        m, ops = self.m, self.ops
        rows = h.shape[0]
        proj = ops.linear(h, self.w_in, self.b_in)
        gate, xbc, dt = torch.split(proj, [m.inner, m.conv_dim, m.num_heads], dim=-1)
        if batch.recurrent is not None:
            y = self._batched(proj, dt, batch, layer)
        else:
            dt = ops.softplus(dt.float() + self.dt_bias)
            lo, hi = m.time_step_limit
            if lo > 0.0 or hi != float("inf"):
                dt = dt.clamp(lo, hi)

            def features(conv_out: torch.Tensor, r0: int) -> torch.Tensor:
                return torch.cat([conv_out.float(), dt[r0 : r0 + conv_out.shape[0]]], dim=-1)

            y = self._scan_requests(xbc.contiguous(), batch, layer, features)  # [rows, inner]
        gated = y * self._silu(gate.float())
        group = m.inner // m.n_groups
        ones = torch.ones(group, dtype=torch.float32, device=h.device)
        normed = ops.rms_norm(gated.reshape(rows * m.n_groups, group), ones, self.eps).reshape(rows, m.inner)
        normed = self.norm * normed.to(h.dtype)
        return self.shard.output_linear(ops, normed, self.w_out, self.b_out)

    def _batched(self, proj: torch.Tensor, dt: torch.Tensor, batch: ForwardBatch, layer: int) -> torch.Tensor:
        """Every request at once: conv, then the scan (dt's softplus and clamp inside); ``[rows, inner]`` float32."""
        m, ops, meta, states = self.m, self.ops, batch.recurrent, batch.states
        assert meta is not None and states is not None
        if batch.tracer is not None:
            batch.trace(f"{self.name}.in_proj", proj.index_select(1, self.conv_cols))
        trace_states_in(batch, meta, self.name, layer)
        windows = boundary_windows(proj, self.conv_cols, states.conv[layer], meta) if meta.captures else []
        inputs = window_rows(proj, self.conv_cols, states.conv[layer], meta) if meta.per_token else None
        mixed = ops.causal_conv(proj, self.conv_cols, states.conv[layer], self.conv_w, self.conv_b, meta)
        ring = states.pending[layer] if states.pending else None  # the chunked GPU scan's pending rows
        y, caps = ops.mamba2_step(
            mixed, dt, self.dt_bias, self.a, self.d, states.ssm[layer], meta, m.n_groups, m.time_step_limit, ring=ring
        )
        stage_captures(states, meta, layer, windows, caps)
        keep_token_states(batch, meta, inputs, caps)
        y = y.view(proj.shape[0], m.inner)
        batch.trace(f"{self.name}.scan", y)
        return y

    def _unpack(self, rows: torch.Tensor) -> tuple[torch.Tensor, ...]:
        m = self.m
        length = rows.shape[0]
        gn = m.n_groups * m.state_size
        x = rows[:, : m.inner].reshape(length, m.num_heads, m.head_dim).transpose(0, 1)
        rep = m.num_heads // m.n_groups
        b = rows[:, m.inner : m.inner + gn].reshape(length, m.n_groups, m.state_size).repeat_interleave(rep, dim=1)
        c = rows[:, m.inner + gn : m.conv_dim].reshape(length, m.n_groups, m.state_size).repeat_interleave(rep, dim=1)
        dt = rows[:, m.conv_dim :].t()
        return x.contiguous(), dt.contiguous(), b.transpose(0, 1).contiguous(), c.transpose(0, 1).contiguous()

    def _chunk_kernel(self, rows: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, dt, b, c = self._unpack(rows)
        y, end = mamba2.chunk_step(x, dt, self.a, b, c, self.d, state, self.ops.exp)
        return y.transpose(0, 1).reshape(rows.shape[0], -1), end

    def _vendor_kernel(self, rows: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, dt, b, c = self._unpack(rows)
        y, end = mamba2.shape_dependent_scan(x, dt, self.a, b, c, self.d, state)
        return y.transpose(0, 1).reshape(rows.shape[0], -1), end


def _fuse_qwen3_5(get: WeightGetter, prefix: str, g: GatedDeltaNetConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3.5's ``in_proj_qkv`` / ``in_proj_z`` / ``in_proj_b`` / ``in_proj_a`` as Qwen3-Next's two fused
    projections: per key head ``q | k | v | z`` (its ``rep`` value heads) and ``b | a``. Rows are only
    reordered: each output column is the same dot product as in the separate projections."""
    hk, dk, dv = g.num_key_heads, g.key_head_dim, g.value_head_dim
    rep = g.num_value_heads // hk
    qkv, z = require(get, f"{prefix}.in_proj_qkv.weight"), require(get, f"{prefix}.in_proj_z.weight")
    b, a = require(get, f"{prefix}.in_proj_b.weight"), require(get, f"{prefix}.in_proj_a.weight")
    q, k, v = qkv.split([hk * dk, hk * dk, g.num_value_heads * dv])
    qkvz = [part for h in range(hk) for part in (q.view(hk, dk, -1)[h], k.view(hk, dk, -1)[h],
            v.view(hk, rep * dv, -1)[h], z.view(hk, rep * dv, -1)[h])]  # fmt: skip
    ba = [part for h in range(hk) for part in (b.view(hk, rep, -1)[h], a.view(hk, rep, -1)[h])]
    return torch.cat(qkvz).contiguous(), torch.cat(ba).contiguous()


def _l2norm(x: torch.Tensor, ops: Ops) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + 1e-6)`` per head vector (row op, IEEE basic arithmetic)."""
    shape = x.shape
    flat = x.reshape(-1, shape[-1])
    norm = ops.l2_norm_rows(flat, 1e-6)
    return (flat / norm).view(shape)
