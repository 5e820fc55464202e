"""GLM-5's attention: multi-head latent attention with a lightning indexer (DeepSeek Sparse Attention).

Per token the cache keeps one latent row ``[c | k_rope]`` (``kv_lora_rank`` normalised latent, then the
``qk_rope_head_dim`` rotated key shared by every head) in the layer's K tensor, and the indexer's key in
its V tensor - the same blocks, so a prefix hit, a host-tier load or a transfer always moves both caches
together. A query's keys are never expanded per head: ``q_nope`` is turned into latent space with
``kv_b_proj``'s key half (``W_uk``) and the attention's latent output back with its value half (``W_uv``),
as production MLA kernels do; transformers expands every key instead (the same product, summed in
another order: agreement is within float32 rounding).
"""

from __future__ import annotations

import torch

from kvwarden.layers.attention import SeqAttn
from kvwarden.layers.numerics import Ops
from kvwarden.layers.rotary import RotaryEmbedding
from kvwarden.layers.sparse_attention import (
    index_scores,
    latent_attention,
    rope_half_split,
    rope_interleaved,
    select_keys,
)
from kvwarden.models.common import ForwardBatch, WeightGetter, require
from kvwarden.models.config import MlaConfig, ModelConfig
from kvwarden.models.tensor_shard import TensorShard

# transformers builds the q / kv latent norms and the indexer's key LayerNorm with their own epsilon
LATENT_EPS = 1e-6


