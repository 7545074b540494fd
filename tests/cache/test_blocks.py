"""cache.blocks.BlockAllocator: exact block ids, free-list order, ref counts, copy-on-write."""

import copy

import pytest

from cache import BlockAllocator, OutOfBlocks


def snapshot(allocator):
    """Everything the allocator holds, deep-copied: equal snapshots mean equal state."""
    return copy.deepcopy(vars(allocator))


def ref_counts(allocator):
    return [allocator.ref_count(b) for b in range(allocator.num_blocks)]


def free_order(allocator):
    """The free list, front first, read through the public API on a copy."""
    probe = copy.deepcopy(allocator)
    return probe.allocate("__probe__", probe.num_free_blocks * probe.block_size)


def test_fresh_allocator_hands_out_blocks_in_order():
    a = BlockAllocator(8, 4)
    assert a.num_free_blocks == 8
    assert a.allocate("x", 5) == [0, 1]
    assert a.allocate("y", 4) == [2]
    assert a.allocate("z", 0) == []
    assert a.block_table("x") == [0, 1] and a.num_tokens("x") == 5
    assert a.block_table("z") == [] and a.num_tokens("z") == 0
    assert ref_counts(a) == [1, 1, 1, 0, 0, 0, 0, 0]
    assert a.num_free_blocks == 5
    assert free_order(a) == [3, 4, 5, 6, 7]
    a.check_invariants()


def test_freed_blocks_go_to_the_back_in_reverse_table_order():
    a = BlockAllocator(6, 2)
    a.allocate("x", 5)  # [0, 1, 2]
    a.allocate("y", 2)  # [3]
    a.free("x")
    assert free_order(a) == [4, 5, 2, 1, 0]
    assert a.allocate("z", 6) == [4, 5, 2]
    assert "x" not in a and "z" in a
    a.check_invariants()


def test_block_table_is_a_copy():
    a = BlockAllocator(4, 2)
    a.allocate("x", 3)
    a.block_table("x").append(99)
    assert a.block_table("x") == [0, 1]


def test_append_fills_the_last_block_then_takes_a_new_one():
    a = BlockAllocator(4, 2)
    a.allocate("x", 1)  # [0], 1 of 2 slots
    assert a.append("x") is None and a.block_table("x") == [0] and a.num_tokens("x") == 2
    assert a.append("x") is None and a.block_table("x") == [0, 1] and a.num_tokens("x") == 3
    a.allocate("e", 0)
    assert a.append("e") is None and a.block_table("e") == [2]
    a.check_invariants()


def test_seed_002_fork_then_first_append_copies_later_appends_do_not():
    a = BlockAllocator(8, 4)
    assert a.allocate("parent", 6) == [0, 1]  # block 1 holds 2 of 4
    a.fork("parent", "child")
    assert a.block_table("child") == [0, 1]
    assert ref_counts(a)[:3] == [2, 2, 0]
    assert a.num_free_blocks == 6  # fork copies nothing

    # first write into the shared, partly filled block: copy-on-write
    assert a.append("child") == (1, 2)
    assert a.block_table("child") == [0, 2] and a.block_table("parent") == [0, 1]
    assert ref_counts(a)[:3] == [2, 1, 1]
    # later appends write the private copy in place
    assert a.append("child") is None
    assert a.block_table("child") == [0, 2] and a.num_tokens("child") == 8
    # the parent's block is now its own: no copy either
    assert a.append("parent") is None and a.block_table("parent") == [0, 1]
    # crossing into a new block takes a fresh one, never a copy
    assert a.append("child") is None and a.block_table("child") == [0, 2, 3]
    a.check_invariants()

    # fragmentation of partly filled blocks: blocks 0 (4/4, shared, counted once),
    # 1 (parent, 3/4), 2 (child, 4/4), 3 (child, 1/4)
    assert a.fragmentation() == {
        "allocated_slots": 16,
        "used_slots": 12,
        "wasted_slots": 4,
        "wasted_fraction": 0.25,
    }


def test_fork_at_a_block_boundary_needs_no_copy():
    a = BlockAllocator(4, 2)
    a.allocate("p", 4)
    a.fork("p", "c")
    assert a.append("c") is None and a.block_table("c") == [0, 1, 2]
    assert ref_counts(a) == [2, 2, 1, 0]


