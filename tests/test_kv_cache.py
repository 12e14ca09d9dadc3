"""BlockPool and KVCacheManager: free list, LRU eviction, prefix hits, counters."""

from __future__ import annotations

import pytest
from conftest import assert_kv_cache_empty

from treadle.core.kv_cache import (
    BlockPool,
    KVCacheManager,
    hash_block_tokens,
)
from treadle.core.request import Request


def free_ids(pool: BlockPool) -> list[int]:
    return [block.block_id for block in pool.free_block_queue]


def admit(kv: KVCacheManager, request: Request, num_new: int | None = None) -> list[int]:
    """Admit a request as the scheduler does: take the prefix hit, allocate the rest."""
    blocks, num_hit = kv.get_computed_blocks(request)
    num_new = request.num_tokens - num_hit if num_new is None else num_new
    block_ids = kv.allocate_slots(request, num_new, blocks, num_hit)
    assert block_ids is not None
    request.num_computed_tokens = num_hit + num_new
    return block_ids


def test_free_list_removal_from_the_middle_and_lru_order():
    pool = BlockPool(5)
    assert free_ids(pool) == [0, 1, 2, 3, 4]
    blocks = pool.get_new_blocks(5)
    assert pool.num_free_blocks == 0 and pool.usage == 1.0
    pool.free_blocks([blocks[i] for i in (3, 1, 4, 0, 2)])
    # Unhashed blocks: reused first, most recently freed first.
    assert free_ids(pool) == [2, 0, 4, 1, 3]
    pool.touch([blocks[4]])  # revived from the middle
    assert free_ids(pool) == [2, 0, 1, 3]
    assert blocks[4].ref_cnt == 1 and blocks[4].prev_free is None
    assert [b.block_id for b in pool.get_new_blocks(2)] == [2, 0]
    assert free_ids(pool) == [1, 3]


def test_cached_blocks_are_evicted_in_lru_order_after_unhashed_ones():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(4)
    hashes = [hash_block_tokens(None, [i]) for i in range(3)]
    pool.cache_full_blocks(blocks, hashes, 0, 3)  # block 3 stays unhashed
    pool.free_blocks([blocks[1]])
    pool.free_blocks([blocks[0]])
    pool.free_blocks([blocks[3]])
    pool.free_blocks([blocks[2]])
    assert free_ids(pool) == [3, 1, 0, 2]
    assert pool.get_cached_block(hashes[1]) is blocks[1]
    assert [b.block_id for b in pool.get_new_blocks(2)] == [3, 1]
    # Handing a cached block out evicts its hash.
    assert pool.get_cached_block(hashes[1]) is None and blocks[1].block_hash is None
    assert pool.get_cached_block(hashes[0]) is blocks[0]
    with pytest.raises(ValueError, match="cannot allocate 3 blocks: 2 free"):
        pool.get_new_blocks(3)


def test_block_hashes_chain_over_the_parent():
    first = hash_block_tokens(None, [1, 2])
    assert hash_block_tokens(None, [1, 2]) == first
    assert hash_block_tokens(first, [3, 4]) != hash_block_tokens(None, [3, 4])
    assert hash_block_tokens(None, [1, 2], ("salt",)) != first


def test_prefix_hit_shares_blocks_by_ref_count():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = Request("a", list(range(10)))
    a_ids = admit(kv, a)
    assert len(a_ids) == 3
    b = Request("b", list(range(8)) + [50, 51, 52])
    blocks, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 8 and [blk.block_id for blk in blocks] == a_ids[:2]
    b_ids = admit(kv, b)
    assert kv.block_ids("b") == b_ids and kv.block_ids("a") == a_ids
    assert b_ids[:2] == a_ids[:2] and b_ids[2] not in a_ids
    assert [kv.block_pool.blocks[i].ref_cnt for i in a_ids] == [2, 2, 1]
    assert kv.num_used_blocks == 4  # shared, never copied
    kv.check_invariants()
    kv.free(a)
    assert [kv.block_pool.blocks[i].ref_cnt for i in a_ids] == [1, 1, 0]
    kv.free(b)
    assert_kv_cache_empty(kv)


