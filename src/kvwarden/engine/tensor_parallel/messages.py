"""What rank 0 tells the tensor-parallel workers through the store, as JSON (never pickle)."""

from __future__ import annotations

import json

from kvwarden.engine.model_runner import BatchEntry

FORWARD, STOP = "forward", "stop"


def encode_step(
    kind: str, entries: list[BatchEntry] | None = None, want: list[int] | None = None, states: list | None = None
) -> bytes:
    """``states``: rank 0's state-pool calls since the last step (``state_journal.py``), replayed first."""
    rows = [[e.request_id, e.token_ids, e.start, e.block_ids] for e in entries or []]
    return json.dumps({"kind": kind, "entries": rows, "want": want or [], "states": states or []}).encode()


def decode_step(data: bytes) -> tuple[str, list[BatchEntry], list[int], list]:
    msg = json.loads(data)
    entries = [
        BatchEntry(str(r), [int(t) for t in ids], int(s), [int(b) for b in blocks])
        for r, ids, s, blocks in msg["entries"]
    ]
    return msg["kind"], entries, [int(w) for w in msg["want"]], msg["states"]