def test_free_of_a_fork_keeps_the_shared_blocks():
    a = BlockAllocator(4, 2)
    a.allocate("p", 3)
    a.fork("p", "c")
    a.free("p")
    assert ref_counts(a) == [1, 1, 0, 0] and a.block_table("c") == [0, 1]
    a.free("c")
    assert a.num_free_blocks == 4 and free_order(a) == [2, 3, 1, 0]
    a.check_invariants()


def test_fragmentation_counts_shared_blocks_once_at_their_fullest():
    a = BlockAllocator(8, 4)
    assert a.fragmentation() == {"allocated_slots": 0, "used_slots": 0, "wasted_slots": 0, "wasted_fraction": 0.0}
    a.allocate("x", 5)  # [0 full, 1 with 1]
    a.fork("x", "y")
    assert a.fragmentation()["allocated_slots"] == 8
    assert a.fragmentation()["used_slots"] == 5
    a.allocate("z", 9)  # [2, 3 full, 4 with 1]
    f = a.fragmentation()
    assert (f["allocated_slots"], f["used_slots"], f["wasted_slots"]) == (20, 14, 6)
    assert f["wasted_fraction"] == pytest.approx(6 / 20)
    # blocks held only by retain are not any sequence's: not counted
    a.retain(4)
    a.free("z")
    assert a.fragmentation()["allocated_slots"] == 8


def test_retain_and_release_take_extra_references():
    a = BlockAllocator(4, 2)
    a.allocate("x", 4)  # [0, 1]
    a.retain(1)
    a.retain(1)
    assert a.ref_count(1) == 3 and a.retained_count(1) == 2 and a.retained_count(0) == 0
    a.free("x")
    assert ref_counts(a) == [0, 2, 0, 0] and free_order(a) == [2, 3, 0]
    a.release(1)
    assert a.ref_count(1) == 1 and a.num_free_blocks == 3
    a.release(1)
    assert a.ref_count(1) == 0 and free_order(a) == [2, 3, 0, 1]
    a.check_invariants()


def test_a_retained_last_block_is_copied_before_a_write():
    a = BlockAllocator(4, 2)
    a.allocate("x", 3)  # [0, 1]; block 1 half full
    a.retain(1)  # e.g. the radix tree caches it
    assert a.append("x") == (1, 2)
    assert a.block_table("x") == [0, 2] and ref_counts(a) == [1, 1, 1, 0]
    assert a.retained_count(1) == 1


def test_allocate_with_prefix_shares_full_blocks_and_copies_a_partial_one():
    a = BlockAllocator(10, 4)
    a.allocate("donor", 10)  # [0, 1, 2]; block 2 holds 2
    # 10 cached tokens: blocks 0, 1 full (shared), block 2 partial (copied)
    assert a.allocate_with_prefix("s", 14, [0, 1, 2], 10) == (2, 3)
    assert a.block_table("s") == [0, 1, 3, 4] and a.num_tokens("s") == 14
    assert ref_counts(a)[:5] == [2, 2, 1, 1, 1]
    # an aligned prefix: nothing to copy
    assert a.allocate_with_prefix("t", 9, [0, 1], 8) is None
    assert a.block_table("t") == [0, 1, 5] and ref_counts(a)[:2] == [3, 3]
    # a whole prompt cached, ending mid-block: the copy is the last block
    assert a.allocate_with_prefix("u", 10, [0, 1, 2], 10) == (2, 6)
    assert a.block_table("u") == [0, 1, 6]
    # nothing cached
    assert a.allocate_with_prefix("v", 3, [], 0) is None and a.block_table("v") == [7]
    a.check_invariants()
    # the copied block is the sequence's own: appends write it in place
    assert a.append("u") is None and a.block_table("u") == [0, 1, 6]


def test_out_of_blocks_changes_nothing():
    a = BlockAllocator(4, 2)
    a.allocate("x", 5)  # [0, 1, 2], block 2 half full
    a.fork("x", "y")
    before = snapshot(a)
    with pytest.raises(OutOfBlocks, match="need 2 free blocks, have 1") as info:
        a.allocate("z", 4)
    assert (info.value.num_needed, info.value.num_free) == (2, 1)
    assert snapshot(a) == before and "z" not in a
    with pytest.raises(OutOfBlocks):
        a.allocate_with_prefix("z", 8, [0, 1], 4)  # needs 2 fresh
    assert snapshot(a) == before
    a.allocate("w", 2)  # takes the last free block
    before = snapshot(a)
    with pytest.raises(OutOfBlocks, match="need 1 free blocks, have 0"):
        a.append("x")  # copy-on-write needs a block
    assert snapshot(a) == before
    a.free("y")
    a.append("x")  # block 2 is x's alone now: in place
    before = snapshot(a)
    with pytest.raises(OutOfBlocks):
        a.append("x")  # x is at a block boundary and needs a fresh block
    assert snapshot(a) == before
    a.check_invariants()


