"""cache.radix.RadixCache: exact match lengths and blocks, splits, LRU order, locks, budget, salts, stats."""

import pytest

from cache import BlockAllocator, RadixCache


def shape(radix, salt=None):
    """The tree of one namespace as nested tuples: (edge tokens, start, block ids, lock_ref, children),
    children in first-token order; None for a namespace the tree does not hold."""
    key = salt.encode() if isinstance(salt, str) else salt
    edges = [e for e in radix.edges() if e.namespace == key]
    if not edges and key not in namespaces(radix):
        return None

    def build(index):
        edge = edges[index]
        children, child = [], index + 1
        while child < len(edges) and edges[child].depth > edge.depth:
            if edges[child].depth == edge.depth + 1:
                children.append(build(child))
            child += 1
        return (edge.tokens, edge.start, edge.block_ids, edge.num_locks, tuple(sorted(children)))

    return tuple(sorted(build(i) for i, e in enumerate(edges) if e.depth == 0))


def namespaces(radix):
    return {e.namespace for e in radix.edges()}


def cached(radix, sequences, salt=None):
    """Longest cached prefix of each sequence, read without touching."""
    return [radix.match(s, salt, touch=False).num_tokens for s in sequences]


class Writer:
    """A sequence-owning fake engine: allocates and writes a sequence, then caches it."""

    def __init__(self, num_blocks=64, block_size=4, budget_tokens=1000):
        self.allocator = BlockAllocator(num_blocks, block_size)
        self.radix = RadixCache(budget_tokens, block_size, self.allocator)

    def cache(self, seq_id, tokens, salt=None):
        self.allocator.allocate(seq_id, len(tokens))
        num_new = self.radix.insert(tokens, self.allocator.block_table(seq_id), salt)
        table = self.allocator.block_table(seq_id)
        self.allocator.free(seq_id)
        self.radix.check_invariants()
        self.allocator.check_invariants()
        return num_new, table


# ------------------------------------------------------------------ matching
def test_match_lengths_simulated():
    r = RadixCache(100, block_size=4)
    assert r.match([1, 2, 3]).num_tokens == 0  # empty cache, unknown namespace
    assert r.insert([1, 2, 3, 4, 5]) == 5
    assert r.match([1, 2, 3, 4, 5]).num_tokens == 5
    assert r.match([1, 2, 3, 4, 5, 6, 7]).num_tokens == 5
    assert r.match([1, 2, 3, 9]).num_tokens == 3  # ends inside the edge
    assert r.match([1]).num_tokens == 1
    assert r.match([2, 1]).num_tokens == 0
    assert r.match([]).num_tokens == 0
    assert r.match((1, 2)).num_tokens == 2  # any sequence of ints
    assert r.match([1, 2, 3]).block_ids == ()  # simulated: no blocks
    r.check_invariants()


def test_insert_splits_the_edge_where_a_sequence_leaves_it():
    r = RadixCache(100, block_size=4)
    r.insert([1, 2, 3, 4, 5])
    assert shape(r) == (((1, 2, 3, 4, 5), 0, (), 0, ()),)
    assert r.insert([1, 2, 3, 7, 8]) == 2
    assert shape(r) == (((1, 2, 3), 0, (), 0, (((4, 5), 3, (), 0, ()), ((7, 8), 3, (), 0, ()))),)
    assert r.num_tokens == 7
    # a prefix that ends inside an edge is already cached: no split, nothing new
    assert r.insert([1, 2, 3, 4]) == 0
    assert r.insert([1, 2]) == 0
    assert shape(r)[0][0] == (1, 2, 3)
    # extending a leaf adds a child, no split
    assert r.insert([1, 2, 3, 4, 5, 6]) == 1
    assert shape(r) == (
        ((1, 2, 3), 0, (), 0, (((4, 5), 3, (), 0, (((6,), 5, (), 0, ()),)), ((7, 8), 3, (), 0, ()))),
    )
    assert cached(r, [[1, 2, 3, 4, 5, 6, 0], [1, 2, 3, 7, 8, 9], [1, 2, 3, 0]]) == [6, 5, 3]
    r.check_invariants()


