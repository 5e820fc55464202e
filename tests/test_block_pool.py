"""Block pool, chained hashes and the KV cache manager's narrow API."""

from __future__ import annotations

import pytest

from kvwarden.cache.block_pool import BlockPool
from kvwarden.cache.hashing import extend_hashes, hash_block
from kvwarden.cache.kv_cache_manager import CacheView, KVCacheManager


def _req(rid: str, tokens: list[int], salt: str | None = None) -> CacheView:
    return CacheView(request_id=rid, all_token_ids=list(tokens), cache_salt=salt)


def _run_to_end(kv: KVCacheManager, req: CacheView) -> None:
    """Allocate and 'compute' every token of req, publishing full blocks."""
    hits, n = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, len(req.all_token_ids) - n, hits) is not None
    req.num_computed_tokens = len(req.all_token_ids)
    kv.cache_computed_blocks(req)


def test_chained_hash_names_the_whole_prefix_and_salt_isolates() -> None:
    a = hash_block(None, [1, 2, 3, 4])
    assert a == hash_block(None, [1, 2, 3, 4])
    assert hash_block(a, [5, 6]) != hash_block(hash_block(None, [9, 2, 3, 4]), [5, 6])
    assert hash_block(None, [1, 2, 3, 4], "tenant-a") != a
    assert hash_block(None, [1, 2, 3, 4], "tenant-a") != hash_block(None, [1, 2, 3, 4], "tenant-b")
    hashes: list[bytes] = []
    extend_hashes(hashes, list(range(10)), 4, None)
    assert len(hashes) == 2  # only full blocks


def test_allocate_free_refcounts_and_lru_eviction_order() -> None:
    pool = BlockPool(4, enable_caching=True)
    kv = KVCacheManager(pool, block_size=4, enable_caching=True)
    a = _req("a", list(range(12)))  # 3 full blocks: ids 0, 1, 2
    _run_to_end(kv, a)
    assert pool.num_free_blocks == 1 and pool.num_cached_blocks == 3
    kv.free(a)
    assert pool.num_free_blocks == 4 and pool.num_cached_blocks == 3
    # b shares a's first two blocks: they are revived from the free queue
    b = _req("b", [*range(8), 100, 101, 102, 103, 104])
    hits, n = kv.get_computed_blocks(b)
    assert n == 8 and [h.block_id for h in hits] == [0, 1]
    assert kv.allocate_slots(b, len(b.all_token_ids) - n, hits) is not None
    assert [pool.blocks[i].ref_cnt for i in kv.block_ids("b")] == [1, 1, 1, 1]
    kv.check_integrity()
    # The never-used block 3 went first, then a's tail block 2 (freed first) was evicted;
    # a's head blocks were revived, not evicted.
    assert kv.block_ids("b") == [0, 1, 3, 2]
    assert pool.evictions == 1 and pool.num_cached_blocks == 2
    kv.free(b)
    kv.check_integrity()
    assert pool.num_free_blocks == 4


def test_hit_leaves_the_last_token_to_compute() -> None:
    pool = BlockPool(8, enable_caching=True)
    kv = KVCacheManager(pool, 4, True)
    a = _req("a", list(range(8)))
    _run_to_end(kv, a)
    same = _req("same", list(range(8)))
    _, n = kv.get_computed_blocks(same)
    assert n == 4, "an exact-multiple prompt recomputes its last block to get logits"


def test_token_ids_are_rechecked_on_a_hash_hit() -> None:
    pool = BlockPool(4, enable_caching=True)
    block = pool.allocate(1)[0]
    pool.cache(block, b"h" * 32, (1, 2, 3, 4))
    assert pool.lookup(b"h" * 32, (1, 2, 3, 4)) is block
    assert pool.lookup(b"h" * 32, (1, 2, 3, 5)) is None  # a colliding hash with other tokens


def test_salted_requests_do_not_share_blocks() -> None:
    pool = BlockPool(16, enable_caching=True)
    kv = KVCacheManager(pool, 4, True)
    _run_to_end(kv, _req("a", list(range(12)), salt="alice"))
    assert kv.get_computed_blocks(_req("b", list(range(12)), salt="bob"))[1] == 0
    assert kv.get_computed_blocks(_req("c", list(range(12))))[1] == 0
    assert kv.get_computed_blocks(_req("d", list(range(12)), salt="alice"))[1] == 8


def test_allocate_slots_returns_none_and_changes_nothing_when_full() -> None:
    pool = BlockPool(3, enable_caching=False)
    kv = KVCacheManager(pool, 4, False)
    a = _req("a", list(range(20)))
    assert kv.allocate_slots(a, 20) is None
    assert pool.num_free_blocks == 3 and kv.block_ids("a") == []
    assert kv.allocate_slots(a, 12) is not None
    assert kv.allocate_slots(_req("b", [1]), 1) is None
    kv.check_integrity()


def test_check_integrity_catches_corruption() -> None:
    pool = BlockPool(4, enable_caching=True)
    blocks = pool.allocate(2)
    pool.check_integrity()
    blocks[0].ref_cnt = 0  # a leaked reference: ref 0 but not in the free queue
    with pytest.raises(AssertionError, match="block 0"):
        pool.check_integrity()
    blocks[0].ref_cnt = 1
    pool.free(blocks)
    with pytest.raises(RuntimeError, match="double free"):
        pool.free(blocks)