@pytest.mark.parametrize("num_blocks, block_size", [(0, 4), (-1, 4), (4, 0), (4, -2), (2.0, 4), (4, True), ("4", 4)])
def test_bad_sizes_raise_value_error_naming_the_value(num_blocks, block_size):
    bad = num_blocks if not (type(num_blocks) is int and num_blocks > 0) else block_size
    with pytest.raises(ValueError, match=rf"got {bad!r}"):
        BlockAllocator(num_blocks, block_size)


def test_bad_calls_raise_naming_the_value_and_change_nothing():
    a = BlockAllocator(6, 2)
    a.allocate("x", 3)
    a.retain(0)
    before = snapshot(a)
    cases = [
        (KeyError, "unknown sequence id 'nope'", lambda: a.free("nope")),
        (KeyError, "unknown sequence id 'nope'", lambda: a.append("nope")),
        (KeyError, "unknown sequence id 'nope'", lambda: a.block_table("nope")),
        (KeyError, "unknown sequence id 'nope'", lambda: a.fork("nope", "c")),
        (ValueError, "sequence id 'x' already has blocks", lambda: a.allocate("x", 1)),
        (ValueError, "sequence id 'x' already has blocks", lambda: a.fork("x", "x")),
        (ValueError, "sequence id 'x' already has blocks", lambda: a.allocate_with_prefix("x", 2, [0], 2)),
        (ValueError, "num_tokens must be a non-negative int, got -1", lambda: a.allocate("n", -1)),
        (ValueError, "num_tokens must be a non-negative int, got 2.5", lambda: a.allocate("n", 2.5)),
        (ValueError, "num_tokens must be a non-negative int, got True", lambda: a.allocate("n", True)),
        (ValueError, "block 1 has no retained reference to release", lambda: a.release(1)),
        (ValueError, "block 3 has no retained reference to release", lambda: a.release(3)),
        (ValueError, "block 4 is free; retain only blocks someone holds", lambda: a.retain(4)),
        (ValueError, r"block id 6 is not in \[0, 6\)", lambda: a.ref_count(6)),
        (ValueError, r"block id -1 is not in \[0, 6\)", lambda: a.retain(-1)),
        (ValueError, r"block id '0' is not in \[0, 6\)", lambda: a.release("0")),
        (ValueError, "num_prefix_tokens 5 > num_tokens 4", lambda: a.allocate_with_prefix("n", 4, [0, 1, 2], 5)),
        (ValueError, "1 prefix blocks cannot hold exactly 3 tokens", lambda: a.allocate_with_prefix("n", 4, [0], 3)),
        (ValueError, "prefix block 5 is free", lambda: a.allocate_with_prefix("n", 4, [0, 5], 3)),
        (ValueError, r"block id 9 is not in \[0, 6\)", lambda: a.allocate_with_prefix("n", 4, [9], 1)),
    ]
    for error, message, call in cases:
        with pytest.raises(error, match=message):
            call()
        assert snapshot(a) == before, message
    a.check_invariants()


def test_double_free_raises_key_error():
    a = BlockAllocator(2, 2)
    a.allocate("x", 2)
    a.free("x")
    before = snapshot(a)
    with pytest.raises(KeyError, match="unknown sequence id 'x'"):
        a.free("x")
    assert snapshot(a) == before


def test_double_release_raises():
    a = BlockAllocator(2, 2)
    a.allocate("x", 2)
    a.retain(0)
    a.release(0)
    with pytest.raises(ValueError, match="block 0 has no retained reference"):
        a.release(0)
    assert a.ref_count(0) == 1


def test_can_allocate():
    a = BlockAllocator(3, 2)
    assert a.can_allocate(3) and not a.can_allocate(4)
    a.allocate("x", 3)
    assert a.can_allocate(1) and not a.can_allocate(2)
