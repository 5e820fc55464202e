"""DeepSeek Sparse Attention on the CPU: the lightning indexer's scores, the key selection, and latent
attention over the selected keys only (GLM-5, DeepSeek-V3.2).

NOTE(invariance) - a query's output is a function of its position and the cached rows alone:

* Index scores: ``q_I @ K_I^T`` is one GEMM per request whose rows are the request's queries times the
  indexer heads padded to a multiple of 4, over the request's keys padded with zero keys to a multiple of
  64; MKL computes such a row from the row and the right operand alone and never reduces across output
  columns, so neither the chunk's length nor the context length changes a score (the facts
  ``canonical_attention`` rests on, pinned by ``tests/test_numerics.py``; measured here, a handful of key
  counts below 12 take another kernel, hence the padding; ``tests/test_dsa.py`` checks it). The
  heads are then folded with explicit element-wise adds in head order (IEEE basic arithmetic: position-
  and width-free), not by a GEMM over heads.
* Selection: :func:`select_topk` returns the same set *and* order for the same scores - the set ranked by
  score descending, ties to the lower position, returned in position order - through ``torch.topk`` with
  ties redone exactly (canonical) or the same total order counted on a GPU (``layers/kernels/topk.py``).
  Future positions score ``-inf`` and rank after every visible key; a
  query is always handed exactly ``index_topk`` candidates (``-inf`` fill when its context is shorter),
  so every attention call below has one shape.
* Attention: ``[q_latent | q_rope] @ [c | k_rope]^T`` and ``P @ [c | 1]`` are ``bmm`` calls with the
  query as the batch index, ``round_up(heads, 4)`` rows, and inner sizes fixed by the model
  (``kv_lora_rank + qk_rope_head_dim``, then ``index_topk`` keys in column order): the batch count cannot
  change an element. Candidates that are not visible get probability ``exp(-inf) = 0`` and add exact
  zeros. The softmax max is an exact ``amax``; ``exp`` is the numerics' padded element-wise call.

The incident on demand (``numerics="shape-dependent"``, or ``unsafe_topk``): :func:`arrival_topk`
selects as a persistent top-k kernel that hands out output slots by atomic counter does, on scores
rounded to bfloat16 as production indexers compute them (fp8 / bf16), where equal scores are common.
Partitions of the key range finish in an order set by the load - here, by the step's row count - and
among equal scores the one whose partition arrived first takes the slot: the selected set and its order
then follow the batch, not the request.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvwarden.intmath import round_up
from kvwarden.layers.rotary import rotate_half

NEG_INF = float("-inf")
TopK = Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]
KEY_TILE = 64  # index-score GEMMs see a key count rounded up to this (zero keys, dropped)


def select_topk(scores: torch.Tensor, k: int, deterministic: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, columns)`` of the ``k`` best scores per row of ``[rows, n]`` (``n >= k``).

    ``deterministic``: the set ranked by score descending, ties to the lower column (a function of the row
    alone), returned in column order (as ``kernels/topk.py`` returns it); else ``torch.topk`` (which of
    several equal scores it keeps, and their order, unspecified).

    NOTE(invariance): a row without equal scores among its best ``k`` (and none equal to the ``k``-th left
    out) has exactly one answer, which ``torch.topk`` returns whatever its internals. Every other row is
    redone by :func:`_topk_ties`: from the library it takes only the ``k``-th largest *value* (the same
    whichever equal element was kept), then every score above it and the lowest-column scores equal to it
    (an exact integer count). Either way the set is then put in column order. The check is linear in ``n``.
    """
    values, columns = torch.topk(scores, k, dim=-1)
    if not deterministic or k == 0:
        return values, columns
    kth = values[:, k - 1 :]
    tied = (values[:, 1:] == values[:, :-1]).any(dim=-1)
    tied |= (scores == kth).sum(dim=-1) > (values == kth).sum(dim=-1)
    if bool(tied.any()):
        rows = tied.nonzero()[:, 0]
        values[rows], columns[rows] = _topk_ties(scores[rows], kth[rows], k)
    return column_order(values, columns)


