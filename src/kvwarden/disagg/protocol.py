"""The control messages of disaggregated serving (decode instance <-> prefill instance), over HTTP/JSON.

Data moves through NIXL (:mod:`kvwarden.disagg.transfer`); these messages
say what to move and when it is safe to let go of memory. Both calls are
made by the decode instance; every call has a timeout on the caller's side.

``POST /pd/v1/prefill`` (:class:`PrefillOrder` -> :class:`PrefillReport`)
    "Compute ``token_ids[:-1]`` and write its KV into my blocks
    ``block_ids[first_block:]`` (and, for hybrid models, the recurrent working
    state into my slot ``state_slot`` and the boundary states of those blocks
    into my snapshot slots ``snapshot_slots``)." Answered when every write has landed (``status: done``;
    the last write also carries the NIXL notification ``transfer_id``), or
    ``status: aborted`` if an abort came first. Writes started by this call go
    on even if the caller hangs up: only ``/pd/v1/abort`` stops them.

``POST /pd/v1/abort`` (:class:`AbortOrder` -> :class:`AbortReport`)
    "Stop writing for ``transfer_id``." Answered ``safe_to_reclaim: true``
    only when no write of that transfer has been posted or every posted write
    has completed; a transfer id not seen yet is remembered, so an order that
    arrives after its abort is refused. NOTE(invariant): this answer is the
    only event after which the decode instance frees the blocks of a request
    whose transfer was started (``--unsafe-pd-abort`` skips it, re-creating
    the race in which a late write corrupts the blocks' next owner).

``GET /pd/v1/stats``: counters of either role and the engine's pool (tests
check that both pools return to their baseline).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PeerInfo(_Message):
    """Who to write to: a NIXL agent name, its metadata (base64) and its memory layout."""

    agent: str
    metadata: str
    layout: dict


class PrefillOrder(_Message):
    transfer_id: str = Field(min_length=1)
    token_ids: list[int] = Field(min_length=2)
    cache_salt: str | None = None
    block_ids: list[int]
    first_block: int = Field(ge=0)
    state_slot: int | None = None
    snapshot_slots: list[tuple[int, int]] = []  # (block index, slot): the state at that block's end
    peer: PeerInfo


class PrefillReport(_Message):
    status: str  # "done" | "aborted"
    bytes: int = 0
    writes: int = 0
    compute_s: float = 0.0
    transfer_s: float = 0.0
    cached_tokens: int = 0  # prompt tokens the prefill instance found in its own prefix cache
    snapshots: list[int] = []  # block indices whose boundary state was written


class AbortOrder(_Message):
    transfer_id: str = Field(min_length=1)


class AbortReport(_Message):
    safe_to_reclaim: bool
    writes_posted: int = 0
    writes_completed: int = 0