class Indexer:
    """The lightning indexer: which ``index_topk`` cached keys each query attends to."""

    def __init__(self, mla: MlaConfig, get: WeightGetter, prefix: str, ops: Ops) -> None:
        self.mla, self.ops = mla, ops
        self.wq = require(get, f"{prefix}.wq_b.weight")
        self.wk = require(get, f"{prefix}.wk.weight")
        self.k_norm = require(get, f"{prefix}.k_norm.weight"), require(get, f"{prefix}.k_norm.bias")
        # computed in float32 whatever the model dtype, as transformers keeps it
        self.w_heads = require(get, f"{prefix}.weights_proj.weight").float()

    def keys(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``[rows, index_head_dim]``: the rows' indexer keys (LayerNorm, rope on the leading slice)."""
        k = self._layer_norm(self.ops.linear(x, self.wk))
        return self._rope(k.unsqueeze(1), cos, sin).squeeze(1)

    def _layer_norm(self, x: torch.Tensor) -> torch.Tensor:
        """LayerNorm (weight and bias) in float32, from the backend's row sums.

        NOTE(invariance): two row sums (the numerics' own, invariant on every backend) and IEEE
        element-wise arithmetic; a backend without generic row ops (Triton) runs the same steps.
        """
        w, b = self.k_norm
        xf = x.float()
        n = x.shape[-1]
        diff = xf - self.ops.sum_rows(xf) / n
        var = self.ops.sum_rows(diff * diff) / n
        return (diff * (1.0 / torch.sqrt(var + LATENT_EPS)) * w.float() + b.float()).to(x.dtype)

    def queries(
        self, x: torch.Tensor, q_latent: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(q [rows, H, D]`` in the model's dtype with rope, ``weights [rows, H]`` float32).

        The queries stay in the model's dtype: the GPU kernel multiplies them in its cache's precision (the
        model's: no copy), the CPU path widens them to float32 (exact either way)."""
        mla, ops = self.mla, self.ops
        q = ops.linear(q_latent, self.wq).view(-1, mla.index_n_heads, mla.index_head_dim)
        weights = ops.linear(x.float(), self.w_heads) * mla.index_n_heads**-0.5
        return self._rope(q, cos, sin), weights

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        d = self.mla.qk_rope_head_dim  # the indexer turns its leading slice (the attention its trailing one)
        turn = rope_interleaved if self.mla.indexer_interleaved else rope_half_split
        return torch.cat([turn(x[..., :d], cos, sin), x[..., d:]], dim=-1)


class MlaBlock:
    """q / kv low-rank projections, the indexer (or the previous full layer's selection), sparse latent
    attention, output projection."""

    def __init__(
        self,
        cfg: ModelConfig,
        get: WeightGetter,
        prefix: str,
        ops: Ops,
        rope: RotaryEmbedding | None,
        index: int,
        shard: TensorShard | None = None,
    ) -> None:
        """``shard``: under tensor parallelism ``cfg`` holds this rank's heads (``q_b_proj`` / ``kv_b_proj``
        rows); the latent projections, the latent cache and the indexer are whole on every rank."""
        assert cfg.mla is not None and rope is not None
        self.shard = shard or TensorShard()
        mla = self.mla = cfg.mla
        self.ops, self.rope, self.heads = ops, rope, cfg.num_attention_heads
        self.wq_a = require(get, f"{prefix}.q_a_proj.weight")
        self.q_norm = require(get, f"{prefix}.q_a_layernorm.weight")
        self.wq_b = require(get, f"{prefix}.q_b_proj.weight")
        self.wkv_a = require(get, f"{prefix}.kv_a_proj_with_mqa.weight")
        self.kv_norm = require(get, f"{prefix}.kv_a_layernorm.weight")
        kv_b = require(get, f"{prefix}.kv_b_proj.weight").view(
            self.heads, mla.qk_nope_head_dim + mla.v_head_dim, mla.kv_lora_rank
        )
        # Per head: W_uk^T [r, nope] turns q_nope into latent space, W_uv [v, r] turns the latent output back;
        # both stacked as linear_heads() weights ([H, out, in]: x @ W[h].T per head), contiguous so that the
        # per-head shapes alone pick the GEMM's tiles.
        self.w_uk = kv_b[:, : mla.qk_nope_head_dim].transpose(1, 2).contiguous()
        self.w_uv = kv_b[:, mla.qk_nope_head_dim :].contiguous()
        self.wo = require(get, f"{prefix}.o_proj.weight")
        self.indexer = Indexer(mla, get, f"{prefix}.indexer", ops) if mla.indexer_full[index] else None
        self.scale = mla.softmax_scale
        # the seed incident's selection: vendor-style numerics, or asked for (testing only)
        self.arrival_order = ops.name != "canonical" or ops.config.unsafe_topk
        # canonical numerics on the Triton backend: the kernels of layers/kernels/{sparse,topk}.py
        self.kernels = None
        if hasattr(ops, "k_attention"):
            from kvwarden.layers.kernels import sparse, topk

            self.kernels = (sparse, topk)
        self.name = "attn"

    def __call__(self, x: torch.Tensor, batch: ForwardBatch, kv: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        mla, ops, rows = self.mla, self.ops, x.shape[0]
        cos, sin = self._rope_rows(batch, x.dtype)
        q_latent = ops.rms_norm(ops.linear(x, self.wq_a), self.q_norm, LATENT_EPS)
        q = ops.linear(q_latent, self.wq_b).view(rows, self.heads, -1)
        q_nope, q_rope = q[..., : mla.qk_nope_head_dim], q[..., mla.qk_nope_head_dim :]
        ckv = ops.linear(x, self.wkv_a)
        c = ops.rms_norm(ckv[:, : mla.kv_lora_rank].contiguous(), self.kv_norm, LATENT_EPS)
        k_rope = rope_interleaved(ckv[:, None, mla.kv_lora_rank :], cos, sin)[:, 0]
        latent_cache, index_cache = kv
        latent_cache.index_copy_(0, batch.slot_mapping, torch.cat([c, k_rope], -1).unsqueeze(1).to(latent_cache.dtype))
        batch.trace(f"{self.name}.latent", c)
        if self.indexer is not None:
            k_index = self.indexer.keys(x, cos, sin)
            index_cache.index_copy_(0, batch.slot_mapping, k_index.unsqueeze(1).to(index_cache.dtype))
        batch.exchange_kv(kv)  # context parallelism: both caches' rows of the other ranks, before any read
        if self.indexer is not None:
            q_index, weights = self.indexer.queries(x, q_latent, cos, sin)
            if self.kernels is not None:
                batch.dsa_selection = self._select_on_device(q_index, weights, index_cache, batch)
            else:
                q_index = q_index.float()
                chosen = [self._select(q_index, weights, index_cache, seq, rows) for seq in batch.plan.seqs]
                batch.dsa_selection = (torch.cat([s for s, _ in chosen]), torch.cat([v for _, v in chosen]))
        if batch.dsa_selection is None:
            raise RuntimeError("a shared DSA layer needs an earlier full layer's selection in the step")
        slots, visible = batch.dsa_selection
        # q in latent space: [q_nope @ W_uk | rotated q_rope] per head
        q_abs = ops.linear_heads(q_nope, self.w_uk)
        q_full = torch.cat([q_abs, rope_interleaved(q_rope, cos, sin)], -1)  # the model's dtype
        if self.kernels is not None:  # the kernel takes q in its cache's precision (float32 for a float32 cache)
            latent = latent_cache.view(latent_cache.shape[0], -1)
            o_latent = self.kernels[0].latent_attention(q_full, latent, slots, visible, mla.kv_lora_rank, self.scale)
        else:  # NOTE(invariance): one bmm batched over every query of the step (the batch count is free)
            keys = latent_cache[slots.reshape(-1), 0].float().view(*slots.shape, -1)
            o_latent = latent_attention(q_full.float(), keys, visible, mla.kv_lora_rank, self.scale, ops.exp)
        o_latent = o_latent.to(x.dtype)
        o = ops.linear_heads(o_latent, self.w_uv).reshape(rows, -1)
        batch.trace(f"{self.name}.core", o)
        return self.shard.output_linear(ops, o, self.wo)

    def _rope_rows(self, batch: ForwardBatch, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` ``[rows, rope / 2]`` of the step's positions in the model's dtype, gathered once a
        step for every MLA layer. NOTE(invariance): the values every rotary here converted its table rows
        to before (the rotaries convert to their input's dtype, the model's); only the launches are fewer.
        Every layer, the MTP head's included, shares the model's one rotary table."""
        if batch.dsa_rope is None:
            half = self.mla.qk_rope_head_dim // 2
            cos, sin = self.rope.cos[batch.positions, :half], self.rope.sin[batch.positions, :half]
            batch.dsa_rope = (cos.to(dtype), sin.to(dtype))
        return batch.dsa_rope

    def _select(
        self,
        q: torch.Tensor,
        weights: torch.Tensor,
        index_cache: torch.Tensor,
        seq: SeqAttn,
        step_rows: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One request's selection: ``(cache slots [T, k], visible [T, k])``; ``step_rows`` (the step's
        shape) matters only to the incident's arrival order."""
        ctx = seq.start_pos + seq.num_queries
        keys = index_cache[seq.slots[:ctx].to(index_cache.device), 0].float()
        rows = slice(seq.row_start, seq.row_start + seq.num_queries)
        scores = index_scores(q[rows], keys, weights[rows], self.mla.index_head_dim**-0.5, seq.start_pos)
        arrival = step_rows if self.arrival_order else None
        positions, visible = select_keys(scores, self.mla.index_topk, arrival)
        return seq.slots.to(positions.device)[positions], visible

    def _select_on_device(
        self, q: torch.Tensor, weights: torch.Tensor, index_cache: torch.Tensor, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every query's selection in two launches (scores, then the radix-select top-k)."""
        assert self.kernels is not None
        sparse, topk = self.kernels
        k = self.mla.index_topk
        if batch.dsa_keys is None:  # once per step: every full indexer layer reads the same table
            batch.dsa_keys = _key_table(batch, q.device)
        table, req = batch.dsa_keys
        scale = self.mla.index_head_dim**-0.5
        scores = sparse.index_scores(
            q, weights, index_cache.view(index_cache.shape[0], -1), table, req, batch.positions.to(torch.int32), scale
        )
        arrival = scores.shape[0] if self.arrival_order else None
        positions, visible = select_keys(scores, k, arrival, topk.topk_triton)
        # each row's selected slots, gathered without a [rows, width] copy of its request's table row
        return table.view(-1)[req.long()[:, None] * table.shape[1] + positions], visible


def _key_table(batch: ForwardBatch, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cache slots [requests, width], request of each query row [rows])`` of the step's requests, built
    on the device from the attention plan's block tables (no per-request host work, so a CUDA graph
    captures it): ``width`` is the step's longest context eagerly, the longest served in a graph.

    NOTE(invariance): the columns past a request's context (a longer partner's, or a graph's bound) hold
    other slots than an exact table would, but no query reads them: ``index_scores`` gives them ``-inf``
    without loading a key, and a ``-inf`` candidate is invisible (its slot is column 0's). Trailing
    ``-inf`` columns change no selection: the top-k's order is a function of the scores alone.
    """
    meta = batch.plan.meta  # the Triton backend's AttentionMeta
    bs = batch.block_size
    width = meta.max_keys or meta.block_tables.shape[1] * bs
    cols = torch.arange(width, device=device)
    table = meta.block_tables[:, cols // bs].long() * bs + cols % bs
    rows = torch.arange(batch.positions.shape[0], dtype=meta.seq_row0.dtype, device=device)
    req = torch.searchsorted(meta.seq_row0, rows, right=True) - 1  # row starts ascend; a request's rows follow
    return table, req.to(torch.int32)
