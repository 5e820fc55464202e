"""A verify graph's recurrent states after every token, and the return to the last accepted one.

A verify step advances each request's recurrent state through its last token and all ``k`` drafts.
Eagerly, the engine checkpoints the state first and, after a rejection, restores the checkpoint and
recomputes the accepted tokens in the next step. A verify graph instead keeps the state after every
token (the scan kernels store it in the loop; the conv windows are the step's raw inputs behind the
window it started from), so the state after the last accepted token is picked on the device: one
gather and one scatter per tensor per step, no recomputation, and the next step is a plain
``1 + k``-row step that replays a graph again.

NOTE(invariance): the kept state is the very tensor the token-by-token kernel computed after that
token - the bits an eager step (or plain decoding) computes at that position, since the kernels are
row- and chunk-invariant; rejected drafts never reach a kept state. Boundary states for the prefix
cache are staged from the same tensors, only at positions the kept tokens reach.
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
    """

    def __init__(
        self,
        states: StatePool,
        layers: list[tuple[torch.Tensor, torch.Tensor]],
        q: int,
        index: dict[str, int],
        block_size: int,
    ) -> None:
        assert len(layers) == len(states.specs), "every recurrent layer keeps its token states"
        self.states, self.layers, self.q, self.index, self.block_size = states, layers, q, index, block_size
        self._restore: list[tuple[Request, int, int]] = []  # (request, index in step, token kept last)

    def keep(self, req: Request, start: int, kept: int) -> None:
        """``req`` keeps its tokens ``start .. start + kept`` (its last token and ``kept`` drafts):
        stage the boundary states they reach and, after a rejection, queue the return to the state
        after token ``start + kept`` (done for the whole step by :meth:`flush`)."""
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
        """Return every request that rejected a draft to its last kept token (one gather and one
        scatter per state tensor; requests that finished meanwhile are skipped)."""
        todo = [(r, i, t) for r, i, t in self._restore if not r.is_finished]
        self._restore = []
        if not todo:
            return
        dev = self.states.conv[0].device
        slots = torch.tensor([self.states.working[r.request_id] for r, _, _ in todo], dtype=torch.long).to(dev)
        seq = torch.tensor([i for _, i, _ in todo], dtype=torch.long).to(dev)
        tok = torch.tensor([t for _, _, t in todo], dtype=torch.long).to(dev)
        last = self.q - 1
        for layer, (inputs, scans) in enumerate(self.layers):
            k1 = inputs.shape[1] - self.q
            window = tok[:, None] + 1 + torch.arange(k1, device=dev)[None, :]  # rows t + 1 .. t + K - 1
            self.states.conv[layer].index_copy_(0, slots, inputs[seq[:, None], window])
            self.states.ssm[layer].index_copy_(0, slots, scans.index_select(0, seq * last + tok))