def test_match_blocks_follow_the_partial_last_block_rule():
    w = Writer(block_size=4)
    a = list(range(10))  # blocks 0 [0..3], 1 [4..7], 2 [8, 9]
    assert w.cache("a", a) == (10, [0, 1, 2])
    r = w.radix
    assert r.match(a).block_ids == (0, 1, 2)
    assert r.match(a[:8]).block_ids == (0, 1)  # two full blocks
    assert r.match(a[:6]).block_ids == (0, 1)  # block 1 partly matched: the last id, to copy
    assert r.match(a[:6] + [99]).num_tokens == 6
    assert r.match(a[:1]).block_ids == (0,)
    assert r.match(a + [1, 2, 3]).block_ids == (0, 1, 2)
    assert w.allocator.retained_count(0) == w.allocator.retained_count(2) == 1
    assert [w.allocator.ref_count(b) for b in range(4)] == [1, 1, 1, 0]  # held by the tree alone


def test_split_mid_block_shares_the_straddling_block_and_later_nodes_win():
    w = Writer(block_size=4)
    a = list(range(10))
    w.cache("a", a)  # blocks [0, 1, 2], freed to the tree
    r, alloc = w.radix, w.allocator
    hit = r.match(a[:6] + [50, 51, 52, 53])
    assert (hit.num_tokens, hit.block_ids) == (6, (0, 1))
    b = a[:6] + [50, 51, 52, 53]
    # the engine starts b from the cached prefix: full block 0 shared, block 1 copied
    assert alloc.allocate_with_prefix("b", 10, hit.block_ids, 6) == (1, 3)
    assert alloc.block_table("b") == [0, 3, 4]
    assert r.insert(b, alloc.block_table("b")) == 4
    alloc.free("b")
    assert shape(r) == (
        (
            (0, 1, 2, 3, 4, 5), 0, (0, 1), 0,
            (
                ((6, 7, 8, 9), 6, (1, 2), 0, ()),  # keeps block 1: it straddles the cut
                ((50, 51, 52, 53), 6, (3, 4), 0, ()),
            ),
        ),
    )
    assert [alloc.retained_count(x) for x in range(5)] == [1, 2, 1, 1, 1]
    # each block of a match comes from the deepest node that covers it
    assert r.match(b).block_ids == (0, 3, 4)
    assert r.match(b[:7]).block_ids == (0, 3)
    assert r.match(a).block_ids == (0, 1, 2)
    assert r.match(a[:6]).block_ids == (0, 1)
    r.check_invariants()
    alloc.check_invariants()


def test_insert_retains_only_the_new_suffix_blocks():
    w = Writer(block_size=2)
    w.cache("a", [1, 2, 3, 4])  # blocks [0, 1]
    alloc = w.allocator
    alloc.allocate("b", 6)  # fresh blocks [2, 3, 4]; tokens 1..4 recomputed, 5, 6 new
    assert w.radix.insert([1, 2, 3, 4, 5, 6], alloc.block_table("b")) == 2
    assert [alloc.retained_count(x) for x in range(5)] == [1, 1, 0, 0, 1]
    assert w.radix.match([1, 2, 3, 4, 5, 6]).block_ids == (0, 1, 4)


# ------------------------------------------------------------------ eviction
def test_lru_eviction_order_is_exact():
    r = RadixCache(12, block_size=4)
    for seq in ([1, 1, 1], [2, 2, 2], [3, 3, 3], [4, 4, 4]):
        r.insert(seq)
    assert r.num_tokens == 12
    r.match([1, 1])  # refreshes [1, 1, 1]: LRU order is now 2, 3, 4, 1
    assert r.insert([5, 5, 5]) == 3
    assert cached(r, [[1, 1, 1], [2, 2, 2], [3, 3, 3], [4, 4, 4], [5, 5, 5]]) == [3, 0, 3, 3, 3]
    assert r.insert([6, 6, 6, 6, 6]) == 5  # needs two leaves: 3 then 4
    assert cached(r, [[1, 1, 1], [3, 3, 3], [4, 4, 4], [5, 5, 5], [6] * 5]) == [3, 0, 0, 3, 5]
    assert (r.stats.evictions, r.stats.evicted_tokens) == (3, 9)
    assert r.num_tokens == 11
    r.check_invariants()


