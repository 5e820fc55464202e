"""Chained content hashes of full KV blocks.

``hash(block i) = sha256(hash(block i-1) || tokens of block i || extra)``, so a
hash names the whole prefix up to the end of the block. ``cache_salt`` is folded
into the first block only: requests with different salts never share a block,
requests with the same salt share exactly as unsalted ones do.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

ROOT = b"kvwarden/block-hash/v1"


def hash_block(parent: bytes | None, token_ids: Sequence[int], salt: str | None = None) -> bytes:
    """Hash of one full block given its parent's hash (``None`` for the first block)."""
    h = hashlib.sha256()
    h.update(ROOT if parent is None else parent)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    if parent is None and salt is not None:
        h.update(b"salt:" + salt.encode("utf-8"))
    return h.digest()


def extend_hashes(hashes: list[bytes], token_ids: Sequence[int], block_size: int, salt: str | None) -> None:
    """Append hashes for every block of ``token_ids`` that is full and not yet hashed."""
    while (len(hashes) + 1) * block_size <= len(token_ids):
        i = len(hashes)
        parent = hashes[-1] if hashes else None
        hashes.append(hash_block(parent, token_ids[i * block_size : (i + 1) * block_size], salt))
