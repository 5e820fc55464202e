"""One step's requests as the batched recurrent kernels see them (device tensors, built once per step).

The GPU backends run every recurrent layer of a step as a handful of launches
over all of the step's requests (:mod:`kvwarden.layers.kernels.recurrent`,
:mod:`kvwarden.layers.kernels.conv`); each request is addressed through these
index tensors: its rows in the batch and its working-state slot in the state
pool. A decode CUDA graph keeps the same tensors as static buffers and fills
them before a replay, so no per-request Python runs inside a step.

No Triton here: the model files import this type on every backend.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StateCapture:
    """A recurrent state the kernels copy out after a token: for the prefix cache (a block boundary), and/or
    as a verify step's candidate state to return to (:meth:`kvwarden.cache.state_pool.StatePool.keep_token`)."""

    seq: int  # index of the request in the step
    request_id: str
    pos: int  # absolute position; the state after token ``pos - 1``
    index: int  # token index inside the request's rows of this step after which it is taken
    boundary: bool = True  # a block boundary: staged for the prefix cache
    token: bool = False  # a verify step's token (its last real one or a draft): kept for the return


@dataclass(frozen=True)
class RecurrentMeta:
    """Per-step addressing of the batched recurrent kernels.

    Attributes:
        seq_row0, seq_len, seq_slot, seq_start: ``[seqs]`` int32: first row in the batch,
            number of rows (0 for a decode graph's padding rows), working-state
            slot and absolute position of the first row of each request (the
            chunked scan's grid is fixed to absolute positions).
        chunk0: ``[seqs]`` int32: the chunked scan's first scratch row for the request's grid chunks
            (it touches ``cdiv(start % chunk + rows, chunk)`` of them).
        row_seq: ``[rows]`` int32, the request of each row.
        cap_first, cap_count: ``[seqs]`` int32: a request's first entry in
            ``cap_at`` and how many it has.
        cap_at: ``[max(captures, 1)]`` int32: token indices (inside the request's
            rows) after which the kernel copies its state out, ascending per request.
        captures: the same captures on the host, in ``cap_at`` order.
        host_seqs: per request ``(request id, first row, rows, absolute start, slot)`` on the host
            (empty in a decode graph).
        per_token: ``q`` in a verify graph, where every request has ``q`` rows and the kernels keep
            the state after each of its first ``q - 1`` tokens (``cap_at`` then lists them), so the
            step's caller can return a request to the last accepted token on the device; else 0.
        chunk, num_chunks, max_chunks: the chunked scan's grid chunk, its scratch rows (every request's
            grid chunks) and the most grid chunks one request touches (host integers: shapes).
    """

    seq_row0: torch.Tensor
    seq_len: torch.Tensor
    seq_slot: torch.Tensor
    seq_start: torch.Tensor
    chunk0: torch.Tensor
    row_seq: torch.Tensor
    cap_first: torch.Tensor
    cap_count: torch.Tensor
    cap_at: torch.Tensor
    captures: tuple[StateCapture, ...]
    host_seqs: tuple[tuple[str, int, int, int, int], ...]
    per_token: int = 0
    chunk: int = 16
    num_chunks: int = 0
    max_chunks: int = 0

    @property
    def num_seqs(self) -> int:
        return self.seq_row0.shape[0]

    @property
    def num_capture_rows(self) -> int:
        """Rows of the kernels' capture tensor: every request's ``q - 1`` token states in a verify graph,
        else the boundary captures."""
        return self.num_seqs * (self.per_token - 1) if self.per_token else len(self.captures)

    @staticmethod
    def build(
        seqs: list[tuple[str, int, int, int, int]],
        block_size: int,
        every_boundary: bool,
        device: torch.device,
        tokens: dict[str, range] | None = None,
        chunk: int = 16,
    ) -> RecurrentMeta:
        """Index tensors for one step, copied to the device in one transfer.

        Args:
            seqs: per request ``(request id, first row, rows, absolute start, state slot)``, in row order.
            every_boundary: capture the state at every block boundary the rows cross (kvwarden's rule);
                False keeps only a boundary the chunk ends on (vLLM's align mode, the fast path's rule).
            tokens: per request carrying drafts, the row indices after which its state is kept for
                the return to the last accepted token (its last real token and every draft but the last).
            chunk: the chunked scan's grid chunk (``numerics.scan_chunk``).
        """
        row0, lens, slots, starts, chunk0, row_seq, first, count, at = [], [], [], [], [], [], [], [], []
        num_chunks = max_chunks = 0
        captures: list[StateCapture] = []
        for s, (rid, r0, n, start, slot) in enumerate(seqs):
            row0.append(r0)
            lens.append(n)
            slots.append(slot)
            starts.append(start)
            touched = -(-(start % chunk + n) // chunk) if n else 0
            chunk0.append(num_chunks)
            num_chunks, max_chunks = num_chunks + touched, max(max_chunks, touched)
            row_seq.extend([s] * n)
            ends = range((start // block_size + 1) * block_size, start + n + 1, block_size)
            if not every_boundary:
                ends = [e for e in ends if e == start + n]
            bounds = {end - start - 1 for end in ends}
            kept = set(tokens.get(rid, ())) if tokens else set()
            first.append(len(at))
            for index in sorted(bounds | kept):  # one capture per token: the kernel checks cap_at once per token
                captures.append(StateCapture(s, rid, start + index + 1, index, index in bounds, index in kept))
                at.append(index)
            count.append(len(at) - first[-1])
        nseq = len(seqs)
        flat = row0 + lens + slots + starts + chunk0 + row_seq + first + count + (at or [-1])
        flat_t = torch.tensor(flat, dtype=torch.int32).to(device, non_blocking=True)
        parts = flat_t.split([nseq] * 5 + [len(row_seq)] + [nseq] * 2 + [max(len(at), 1)])  # the fields' order
        return RecurrentMeta(
            *parts,
            captures=tuple(captures),
            host_seqs=tuple(seqs),
            chunk=chunk,
            num_chunks=num_chunks,
            max_chunks=max_chunks,
        )