def test_a_parent_left_childless_becomes_a_leaf_candidate():
    r = RadixCache(10, block_size=4)
    r.insert([1, 2, 3, 4])
    r.insert([1, 2, 3, 5])  # split: [1,2,3] -> [4], [5]
    r.insert([7, 7])
    r.match([7, 7])  # LRU: [4], [5] (and their parent) before [7, 7]
    assert r.evict(1) == 1
    assert cached(r, [[1, 2, 3, 4], [1, 2, 3, 5], [7, 7]]) == [3, 4, 2]
    assert r.evict(1) == 1  # [5]
    assert r.evict(1) == 3  # then the parent [1, 2, 3], now a leaf, before [7, 7]
    assert cached(r, [[1, 2, 3, 5], [7, 7]]) == [0, 2]
    assert r.evict(100) == 2 and r.num_tokens == 0
    assert r.evict(1) == 0
    r.check_invariants()


def test_eviction_is_lru_by_injected_clock():
    now = [0.0]
    r = RadixCache(6, block_size=4, clock=lambda: now[0])
    for t, seq in ((5.0, [1, 1]), (1.0, [2, 2]), (3.0, [3, 3])):
        now[0] = t
        r.insert(seq)
    now[0] = 9.0
    r.insert([4, 4])  # evicts the oldest by clock: [2, 2] (t=1)
    assert cached(r, [[1, 1], [2, 2], [3, 3], [4, 4]]) == [2, 0, 2, 2]
    r.insert([5, 5])  # then [3, 3] (t=3)
    assert cached(r, [[1, 1], [3, 3], [5, 5]]) == [2, 0, 2]


def test_a_sequence_longer_than_the_budget_is_not_cached_and_evicts_nothing():
    r = RadixCache(8, block_size=4)
    r.insert([1] * 4)
    r.insert([2] * 4)
    before = shape(r)
    assert r.insert([3] * 9) == 0
    assert shape(r) == before and r.num_tokens == 8
    assert r.stats.evictions == 0 and r.stats.inserted_tokens == 8
    assert r.insert([3] * 8) == 8  # exactly the budget fits, after evicting both
    assert r.stats.evictions == 2


def test_budget_zero_caches_nothing():
    r = RadixCache(0, block_size=4)
    assert r.insert([1]) == 0 and r.num_tokens == 0 and r.match([1]).num_tokens == 0


def test_insert_blocked_by_locks_changes_nothing():
    r = RadixCache(10, block_size=4)
    r.insert([1] * 6)
    held = r.match([1] * 6)
    r.lock(held)
    r.insert([2, 2])  # unlocked, evictable
    before = (shape(r), r.num_tokens, r.stats)
    # 5 new positions: 6 locked + 5 > 10, so evicting [2, 2] would not help: nothing changes
    assert r.insert([3] * 5) == 0
    assert (shape(r), r.num_tokens, r.stats) == before
    # a split that cannot be followed by an insert does not happen either
    assert r.insert([1] * 3 + [9] * 5) == 0
    assert shape(r) == before[0]
    # 4 new fit once [2, 2] goes
    assert r.insert([3] * 4) == 4
    assert cached(r, [[1] * 6, [2, 2], [3] * 4]) == [6, 0, 4]
    r.check_invariants()


def test_the_cached_prefix_of_an_insert_is_pinned_while_making_room():
    r = RadixCache(8, block_size=4)
    r.insert([1, 2, 3, 4])
    r.insert([9, 9, 9, 9])
    r.match([9, 9])  # [1, 2, 3, 4] is now LRU
    # extending [1,2,3,4] needs 4 positions: [1,2,3,4] is the path, so [9,9,9,9] goes
    assert r.insert([1, 2, 3, 4, 5, 6, 7, 8]) == 4
    assert cached(r, [[1, 2, 3, 4, 5, 6, 7, 8], [9] * 4]) == [8, 0]
    # a split node's lower half is not on the path and can be evicted
    r2 = RadixCache(6, block_size=4)
    r2.insert([1, 2, 3, 4, 5])
    assert r2.insert([1, 2, 7, 7]) == 2 and r2.num_tokens == 4  # evicted [3, 4, 5]
    assert cached(r2, [[1, 2, 3], [1, 2, 7, 7]]) == [2, 4]
    r2.check_invariants()


