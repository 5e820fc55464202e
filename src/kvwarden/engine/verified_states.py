"""A verify graph's recurrent states after every token, and the return to the last accepted one.

A verify step advances each request's recurrent state through its last token and all ``k`` drafts.
Eagerly, the engine checkpoints the state first and, after a rejection, restores the checkpoint and
recomputes the accepted tokens in the next step. A verify graph instead keeps the state after every
token (the scan kernels store it in the loop; the conv windows are the step's raw inputs behind the
window it started from), so the state after the last accepted token is picked on the device: one
gather and one scatter per tensor per step, replayed as one graph, no recomputation, and the next
step is a plain ``1 + k``-row step that replays a graph again.

NOTE(invariance): the kept state is the very tensor the scan computed after that token - the bits an
eager step (or plain decoding) computes at that position, since the kernels are row- and
chunk-invariant; rejected drafts never reach a kept state. (With the chunked scans it is the state at
that token's grid point: the pending rows after it stay in the request's ring, addressed by position.)
Boundary states for the prefix cache are staged from the same tensors, only at positions the kept
tokens reach.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvwarden.cache.state_pool import StatePool

if TYPE_CHECKING:
    from kvwarden.engine.request import Request


class VerifiedStates:
    """Per-token states of one verify-graph step, valid until the next replay.

    Args:
        states: the working-state pool.
        layers: per recurrent layer ``(inputs [seqs, K - 1 + q, C], scans [seqs * (q - 1), ...])``
            (:func:`kvwarden.models.recurrent_batched.keep_token_states`).
        q: rows per request; index: request id -> its request index in the step.
        block_size: KV block size (where boundary states are staged).
        returns: the return graphs (:class:`StateReturns`).
    """

    def __init__(
        self,
        states: StatePool,
        layers: list[tuple[torch.Tensor, torch.Tensor]],
        q: int,
        index: dict[str, int],
        block_size: int,
        returns: StateReturns,
    ) -> None:
        assert len(layers) == len(states.specs), "every recurrent layer keeps its token states"
        self.states, self.layers, self.q, self.index, self.block_size = states, layers, q, index, block_size
        self.returns = returns
        self._restore: list[tuple[Request, int, int]] = []  # (request, index in step, token kept last)

    def keep(self, req: Request, start: int, kept: int) -> None:
        """``req`` keeps its rows ``start .. start + kept`` (its last token and ``kept`` accepted drafts, or a
        prompt chunk's tokens): stage the boundary states they reach and, when rows after them ran (a
        rejected draft, padding), queue the return to the state after row ``start + kept`` (done for the
        whole step by :meth:`flush`)."""
        i, last = self.index[req.request_id], self.q - 1
        bs = self.block_size
        for b in range((start // bs + 1) * bs, start + kept + 2, bs):  # boundaries b: states after b - 1
            t = b - start - 1
            for layer in range(len(self.layers)):
                conv, ssm = self._state_after(req, i, t, layer, last)
                self.states.stage(req.request_id, b, layer, conv, ssm)  # copied: the next replay reuses these
        if kept < last:
            self._restore.append((req, i, kept))

    def _state_after(self, req: Request, i: int, t: int, layer: int, last: int) -> tuple[torch.Tensor, torch.Tensor]:
        if t == last:  # after every token: the working state the step left
            slot = self.states.working[req.request_id]
            return self.states.conv[layer][slot], self.states.ssm[layer][slot]
        inputs, scans = self.layers[layer]
        k1 = inputs.shape[1] - self.q
        return inputs[i, t + 1 : t + 1 + k1], scans[i * last + t]

    def flush(self) -> None:
        """Return every request queued by :meth:`keep` to its last kept row (one replay of the return graph
        for the step's shape; requests that finished meanwhile are skipped)."""
        todo = [(r, i, t) for r, i, t in self._restore if not r.is_finished]
        self._restore = []
        if not todo:
            return
        size = self.layers[0][0].shape[0]
        slots, tokens = [self.states.scratch_slot] * size, [0] * size
        for r, i, t in todo:
            slots[i], tokens[i] = self.states.working[r.request_id], t
        self.returns.run(size, self.q, slots, tokens, self.layers)


class StateReturns:
    """The return to each request's last kept token after a verify step, replayed as one graph per
    ``(size, q)``: a Python loop over the recurrent layers costs ~6 launches per layer (~0.5 ms of host
    time per step on the 8-layer preset, more than the verify graph itself).

    Every request of the step is in the graph: one that keeps its last token (or finished) gathers
    into the pool's scratch slot, which no request owns, so the shapes never depend on who rejected.

    Args:
        states: the working-state pool; max_size: the largest batch of a verify graph.
        capture: record CUDA graphs (False: the same static step, eagerly).
    """

    def __init__(self, states: StatePool, max_size: int, capture: bool) -> None:
        dev = states.conv[0].device
        self.states, self.capture = states, capture
        self.index = torch.zeros((2, max_size), dtype=torch.long, device=dev)  # per request: slot, token kept
        width = max(max_size, *(c.shape[1] for c in states.conv))  # requests, and a conv window's rows
        self.arange = torch.arange(width, dtype=torch.long, device=dev)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None

    def prepare(self, size: int, q: int, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Capture the graph for a verify graph's static ``layers`` (its per-token states)."""
        if not self.capture:
            return
        self.index[0, :size] = self.states.scratch_slot  # the warm-up writes nobody's state
        self.index[1, :size] = 0
        self._apply(size, q, layers)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            self._apply(size, q, layers)
        self.graphs[size, q] = graph

    def run(
        self, size: int, q: int, slots: list[int], tokens: list[int], layers: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> None:
        self.index[:, :size].copy_(torch.tensor([slots, tokens], dtype=torch.long), non_blocking=True)
        graph = self.graphs.get((size, q))
        if graph is None:
            self._apply(size, q, layers)
        else:
            graph.replay()

    def _apply(self, size: int, q: int, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        # NOTE(invariance): a gather and a scatter of the kept tensors: copies, no arithmetic.
        slots, tok, seq = self.index[0, :size], self.index[1, :size], self.arange[:size]
        last = q - 1
        for layer, (inputs, scans) in enumerate(layers):
            k1 = inputs.shape[1] - q
            window = tok[:, None] + 1 + self.arange[None, :k1]  # rows t + 1 .. t + K - 1
            self.states.conv[layer].index_copy_(0, slots, inputs[seq[:, None], window])
            self.states.ssm[layer].index_copy_(0, slots, scans.index_select(0, seq * last + tok))
