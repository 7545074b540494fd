"""cache.segmented_lru: reused prefixes outlive entries cached once (RadixCache with ``protected_share``);
exact eviction and demotion order. The randomized comparison with a brute-force model is
tests/cache/test_cache_model.py (the Segmented machines)."""

import pytest

from cache import RadixCache
from cache.segmented_lru import SERVING_PROTECTED_SHARE, SegmentedLru


def cached(radix, sequences):
    return [radix.match(seq, touch=False).num_tokens for seq in sequences]


def test_a_reused_prefix_outlives_newer_entries_cached_once():
    for share, expected in ((0.0, [0, 3, 3, 3]), (0.5, [3, 0, 3, 3])):
        r = RadixCache(9, block_size=4, protected_share=share)
        r.insert([1, 1, 1])
        r.match([1, 1])  # reused: protected (with a protected segment)
        r.insert([2, 2, 2])
        r.insert([3, 3, 3])  # full; LRU order 1, 2, 3
        assert r.insert([4, 4, 4]) == 3
        # plain LRU evicts the reused [1, 1, 1], the oldest; segmented LRU the one-off [2, 2, 2]
        assert cached(r, [[1, 1, 1], [2, 2, 2], [3, 3, 3], [4, 4, 4]]) == expected
        assert r.num_protected_tokens == (3 if share else 0)
        r.check_invariants()


def test_protected_entries_go_last_and_least_recent_first():
    r = RadixCache(9, block_size=4, protected_share=1.0)
    for seq in ([1, 1, 1], [2, 2, 2], [3, 3, 3]):
        r.insert(seq)
    r.match([2, 2])
    r.match([1, 1])  # protected, least recent first: 2, then 1; unprotected: 3
    assert r.insert([4, 4, 4]) == 3  # evicts 3
    assert r.insert([5, 5, 5]) == 3  # the unprotected 4 went in after it and goes first
    assert cached(r, [[1, 1, 1], [2, 2, 2], [3, 3, 3], [4, 4, 4], [5, 5, 5]]) == [3, 3, 0, 0, 3]
    assert r.insert([6, 6, 6, 6, 6, 6]) == 6  # 5 (unprotected), then the protected 2
    assert cached(r, [[1, 1, 1], [2, 2, 2], [5, 5, 5], [6] * 6]) == [3, 0, 0, 6]
    assert r.num_protected_tokens == 3
    r.check_invariants()


def test_the_protected_segment_demotes_its_least_recent_entries_beyond_its_share():
    r = RadixCache(12, block_size=4, protected_share=0.5)  # at most 6 protected positions
    for seq in ([1, 1, 1], [2, 2, 2], [3, 3, 3]):
        r.insert(seq)
    r.match([1, 1])
    r.match([2, 2])
    assert r.num_protected_tokens == 6
    r.match([3, 3])  # 9 > 6: [1, 1, 1], the least recently used protected entry, is demoted
    assert r.num_protected_tokens == 6
    r.insert([4, 4, 4])  # full now
    assert r.insert([5, 5, 5]) == 3  # unprotected: the demoted 1 (older) before 4
    assert cached(r, [[1, 1, 1], [2, 2, 2], [3, 3, 3], [4, 4, 4], [5, 5, 5]]) == [0, 3, 3, 3, 3]
    r.check_invariants()


def test_of_a_path_touched_at_once_the_deepest_protected_node_is_demoted_first():
    r = RadixCache(20, block_size=4, protected_share=0.25)  # 5 protected positions
    r.insert([1, 2, 3, 4])
    r.insert([1, 2, 3, 5])  # split: [1, 2, 3] -> [4], [5]
    r.match([1, 2, 3, 4])  # protects [1, 2, 3] and [4]: 4 positions
    r.match([9])  # a miss: nothing changes
    r.insert([7, 7])
    r.match([7, 7])  # 6 > 5: [4] and [1, 2, 3] share an access time, older than [7, 7]: [4] goes first
    assert r.num_protected_tokens == 5
    assert r.evict(1) == 1  # the unprotected leaves, least recent first: [5], then the demoted [4]
    assert r.evict(1) == 1
    assert cached(r, [[1, 2, 3, 4], [1, 2, 3, 5], [7, 7]]) == [3, 3, 2]
    assert r.evict(1) == 3  # only protected leaves are left: [1, 2, 3] (touched with [4]) before [7, 7]
    assert cached(r, [[1, 2, 3], [7, 7]]) == [0, 2]
    r.check_invariants()


def test_a_split_keeps_protection_on_the_shared_upper_half_only():
    r = RadixCache(20, block_size=4, protected_share=1.0)
    r.insert([1, 2, 3, 4, 5, 6])
    r.match([1, 2, 3, 9])  # stops inside the edge: the whole edge is protected
    assert r.num_protected_tokens == 6
    r.insert([1, 2, 3, 7, 7])  # splits it: [1, 2, 3] stays protected, [4, 5, 6] is not what was shared
    assert r.num_protected_tokens == 3
    r.insert([8] * 10)  # 16 of 20
    assert r.insert([9] * 6) == 6  # evicts the unprotected, least recent first: [4, 5, 6], then [7, 7]
    assert cached(r, [[1, 2, 3, 4], [1, 2, 3, 7], [8] * 10, [9] * 6]) == [3, 3, 10, 6]
    r.check_invariants()


