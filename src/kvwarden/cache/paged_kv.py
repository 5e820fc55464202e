"""The device KV tensors, handed out one layer at a time behind that layer's pending copies.

NOTE(invariant): a host-tier load writes a block's KV while earlier layers
compute; the only way to get layer ``i``'s tensors is ``kv[i]``, which first
waits for every copy queued for layer ``i`` (loads into its blocks, write-backs
out of blocks about to be overwritten). A new consumer of the cache cannot
forget the wait: there is no other handle. ``unsafe_loads`` skips the wait for
loads only, re-creating the race of engines that read before the load landed
(testing only: ``--unsafe-host-load``); a copy added with ``race=True`` is
never waited for on the compute path either (``--unsafe-indexer-load``: the
sparse-attention indexer's keys, loaded by their own copy after the latent KV's).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from kvwarden.cache.transfer import Ticket

KV = tuple[torch.Tensor, torch.Tensor]


class PagedKV:
    """Per attention layer ``(K, V)`` flat caches, read through :meth:`__getitem__`."""

    def __init__(self, layers: list[KV], unsafe_loads: bool = False) -> None:
        self._layers = layers
        self.unsafe_loads = unsafe_loads
        self._pending: list[list[tuple[Ticket, bool]]] = [[] for _ in layers]  # (ticket, skip the wait)
        self._issued: list[Ticket] = []

    def __len__(self) -> int:
        return len(self._layers)

    def __getitem__(self, layer: int) -> KV:
        pending, self._pending[layer] = self._pending[layer], []
        for ticket, skip in pending:
            if not skip:
                ticket.wait()
        return self._layers[layer]

    def __iter__(self) -> Iterator[KV]:
        return (self[i] for i in range(len(self._layers)))

    @property
    def nbytes(self) -> int:
        """Bytes of every layer's cache tensors (the null and scratch slots included)."""
        return sum(t.numel() * t.element_size() for kv in self._layers for t in kv)

    def raw(self, layer: int) -> KV:
        """The tensors without waiting: for the copy engine only (it queues behind the pending copies)."""
        return self._layers[layer]

    def add(self, layer: int, ticket: Ticket, load: bool, race: bool = False) -> None:
        """A copy queued for ``layer``: its next reader waits for it (unless it is a load and loads race, or
        ``race``: testing only). Every copy is still synchronised at the end of the step (:meth:`settle`)."""
        self._pending[layer].append((ticket, race or (load and self.unsafe_loads)))
        if not any(t is ticket for t in self._issued[-1:]):  # one ticket may serve every layer
            self._issued.append(ticket)

    def settle(self) -> None:
        """Block until every copy issued so far is done with the device blocks (end of a step)."""
        for ticket in self._issued:
            ticket.synchronize()
        self._issued = []
        for pending in self._pending:
            pending.clear()