def column_order(values: torch.Tensor, columns: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A selection ``(values, columns)`` put in ascending column order (its columns are distinct).

    NOTE(invariance): the order is a function of the set alone; the attention then folds the selected
    keys in position order, as dense attention does."""
    columns, order = torch.sort(columns, dim=-1)
    values = values.gather(-1, order).float() + 0.0  # -0.0 as +0.0, as the kernel's keys make it
    return values.contiguous(), columns.contiguous()


def _topk_ties(scores: torch.Tensor, kth: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The canonical top ``k`` of rows with ties, given each row's ``k``-th largest value."""
    above = scores > kth
    equal = scores == kth
    need = k - above.sum(dim=-1, keepdim=True)
    chosen = above | (equal & (torch.cumsum(equal, dim=-1) <= need))
    columns = chosen.nonzero()[:, 1].view(scores.shape[0], k)  # ascending column order within each row
    return scores.gather(1, columns), columns


ARRIVAL_PARTITIONS = 8  # parallel partitions of the key range in the arrival-order model


def arrival_topk(scores: torch.Tensor, k: int, arrival: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, columns)`` as a kernel that hands out slots in arrival order would give them (the incident).

    The columns are cut into :data:`ARRIVAL_PARTITIONS` partitions; each offers its own best ``k``; the
    partitions arrive in an order set by ``arrival`` (the load: the step's row count), and among equal
    scores the earlier arrival wins. Not invariant by design.
    """
    n = scores.shape[1]
    parts = min(ARRIVAL_PARTITIONS, n)
    bounds = [n * p // parts for p in range(parts + 1)]
    order = sorted(range(parts), key=lambda p: (p * 5 + arrival) % parts)
    values, columns = [], []
    for p in order:
        lo, hi = bounds[p], bounds[p + 1]
        v, c = torch.topk(scores[:, lo:hi], min(k, hi - lo), dim=-1)
        values.append(v)
        columns.append(c + lo)
    offered_v, offered_c = torch.cat(values, 1), torch.cat(columns, 1)
    ranked = torch.sort(offered_v, dim=-1, descending=True, stable=True)
    return ranked.values[:, :k], offered_c.gather(1, ranked.indices[:, :k])


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepSeek's interleaved rotary on ``x [rows, heads, 2m]``: pairs ``(x0, x1), (x2, x3), ...`` each turn by
    one frequency; the result lists the turned even elements, then the odd ones (as transformers writes it).
    ``cos`` / ``sin``: ``[rows, m]``."""
    cos, sin = cos.unsqueeze(1).to(x.dtype), sin.unsqueeze(1).to(x.dtype)
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat([even * cos - odd * sin, odd * cos + even * sin], dim=-1)


def rope_half_split(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary on ``x [rows, heads, 2m]`` with the halves paired (``rotate_half``; DeepSeek-V3.2's indexer).
    ``cos`` / ``sin``: ``[rows, m]``, one per frequency."""
    cos, sin = cos.unsqueeze(1).to(x.dtype), sin.unsqueeze(1).to(x.dtype)
    cos, sin = torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)
    return x * cos + rotate_half(x) * sin


def index_scores(
    q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor, scale: float, first_pos: int
) -> torch.Tensor:
    """The indexer's score of every cached key for each query of one request.

    Args:
        q: ``[T, H, D]`` the chunk's indexer queries (rope applied), float32.
        keys: ``[n, D]`` the request's indexer keys at positions ``0 .. n - 1``, float32.
        weights: ``[T, H]`` per-head weights (``weights_proj`` output times ``H ** -0.5``), float32.
        scale: ``D ** -0.5``.
        first_pos: position of the chunk's first query (query ``t`` sees keys ``<= first_pos + t``).

    Returns:
        ``[T, n]`` float32: ``sum_h w[t, h] * relu(scale * q[t, h] . k[j])``, ``-inf`` past the query.
    """
    t, h, d = q.shape
    hp = round_up(h, 4)
    if hp != h:  # NOTE(invariance): GEMM rows per query a multiple of 4 (module note)
        q = torch.cat([q, q.new_zeros((t, hp - h, d))], dim=1)
    n = keys.shape[0]
    padded = round_up(n, KEY_TILE)
    if padded != n:  # NOTE(invariance): MKL takes another path for a few small key counts (module note)
        keys = torch.cat([keys, keys.new_zeros((padded - n, d))])
    raw = torch.mm(q.reshape(t * hp, d), keys.t()).view(t, hp, padded)[..., :n]
    per_head = torch.relu(raw.mul_(scale))
    total = weights[:, 0:1] * per_head[:, 0]
    for i in range(1, h):  # NOTE(invariance): heads folded in a fixed order, element by element
        total = total + weights[:, i : i + 1] * per_head[:, i]
    dev = total.device
    future = torch.arange(n, device=dev).view(1, n) > (first_pos + torch.arange(t, device=dev)).view(t, 1)
    return total.masked_fill_(future, NEG_INF)


def select_keys(
    scores: torch.Tensor, k: int, arrival: int | None = None, topk: TopK | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(positions [T, k], visible [T, k])``: each query's ``k`` selected key positions in column order;
    a query that sees fewer than ``k`` keys gets ``-inf`` candidates (``visible`` false) after them.

    ``arrival``: None selects deterministically (``topk``: a function with :func:`select_topk`'s total
    order, by default that one; the GPU passes ``kernels/topk.py``'s); an int re-creates the incident
    (:func:`arrival_topk` on bfloat16-rounded scores, arriving as that int says)."""
    t, n = scores.shape
    if n < k:
        scores = torch.cat([scores, scores.new_full((t, k - n), NEG_INF)], dim=1)
    if arrival is None:
        values, positions = topk(scores, k) if topk is not None else select_topk(scores, k, deterministic=True)
    else:
        values, positions = arrival_topk(scores.to(torch.bfloat16).float(), k, arrival)
    visible = values > NEG_INF
    # a candidate past the context reads position 0's row; its probability is exactly zero
    return torch.where(visible, positions, torch.zeros_like(positions)), visible


def latent_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    visible: torch.Tensor,
    kv_lora_rank: int,
    scale: float,
    exp: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """Absorbed MLA over each query's selected latent rows.

    Args:
        q: ``[T, H, L]``: per head the query turned into latent space (``q_nope @ W_uk``) then its rotated
            part; ``L = kv_lora_rank + qk_rope_head_dim``; float32.
        keys: ``[T, k, L]`` each query's selected cache rows (``[c | k_rope]``) in column order, float32.
        visible: ``[T, k]`` which candidates the query may attend to.
        kv_lora_rank: ``r``: the latent part of a row (the values are the latent itself).
        scale: softmax scale (``(qk_nope_head_dim + qk_rope_head_dim) ** -0.5``).
        exp: the numerics' element-wise ``exp``.

    Returns:
        ``[T, H, r]`` float32: the attention-weighted latent per head (``W_uv`` is applied by the caller).
    """
    t, h, width = q.shape
    hp = round_up(h, 4)
    if hp != h:  # NOTE(invariance): a fixed row count per query (module note)
        q = torch.cat([q, q.new_zeros((t, hp - h, width))], dim=1)
    scores = torch.bmm(q, keys.transpose(1, 2)).mul_(scale)  # [T, Hp, k]
    scores.masked_fill_(~visible.unsqueeze(1), NEG_INF)
    peak = scores.amax(dim=-1, keepdim=True)  # the best candidate is always visible: finite
    probs = exp(scores.sub_(peak))
    values = torch.cat([keys[..., :kv_lora_rank], keys.new_ones((t, keys.shape[1], 1))], dim=-1)
    out = torch.bmm(probs, values)  # [T, Hp, r + 1]: the numerator and the row sum in one fixed-shape product
    return (out[..., :kv_lora_rank] / out[..., kv_lora_rank:])[:, :h]
