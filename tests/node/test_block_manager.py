"""The paged KV block manager: exact accounting, block tables, slots."""

from __future__ import annotations


from cadenza.node.core.block_manager import KVBlockManager


def test_allocate_slots_grows_a_table_to_hold_the_tokens():
    bm = KVBlockManager(num_blocks=10, block_size=4)
    assert bm.allocate_slots("a", 5) and bm.block_table("a") == [0, 1]
    assert bm.allocate_slots("a", 8) and bm.block_table("a") == [0, 1]
    assert bm.allocate_slots("a", 9) and bm.block_table("a") == [0, 1, 2]
    assert bm.num_used_blocks == 3 and bm.num_free_blocks == 7 and bm.consistent()


def test_allocate_slots_says_no_and_changes_nothing_when_blocks_are_short():
    bm = KVBlockManager(num_blocks=3, block_size=4)
    assert bm.allocate_slots("a", 8)
    assert not bm.allocate_slots("b", 5)
    assert bm.num_used_blocks == 2 and not bm.holds("b") and bm.consistent()
    assert bm.allocate_slots("b", 4)


def test_free_returns_every_block_and_is_idempotent():
    bm = KVBlockManager(num_blocks=6, block_size=2)
    bm.allocate_slots("a", 5)
    bm.allocate_slots("b", 3)
    assert bm.free("a") == 3 and bm.free("a") == 0
    bm.free("b")
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == 6 and not bm.holds("b") and bm.consistent()


def test_freed_blocks_are_reused_so_tables_become_non_contiguous():
    bm = KVBlockManager(num_blocks=4, block_size=1)
    bm.allocate_slots("a", 1)
    bm.allocate_slots("b", 1)
    bm.free("a")
    bm.allocate_slots("c", 3)
    assert bm.block_table("c") == [2, 3, 0]


def test_a_decode_adds_a_block_only_at_a_block_boundary():
    bm = KVBlockManager(num_blocks=2, block_size=4)
    bm.allocate_slots("a", 4)
    assert bm.allocate_slots("a", 4) and bm.num_used_blocks == 1
    assert bm.allocate_slots("a", 5) and bm.num_used_blocks == 2
    assert bm.allocate_slots("b", 0) and not bm.allocate_slots("b", 1)


def test_capacity_counts_own_and_free_blocks():
    bm = KVBlockManager(num_blocks=5, block_size=4)
    bm.allocate_slots("a", 6)
    assert bm.capacity("a") == 20 and bm.capacity("b") == 12


def test_an_admitted_prompt_reserves_the_blocks_it_still_needs_and_uses_them_up():
    bm = KVBlockManager(num_blocks=10, block_size=4)
    bm.admit("a", [], 14)  # 4 blocks to finish its prompt
    assert bm.num_reserved_blocks == 4 and bm.headroom([]) == 6
    bm.allocate_slots("a", 8)  # a first chunk of 8 tokens takes 2 of them
    assert bm.num_reserved_blocks == 2 and bm.headroom([]) == 6 and bm.consistent()
    assert bm.reclaimable("a") == 2 + 2  # its blocks and what it still had a claim on
    bm.allocate_slots("a", 14)
    assert bm.num_reserved_blocks == 0
    bm.free("a")
    assert bm.num_reserved_blocks == 0 and bm.headroom([]) == 10 and bm.consistent()


def test_freeing_a_partial_prefill_drops_its_reservation():
    bm = KVBlockManager(num_blocks=10, block_size=4)
    bm.admit("a", [], 16)
    bm.allocate_slots("a", 4)
    bm.free("a")
    assert bm.num_reserved_blocks == 0 and bm.consistent()


# -- prefix caching -----------------------------------------------------------------------------------


def cached_manager(num_blocks=8, block_size=4) -> KVBlockManager:
    return KVBlockManager(num_blocks, block_size, prefix_caching=True)


def test_a_block_is_offered_for_reuse_only_after_its_kv_is_committed():
    bm = cached_manager()
    tokens = list(range(100, 113))  # 13 tokens: 3 full blocks
    bm.allocate_slots("a", 13)
    assert bm.match_prefix("b", tokens) == []  # scheduled, KV not written yet
    bm.commit("a", tokens, 8)  # the step wrote 8 tokens: 2 full blocks
    assert bm.match_prefix("b", tokens) == bm.block_table("a")[:2]