def test_free_cached_blocks_are_revived_by_a_hit():
    kv = KVCacheManager(num_blocks=6, block_size=2)
    a = Request("a", [1, 2, 3, 4, 5])
    a_ids = admit(kv, a)
    kv.free(a)
    assert kv.num_free_blocks == 6
    b = Request("b", [1, 2, 3, 4, 9])
    b_ids = admit(kv, b)
    assert b_ids[:2] == a_ids[:2]
    assert kv.num_free_blocks == 3
    assert not set(free_ids(kv.block_pool)) & set(b_ids)
    kv.check_invariants()


def test_hit_is_capped_one_token_short_of_the_tokens():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    admit(kv, Request("a", list(range(12))))
    # Fully cached 8-token prompt: the last block is left to compute, so there are logits.
    assert kv.get_computed_blocks(Request("b", list(range(8))))[1] == 4
    assert kv.get_computed_blocks(Request("c", list(range(9))))[1] == 8
    assert kv.get_computed_blocks(Request("d", list(range(12))))[1] == 8
    assert kv.get_computed_blocks(Request("e", [0]))[1] == 0


def test_cache_salt_separates_hashes():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    admit(kv, Request("a", list(range(9)), cache_salt="alice"))
    assert kv.get_computed_blocks(Request("b", list(range(9))))[1] == 0
    assert kv.get_computed_blocks(Request("c", list(range(9)), cache_salt="bob"))[1] == 0
    assert kv.get_computed_blocks(Request("d", list(range(9)), cache_salt="alice"))[1] == 8


def test_free_in_reverse_order_evicts_the_tail_first():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    a = Request("a", list(range(8)))
    a_ids = admit(kv, a)
    kv.free(a)
    assert free_ids(kv.block_pool) == a_ids[::-1]
    # A new request evicts a's last block first; a's prefix stays hittable.
    admit(kv, Request("b", [90, 91]))
    assert kv.get_computed_blocks(Request("c", list(range(7))))[1] == 6


def test_allocate_slots_grows_the_table_and_refuses_atomically():
    kv = KVCacheManager(num_blocks=3, block_size=2)
    a = Request("a", [1, 2, 3])
    assert admit(kv, a) == [0, 1]
    for token in (4, 5):  # decode: one token at a time, a new block only when one fills
        a.append_output_token(token)
        assert len(kv.allocate_slots(a, 1) or ()) == 2 + (token == 5)
        a.num_computed_tokens += 1
    b = Request("b", [7])
    assert kv.allocate_slots(b, 1) is None
    assert "b" not in kv.block_tables and kv.num_free_blocks == 0
    kv.check_invariants()


def test_hit_blocks_in_the_free_list_are_not_counted_as_free_for_the_rest():
    kv = KVCacheManager(num_blocks=3, block_size=2)
    a = Request("a", [1, 2, 3, 4, 5])
    admit(kv, a)
    kv.free(a)
    b = Request("b", [1, 2, 3, 4, 6, 7, 8])
    blocks, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 4
    # 2 hit blocks + 2 new ones > 3: refused, and the hit blocks stay free.
    assert kv.allocate_slots(b, 3, blocks, num_hit) is None
    assert kv.num_free_blocks == 3 and kv.prefix_cache_queries == 5
    kv.check_invariants()


def test_counters_count_tokens_once_per_admission():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = Request("a", list(range(10)))
    admit(kv, a, num_new=4)  # a chunk; later chunks are not new lookups
    kv.allocate_slots(a, 6)
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (10, 0)
    admit(kv, Request("b", list(range(10))))
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (20, 8)


def test_prefix_caching_disabled():
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_prefix_caching=False)
    admit(kv, Request("a", list(range(10))))
    b = Request("b", list(range(10)))
    assert kv.get_computed_blocks(b) == ([], 0)
    admit(kv, b)
    assert kv.num_used_blocks == 6 and not kv.block_pool.cached_block_hash_to_block
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (0, 0)


def test_concurrent_duplicate_block_stays_unhashed():
    kv = KVCacheManager(num_blocks=6, block_size=2)
    a, b = Request("a", [1, 2, 3]), Request("b", [1, 2, 3])
    a_ids = kv.allocate_slots(a, 3)
    b_ids = kv.allocate_slots(b, 3)  # same step, no hit taken: its copy is not published
    assert a_ids is not None and b_ids is not None
    pool = kv.block_pool
    assert pool.blocks[a_ids[0]].block_hash is not None
    assert pool.blocks[b_ids[0]].block_hash is None
    kv.check_invariants()
    kv.free(a)
    kv.free(b)
    assert_kv_cache_empty(kv)
