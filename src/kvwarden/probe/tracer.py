"""Activation tracing: where do two runs of the same tokens first differ, bit for bit?

A :class:`Tracer` rides on the model's forward batch and keeps, for the
requests it watches, every hooked activation row by absolute position:
layer inputs and outputs, projections, the attention context read from the KV
cache, the recurrent state a scan starts from. :func:`compare` walks two traces
in model order and reports the first (operation, position) whose bits differ,
the max |delta| there, and how the difference grows layer by layer.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class Tracer:
    """Records activations of the watched requests (all requests when ``watch`` is empty)."""

    watch: set[str] = field(default_factory=set)
    traces: dict[str, dict[str, dict[int, torch.Tensor]]] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)
    _seen: set[str] = field(default_factory=set)

    def _wants(self, request_id: str) -> bool:
        return not self.watch or request_id in self.watch

    def _store(self, request_id: str, name: str, pos: int, row: torch.Tensor) -> None:
        if name not in self._seen:
            self._seen.add(name)
            self.order.append(name)
        self.traces.setdefault(request_id, {}).setdefault(name, {})[pos] = row.detach().float().clone()

    def record(self, name: str, rows: torch.Tensor, seqs: Any) -> None:
        """``rows`` aligned with the step's batch rows; ``seqs`` the batch's SeqSlices."""
        for seq in seqs:
            if self._wants(seq.request_id):
                for i in range(seq.num_tokens):
                    self._store(seq.request_id, name, seq.start + i, rows[seq.row_start + i])

    def record_context(self, name: str, request_id: str, rows: torch.Tensor) -> None:
        """Rows for positions ``[0, len(rows))`` as read (e.g. K/V from the cache)."""
        if self._wants(request_id):
            for pos in range(rows.shape[0]):
                self._store(request_id, name, pos, rows[pos])

    def record_at(self, name: str, request_id: str, pos: int, value: torch.Tensor) -> None:
        if self._wants(request_id):
            self._store(request_id, name, pos, value.reshape(-1))


@dataclass(frozen=True)
class Divergence:
    """Result of :func:`compare`."""

    identical: bool
    first_op: str | None
    first_position: int | None
    max_abs_delta: float
    common_positions: int
    per_layer: list[tuple[int, float]]  # (layer, max |delta| of the layer's output) in order
    differing_ops: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "identical": self.identical,
            "first_op": self.first_op,
            "first_position": self.first_position,
            "max_abs_delta": self.max_abs_delta,
            "common_positions": self.common_positions,
            "per_layer": [{"layer": layer, "max_abs_delta": d} for layer, d in self.per_layer],
            "differing_ops": self.differing_ops,
        }


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def compare(
    a: dict[str, dict[int, torch.Tensor]],
    b: dict[str, dict[int, torch.Tensor]],
    order: list[str],
    positions: set[int] | None = None,
) -> Divergence:
    """First bitwise difference between two traces of one request's tokens.

    Ops are visited in model order; within an op, positions ascending. Only
    positions present in both traces (and in ``positions``, if given) count.
    """
    first_op, first_pos, delta, differing, common = None, None, 0.0, 0, set()
    layer_delta: dict[int, float] = {}
    for op in order:
        xs, ys = a.get(op, {}), b.get(op, {})
        shared = sorted(set(xs) & set(ys) & (positions if positions is not None else set(xs)))
        common.update(shared)
        op_diff = False
        for pos in shared:
            x, y = xs[pos], ys[pos]
            if x.shape != y.shape or not torch.equal(_bits(x), _bits(y)):
                d = float((x - y).abs().max()) if x.shape == y.shape else math.inf
                if first_op is None:
                    first_op, first_pos, delta = op, pos, d
                op_diff = True
                layer = _layer_of(op)
                if op.endswith(".out") and layer is not None:
                    layer_delta[layer] = max(layer_delta.get(layer, 0.0), d)
        differing += op_diff
    per_layer = sorted(layer_delta.items())
    return Divergence(
        identical=first_op is None,
        first_op=first_op,
        first_position=first_pos,
        max_abs_delta=delta,
        common_positions=len(common),
        per_layer=per_layer,
        differing_ops=differing,
    )


def _layer_of(op: str) -> int | None:
    match = re.match(r"L(\d+)\.", op)
    return int(match.group(1)) if match else None