def test_the_last_token_is_never_served_from_the_cache():
    bm = cached_manager()
    tokens = list(range(8))  # exactly 2 blocks
    bm.allocate_slots("a", 8)
    bm.commit("a", tokens, 8)
    assert len(bm.match_prefix("b", tokens)) == 1  # the last block would hold the recomputed token
    assert len(bm.match_prefix("c", tokens + [9])) == 2


def test_hashes_chain_over_the_whole_prefix():
    bm = cached_manager()
    bm.allocate_slots("a", 8)
    bm.commit("a", [1, 2, 3, 4, 5, 6, 7, 8], 8)
    assert bm.match_prefix("b", [9, 9, 9, 9, 5, 6, 7, 8, 0]) == []  # same second block, other prefix


def test_block_hashes_are_truncated_sha256_over_the_parent_hash_and_the_token_ids():
    import hashlib
    from array import array

    from cadenza.node.core.block_manager import block_hash, root_hash

    tokens = [1, 70_000, 3, 2**31]
    expected = hashlib.sha256(root_hash() + array("I", tokens).tobytes()).digest()[:16]
    assert block_hash(root_hash(), tokens) == expected and len(expected) == 16
    assert root_hash(b"tenant=a") != root_hash() != root_hash(b"tenant=b")
    bm = cached_manager()
    bm.allocate_slots("a", 8)
    bm.commit("a", tokens + [5, 6, 7, 8], 8)
    assert bm._hashes["a"] == [expected, block_hash(expected, [5, 6, 7, 8])]


def test_requests_share_cached_blocks_only_under_the_same_salt():
    bm = cached_manager(num_blocks=16)
    tokens = list(range(13))
    bm.allocate_slots("a", 13)
    bm.commit("a", tokens, 13, salt=b"tenant=acme")
    assert bm.match_prefix("b", tokens) == []  # no salt
    assert bm.match_prefix("c", tokens, salt=b"tenant=other") == []
    assert bm.match_prefix("d", tokens, salt=b"tenant=acme") == bm.block_table("a")[:3]
    bm.allocate_slots("e", 13)
    bm.commit("e", tokens, 13)  # the unsalted copy is cached apart
    assert bm.match_prefix("f", tokens) == bm.block_table("e")[:3]


def test_shared_blocks_are_ref_counted_and_survive_their_first_user():
    bm = cached_manager()
    tokens = list(range(9))
    bm.allocate_slots("a", 9)
    bm.commit("a", tokens, 9)
    shared = bm.match_prefix("b", tokens)
    bm.admit("b", shared, 9)
    assert bm.reclaimable("b") == 1 and bm.reclaimable("a") == 1  # both shared blocks held twice
    bm.free("a")
    assert bm.reclaimable("b") == 3 and bm.num_used_blocks == 2 and bm.consistent()  # 2 own + 1 reserved
    bm.free("b")
    assert bm.num_used_blocks == 0 and bm.num_cached_free_blocks == 2


def test_cached_free_blocks_are_evicted_least_recently_freed_first_and_only_when_needed():
    bm = cached_manager(num_blocks=4, block_size=2)
    bm.allocate_slots("a", 4)
    bm.commit("a", [1, 2, 3, 4], 4)
    bm.free("a")  # both blocks cached; the tail block is freed first, so it goes first
    assert bm.num_cached_free_blocks == 2 and bm.num_plain_free_blocks == 2
    bm.allocate_slots("x", 4)  # two plain free blocks exist: nothing evicted
    assert bm.num_evictions == 0 and len(bm.match_prefix("b", [1, 2, 3, 4, 5])) == 2
    bm.allocate_slots("y", 2)
    assert bm.num_evictions == 1 and len(bm.match_prefix("c", [1, 2, 3, 4, 5])) == 1  # the prefix head survived


def test_accounting_is_exact_with_sharing():
    bm = cached_manager()
    bm.allocate_slots("a", 12)
    bm.commit("a", list(range(12)), 12)
    bm.admit("b", bm.match_prefix("b", list(range(13))), 13)
    bm.allocate_slots("b", 16)
    assert bm.num_used_blocks + bm.num_cached_free_blocks + bm.num_plain_free_blocks == bm.num_blocks
    assert bm.num_used_blocks == len({*bm.block_table("a"), *bm.block_table("b")}) == 4 and bm.consistent()


def test_prefix_caching_off_matches_nothing():
    bm = KVBlockManager(8, 4, prefix_caching=False)
    bm.allocate_slots("a", 9)
    bm.commit("a", list(range(9)), 9)
    assert bm.match_prefix("b", list(range(9))) == []
    bm.free("a")
    assert bm.num_cached_free_blocks == 0