# ------------------------------------------------------------------ locks
def test_lock_pins_node_and_ancestors_and_unlock_releases():
    r = RadixCache(9, block_size=4)
    r.insert([1, 2, 3])
    r.insert([1, 2, 4])  # [1,2] -> [3], [4]
    r.insert([5, 5, 5])
    held = r.match([1, 2, 3])
    r.lock(held)
    r.lock(held)  # counted
    assert [n[3] for n in shape(r)] == [2, 0] and shape(r)[0][4][0][3] == 2  # [1,2] and [3] locked twice
    assert r.num_locked_tokens == 3
    assert r.clear() == 4  # [4] and [5,5,5]
    assert cached(r, [[1, 2, 3], [1, 2, 4], [5, 5, 5]]) == [3, 2, 0]
    r.unlock(held)
    assert r.clear() == 0 and r.num_locked_tokens == 3
    r.unlock(held)
    assert r.num_locked_tokens == 0
    assert r.clear() == 3 and r.num_tokens == 0
    r.check_invariants()
    with pytest.raises(ValueError, match="unlock of a node that is not locked"):
        r.unlock(held)


def test_a_lock_on_a_node_survives_a_split_of_it():
    r = RadixCache(100, block_size=4)
    r.insert([1, 2, 3, 4])
    held = r.match([1, 2, 3, 4])
    r.lock(held)
    r.insert([1, 2, 9])  # splits the locked node: both halves stay locked
    assert r.num_locked_tokens == 4
    assert r.clear() == 1  # only [9]
    r.unlock(held)
    assert r.clear() == 4
    r.check_invariants()


def test_lock_of_an_evicted_node_raises():
    r = RadixCache(100, block_size=4)
    r.insert([1, 2])
    stale = r.match([1, 2])
    r.clear()
    with pytest.raises(ValueError, match="lock of a node that was evicted"):
        r.lock(stale)
    r.check_invariants()


def test_a_miss_returns_a_root_that_is_harmless_to_lock():
    r = RadixCache(100, block_size=4)
    miss = r.match([1, 2], salt="new")  # unknown namespace: nothing created
    assert miss.num_tokens == 0 and r.num_namespaces == 0
    r.lock(miss)
    r.unlock(miss)
    r.insert([1, 2])
    miss = r.match([3])
    r.lock(miss)
    assert r.clear() == 2
    r.unlock(miss)
    r.check_invariants()


# ------------------------------------------------------------------ namespaces
def test_salts_never_share_entries():
    w = Writer(block_size=2)
    w.cache("a", [1, 2, 3, 4], salt="tenant-a")
    r = w.radix
    assert r.match([1, 2, 3, 4]).num_tokens == 0
    assert r.match([1, 2, 3, 4], salt="tenant-b").num_tokens == 0
    assert r.match([1, 2, 3, 4], salt="tenant-a").num_tokens == 4
    assert r.match([1, 2, 3, 4], salt=b"tenant-a").num_tokens == 4  # str and bytes: one salt
    assert w.cache("b", [1, 2, 3, 4])[0] == 4  # the unsalted copy is cached separately
    assert r.num_tokens == 8
    assert r.match([1, 2, 3, 4]).block_ids != r.match([1, 2, 3, 4], salt="tenant-a").block_ids
    # the budget is shared across namespaces
    small = RadixCache(4, block_size=2)
    small.insert([1, 2, 3], salt="x")
    small.insert([1, 2, 3], salt="y")
    assert cached(small, [[1, 2, 3]], salt="x") == [0] and cached(small, [[1, 2, 3]], salt="y") == [3]


# ------------------------------------------------------------------ stats, modes
def test_stats_count_lookups_and_evictions():
    r = RadixCache(6, block_size=4)
    r.match([1, 2])  # miss
    r.insert([1, 2, 3])
    r.match([1, 2, 9])  # hit, 2
    r.match([1, 2, 3, 4])  # hit, 3
    r.match([7])  # miss
    r.match([1], touch=False)  # not counted
    r.insert([4, 4, 4])
    r.insert([5, 5])  # evicts [1, 2, 3]
    s = r.stats
    assert (s.hits, s.misses, s.tokens_saved) == (2, 2, 5)
    assert (s.inserted_tokens, s.evictions, s.evicted_tokens) == (8, 1, 3)
    assert r.num_tokens == 5


