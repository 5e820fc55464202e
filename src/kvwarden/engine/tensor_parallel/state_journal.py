"""Recurrent states under tensor parallelism: every rank holds the states of its own heads, in the same slots.

Rank 0's cache manager decides which working slot a request gets, which snapshot it restores, which
captured boundary becomes a snapshot, what a rejected draft rolls back and what eviction drops. The
workers must do exactly the same to their shards of those tensors, in the same order, between the same
steps. Rank 0's manager therefore talks to a :class:`StateJournal`: the state pool with every call that
changes a slot or a snapshot recorded; each step's message carries the calls since the last step, and a
worker replays them on its own pool before it runs the step (:func:`replay`). The pools start equal and
see the same calls, so their slot maps stay equal; the tensors differ only by which heads they hold.

NOTE(invariance): replay changes no arithmetic. A slot's state is one rank's heads' own recurrence, started
from zeros or from a snapshot of the same heads, whatever the rank count; nothing is summed across ranks.
"""

from __future__ import annotations

from typing import Any

from kvwarden.cache.state_pool import StatePool

# The calls that change slots or snapshots, with arguments that travel as JSON (ids, positions, hashes).
MIRRORED = frozenset(
    {
        "allocate_working", "free_working", "checkpoint", "checkpoint_many", "rollback", "drop_checkpoint",
        "return_to", "drop_tokens", "restore", "commit", "drop_staged", "evict",
    }
)  # fmt: skip
# Calls whose arguments are tensors of rank 0's heads (host tier, disaggregated transfer): not mirrored.
REFUSED = frozenset({"restore_from", "snapshot_to_host", "reserve_snapshots", "adopt_snapshots", "transfer_tensors"})


class StateJournal:
    """Rank 0's :class:`StatePool` as its cache manager sees it: reads pass through, changes are recorded."""

    def __init__(self, pool: StatePool) -> None:
        self._pool = pool
        self._calls: list[list[Any]] = []

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._pool, name)
        if name in REFUSED:
            raise RuntimeError(
                f"tensor parallelism: the recurrent state pool's {name} moves one rank's heads only; "
                "not supported with tensor_parallel_size > 1"
            )
        if name not in MIRRORED:
            return attr

        def recorded(*args: Any, **kwargs: Any) -> Any:
            self._calls.append([name, [_encode(a) for a in args], {k: _encode(v) for k, v in kwargs.items()}])
            return attr(*args, **kwargs)

        return recorded

    def take(self) -> list[list[Any]]:
        """The calls since the last step (for the step's message), in the order rank 0 made them."""
        calls, self._calls = self._calls, []
        return calls


def replay(pool: StatePool, calls: list[list[Any]]) -> None:
    """A worker's pool takes rank 0's calls, in order."""
    for name, args, kwargs in calls:
        if name not in MIRRORED:
            raise ValueError(f"tensor parallelism: rank 0 sent an unknown state-pool call {name!r}")
        getattr(pool, name)(*(_decode(a) for a in args), **{k: _decode(v) for k, v in kwargs.items()})


def _encode(value: Any) -> Any:
    if isinstance(value, bytes):
        return {"hash": value.hex()}
    if isinstance(value, (list, tuple)):
        return [_encode(v) for v in value]
    if value is None or isinstance(value, (str, int, bool)):
        return value
    raise TypeError(f"tensor parallelism: a state-pool argument of type {type(value).__name__} cannot travel")


def _decode(value: Any) -> Any:
    if isinstance(value, dict):
        return bytes.fromhex(value["hash"])
    if isinstance(value, list):
        return [_decode(v) for v in value]
    return value
