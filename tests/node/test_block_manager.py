"""The paged KV block manager: exact accounting, block tables, slots."""

from __future__ import annotations

import pytest

from cadenza.node.block_manager import KVBlockManager


def test_allocate_grows_a_table_to_hold_the_tokens():
    bm = KVBlockManager(num_blocks=10, block_size=4)
    assert bm.allocate("a", 5) == [0, 1]
    assert bm.allocate("a", 8) == []
    assert bm.allocate("a", 9) == [2]
    assert bm.block_table("a") == [0, 1, 2]
    assert bm.num_used_blocks == 3 and bm.num_free_blocks == 7


def test_can_allocate_matches_allocate():
    bm = KVBlockManager(num_blocks=3, block_size=4)
    bm.allocate("a", 8)
    assert bm.can_allocate("b", 4) and not bm.can_allocate("b", 5)
    with pytest.raises(MemoryError):
        bm.allocate("b", 5)
    assert bm.num_used_blocks == 2 and "b" not in bm.block_tables


def test_free_returns_every_block_and_is_idempotent():
    bm = KVBlockManager(num_blocks=6, block_size=2)
    bm.allocate("a", 5)
    bm.allocate("b", 3)
    assert bm.free("a") == 3 and bm.free("a") == 0
    bm.free("b")
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == 6 and not bm.block_tables


def test_freed_blocks_are_reused_so_tables_become_non_contiguous():
    bm = KVBlockManager(num_blocks=4, block_size=1)
    bm.allocate("a", 1)
    bm.allocate("b", 1)
    bm.free("a")
    bm.allocate("c", 3)
    assert bm.block_table("c") == [2, 3, 0]


def test_append_slot_adds_a_block_only_at_a_block_boundary():
    bm = KVBlockManager(num_blocks=2, block_size=4)
    bm.allocate("a", 4)
    assert bm.append_slot("a", 4) and bm.num_used_blocks == 1
    assert bm.append_slot("a", 5) and bm.num_used_blocks == 2
    bm.allocate("b", 0)
    assert not bm.append_slot("b", 1)


def test_capacity_counts_own_and_free_blocks():
    bm = KVBlockManager(num_blocks=5, block_size=4)
    bm.allocate("a", 6)
    assert bm.capacity("a") == 20 and bm.capacity("b") == 12