def test_simulated_and_real_mode_agree():
    ops = [
        ("insert", [1, 2, 3, 4, 5, 6]), ("insert", [1, 2, 3, 9, 9]), ("match", [1, 2, 3, 9]),
        ("insert", [7] * 5), ("match", [1, 2, 3, 4, 5, 6, 7]), ("insert", [1, 2, 8, 8, 8]),
        ("insert", [6] * 7), ("match", [1, 2, 3, 9, 9]), ("match", [7, 7]),
    ]
    sim = RadixCache(14, block_size=4)
    w = Writer(num_blocks=64, block_size=4, budget_tokens=14)
    for i, (op, tokens) in enumerate(ops):
        if op == "insert":
            assert sim.insert(tokens) == w.cache(i, tokens)[0]
        else:
            m_sim, m_real = sim.match(tokens), w.radix.match(tokens)
            assert m_sim.num_tokens == m_real.num_tokens
            assert len(m_real.block_ids) == -(-m_real.num_tokens // 4) and m_sim.block_ids == ()
        assert sim.num_tokens == w.radix.num_tokens
        assert sim.stats == w.radix.stats
        sim.check_invariants()
    assert sim.is_simulated and not w.radix.is_simulated


# ------------------------------------------------------------------ bad input
def test_bad_construction():
    with pytest.raises(ValueError, match="budget_tokens must be a non-negative int, got -1"):
        RadixCache(-1)
    with pytest.raises(ValueError, match="budget_tokens must be a non-negative int, got 1.5"):
        RadixCache(1.5)
    with pytest.raises(ValueError, match="block_size must be a positive int, got 0"):
        RadixCache(10, block_size=0)
    with pytest.raises(ValueError, match="allocator block_size 8 != block_size 16"):
        RadixCache(10, 16, BlockAllocator(4, 8))


def test_bad_calls_raise_and_change_nothing():
    w = Writer(num_blocks=8, block_size=2, budget_tokens=100)
    w.cache("a", [1, 2, 3])
    r, alloc = w.radix, w.allocator
    alloc.allocate("live", 4)  # blocks held by a sequence
    table = alloc.block_table("live")
    before = (shape(r), r.num_tokens, r.stats, [alloc.ref_count(b) for b in range(8)])
    cases = [
        (TypeError, r"token 1 is 2.0", lambda: r.match([1, 2.0])),
        (TypeError, r"token 0 is True", lambda: r.insert([True, 2], table)),
        (TypeError, r"token 2 is '3'", lambda: r.match([1, 2, "3"])),
        (TypeError, r"salt must be str, bytes or None, got 7", lambda: r.match([1], salt=7)),
        (TypeError, r"salt must be str, bytes or None, got \[1\]", lambda: r.insert([9, 9], table, salt=[1])),
        (ValueError, r"4 tokens need 2 block ids, got none", lambda: r.insert([5, 6, 7, 8])),
        (ValueError, r"4 tokens need 2 block ids, got 1", lambda: r.insert([5, 6, 7, 8], table[:1])),
        (ValueError, r"insert names free block 7", lambda: r.insert([5, 6, 7, 8], [table[0], 7])),
        (ValueError, r"block id 99 is not in", lambda: r.insert([5, 6], [99])),
        (ValueError, r"simulated RadixCache takes no block_ids", lambda: RadixCache(9).insert([1], [0])),
    ]
    for error, message, call in cases:
        with pytest.raises(error, match=message):
            call()
        assert (shape(r), r.num_tokens, r.stats, [alloc.ref_count(b) for b in range(8)]) == before, message
    r.check_invariants()


# ------------------------------------------------------------------ traversal
def test_edges_walk_every_node_depth_first_without_touching():
    w = Writer(block_size=4)
    w.cache("a", [1, 2, 3, 4, 5, 6], salt="t")
    w.cache("b", [1, 2, 3, 9])
    w.cache("c", [1, 2, 7, 7])
    r = w.radix
    held = r.match([1, 2, 3, 9])
    r.lock(held)
    stats, lru_before = (r.stats.hits, r.stats.misses), r.match([1, 2, 7, 7], touch=False)
    edges = [(e.namespace, e.depth, e.start, e.tokens, e.block_ids, e.num_locks) for e in r.edges()]
    assert edges == [
        (b"t", 0, 0, (1, 2, 3, 4, 5, 6), (0, 1), 0),
        (None, 0, 0, (1, 2), (2,), 1),  # split: [1, 2] -> [3, 9], [7, 7]; block 2 straddles
        (None, 1, 2, (3, 9), (2,), 1),
        (None, 1, 2, (7, 7), (3,), 0),
    ]
    assert len(edges) == r.num_nodes and r.num_namespaces == 2
    assert (r.stats.hits, r.stats.misses) == stats and r.match([1, 2, 7, 7], touch=False) == lru_before
    r.unlock(held)
    r.check_invariants()