def test_share_zero_is_plain_lru_and_protects_nothing():
    lru, slru0 = RadixCache(12, block_size=4), RadixCache(12, block_size=4, protected_share=0.0)
    for r in (lru, slru0):
        for seq in ([1, 1, 1], [2, 2, 2], [3, 3, 3], [4, 4, 4]):
            r.insert(seq)
        r.match([1, 1])
        r.insert([5, 5, 5])
        r.insert([6, 6, 6, 6, 6])
        assert r.num_protected_tokens == 0
    probes = [[k] * 5 for k in range(1, 7)]
    assert cached(lru, probes) == cached(slru0, probes) == [3, 0, 0, 0, 3, 5]


def test_a_pure_read_protects_nothing():
    r = RadixCache(10, block_size=4, protected_share=1.0)
    r.insert([1, 1, 1])
    r.match([1, 1], touch=False)
    assert r.num_protected_tokens == 0


@pytest.mark.parametrize("share", [-0.1, 1.5, True, "0.8", None])
def test_a_protected_share_outside_zero_to_one_is_refused(share):
    with pytest.raises(ValueError, match="protected_share must be within"):
        RadixCache(10, protected_share=share)


def test_segmented_lru_validates_its_target_and_capacity():
    with pytest.raises(ValueError, match="protected_target must be an int within"):
        SegmentedLru(lambda item: True, -1, 10)
    with pytest.raises(ValueError, match="protected_target must be an int within"):
        SegmentedLru(lambda item: True, 11, 10)
    with pytest.raises(ValueError, match="capacity must be a non-negative int"):
        SegmentedLru(lambda item: True, 0, -1)
    assert 0.0 < SERVING_PROTECTED_SHARE < 1.0


def test_a_one_off_entry_missed_after_its_eviction_shrinks_the_protected_target():
    r = RadixCache(9, block_size=4, protected_share=0.5)
    assert r.protected_target_tokens == 4
    for seq in ([1, 1, 1], [2, 2, 2], [3, 3, 3], [4, 4, 4]):
        r.insert(seq)  # the last one evicts [1, 1, 1], never reused: a one-off ghost of 3 positions
    assert r.match([1, 1, 1]).num_tokens == 0  # missed where that ghost is: protect less
    assert r.protected_target_tokens == 1
    assert r.match([1, 1, 1]).num_tokens == 0  # a ghost counts once
    assert r.protected_target_tokens == 1
    r.check_invariants()


def test_a_reused_entry_missed_after_its_eviction_grows_the_protected_target():
    r = RadixCache(9, block_size=4, protected_share=1 / 3)  # 3 positions protected
    r.insert([1, 1, 1])
    r.match([1, 1])  # protected
    r.insert([2, 2, 2])
    r.insert([3, 3, 3])
    r.match([2, 2])  # protected too: 6 > 3, so [1, 1, 1] (least recent) is demoted
    r.insert([4, 4, 4])  # evicts the demoted [1, 1, 1]: a reused ghost
    assert r.match([1, 1, 1]).num_tokens == 0
    assert r.protected_target_tokens == 6  # up by its 3 positions
    r.match([4, 4])  # now [2, 2, 2] and [4, 4, 4] both fit the segment
    assert r.num_protected_tokens == 6
    r.check_invariants()


def test_ghosts_hold_at_most_the_budget_and_plain_lru_keeps_none():
    r = RadixCache(6, block_size=4, protected_share=0.5)
    for first in range(1, 8):
        r.insert([first] * 3)  # 5 evictions of 3 positions: only the last 2 ghosts fit 6 positions
    assert r.num_ghost_tokens == (6, 0)
    assert r.match([1, 1, 1]).num_tokens == 0  # its ghost was dropped: nothing moves
    assert r.protected_target_tokens == 3
    assert r.match([5, 5, 5]).num_tokens == 0  # still remembered
    assert r.protected_target_tokens == 0
    lru = RadixCache(6, block_size=4)
    for first in range(1, 8):
        lru.insert([first] * 3)
    assert lru.num_ghost_tokens == (0, 0) and lru.protected_target_tokens == 0
    r.check_invariants()


def test_a_copy_is_protected_only_by_its_second_reuse():
    r = RadixCache(20, block_size=4, protected_share=1.0)
    r.insert([7, 7, 7])
    r.match([7, 7])  # an ordinary entry: protected by its first reuse
    r.insert([1, 2, 3, 4, 5, 6], is_copy=True)  # imported KV, held by another cache too
    r.match([1, 2, 3, 4, 9])  # the request it was imported for
    assert r.num_protected_tokens == 3
    r.insert([8] * 8)
    assert r.insert([9] * 4) == 4  # full: the copy, used after [7, 7, 7], goes first all the same
    assert cached(r, [[1, 2, 3, 4], [7, 7, 7], [8] * 8, [9] * 4]) == [0, 3, 8, 4]
    r.insert([1, 2, 3, 4, 5, 6], is_copy=True)
    r.match([1, 2, 3, 9])
    r.match([1, 2, 3, 9])  # a second reuse here: protected like any reused prefix
    assert r.num_protected_tokens == 3 + 6
    r.check_invariants()
