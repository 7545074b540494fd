"""Bounded tenants: cache.namespaces and RadixCache's namespace life cycle.

An emptied namespace is dropped; at ``max_namespaces`` the least recently used
namespace with no lock is evicted whole; with every namespace locked a new one
is served uncached. Memory and the summary's walk are bounded by the budget and
the cap, not by how many salts were ever seen.
"""

import random
import time
import tracemalloc

import pytest

from cache import BlockAllocator, RadixCache
from cache.namespaces import Namespaces
from cache.radix_node import Root
from cache.summary import cached_block_hashes


def namespaces(radix):
    """Live namespaces holding entries, least recently used first."""
    out = []
    for edge in radix.edges():
        if edge.depth == 0 and edge.namespace not in out:
            out.append(edge.namespace)
    return out


def cached(radix, tokens, salt):
    return radix.match(tokens, salt, touch=False).num_tokens


# ------------------------------------------------------------------ the table
def test_table_orders_by_use_and_skips_locked_roots():
    table = Namespaces(3)
    a, b, c = Root(b"a"), Root(b"b"), Root(None)
    for root in (a, b, c):
        table.add(root)
    assert table.is_full and list(table) == [a, b, c]
    table.touch(a)
    assert list(table) == [b, c, a]
    b.lock_ref += 1  # a lock below b
    assert table.least_recent_unlocked() is c
    table.touch(Root(b"b"))  # not the live root of b"b": no effect
    assert list(table) == [b, c, a]
    table.drop(c)
    assert table.get(None) is None and not table.holds(c) and len(table) == 2
    assert table.least_recent_unlocked() is a
    a.lock_ref += 1
    assert table.least_recent_unlocked() is None


@pytest.mark.parametrize("bad", [0, -1, 1.0, None])
def test_table_needs_a_positive_cap(bad):
    with pytest.raises(ValueError, match=f"max_namespaces must be a positive int, got {bad!r}"):
        Namespaces(bad)
    with pytest.raises(ValueError, match="max_namespaces must be a positive int"):
        RadixCache(100, 4, max_namespaces=bad)


# ------------------------------------------------------------------ life cycle
def test_an_emptied_namespace_is_dropped():
    r = RadixCache(100, block_size=4)
    r.insert([1, 2, 3], salt="a")
    r.insert([1, 2, 4], salt="a")
    r.insert([5], salt="b")
    assert r.num_namespaces == 2 and namespaces(r) == [b"a", b"b"]
    r.evict(1)  # the LRU leaf [3]: "a" still holds [1, 2] -> [4]
    assert r.num_namespaces == 2
    assert r.evict(3) == 3  # [4], then [1, 2]: "a" is empty now
    assert r.num_namespaces == 1 and namespaces(r) == [b"b"]
    r.check_invariants()
    r.clear()
    assert r.num_namespaces == 0
    r.check_invariants()


def test_a_lock_keeps_an_empty_namespace_until_it_is_released():
    r = RadixCache(100, block_size=4)
    r.insert([1, 2], salt="a")
    miss = r.match([9], salt="a")  # a miss in a live namespace locks its root
    r.lock(miss)
    r.clear()
    assert r.num_tokens == 0 and r.num_namespaces == 1
    r.check_invariants()
    r.unlock(miss)
    assert r.num_namespaces == 0
    r.check_invariants()
    unknown = r.match([1], salt="never")  # a miss in an unknown namespace: harmless to lock
    r.lock(unknown)
    assert r.num_namespaces == 0 and r.num_locks == 1
    r.unlock(unknown)
    r.check_invariants()


def test_at_the_cap_the_least_recently_used_namespace_is_evicted_whole():
    r = RadixCache(100, block_size=4, max_namespaces=2)
    r.insert([1, 2, 3], salt="a")
    r.insert([1, 2, 4], salt="a")  # "a": two leaves under [1, 2]
    r.insert([7, 7], salt="b")
    r.match([1], salt="a")  # "b" is now the least recently used
    assert r.insert([5, 5, 5], salt="c") == 3
    assert namespaces(r) == [b"a", b"c"]
    assert cached(r, [7, 7], "b") == 0 and cached(r, [1, 2, 4], "a") == 3
    assert (r.stats.evicted_namespaces, r.stats.evictions, r.stats.evicted_tokens) == (1, 1, 2)
    assert r.insert([6], salt=None) == 1  # the unsalted namespace counts like any other: "a" goes (3 nodes)
    assert namespaces(r) == [b"c", None]
    assert (r.stats.evicted_namespaces, r.stats.evictions, r.stats.evicted_tokens) == (2, 4, 6)
    assert r.num_tokens == 4
    r.check_invariants()


def test_a_namespace_with_a_lock_is_never_evicted_and_all_locked_means_uncached():
    r = RadixCache(100, block_size=4, max_namespaces=2)
    r.insert([1, 1], salt="a")
    r.insert([2, 2], salt="b")
    held_a = r.match([1, 1], salt="a")
    r.lock(held_a)
    r.match([2], salt="b")  # "a" is the least recently used, but locked
    assert r.insert([3, 3], salt="c") == 2
    assert namespaces(r) == [b"a", b"c"]  # "b" went
    held_c = r.match([9], salt="c")  # a root lock pins the namespace too
    r.lock(held_c)
    before = (list(r.edges()), r.num_tokens, r.stats.evictions)
    assert r.insert([4, 4, 4], salt="d") == 0  # every namespace is in use: "d" is served uncached
    assert (list(r.edges()), r.num_tokens, r.stats.evictions) == before
    assert r.stats.uncached_inserts == 1 and cached(r, [4, 4, 4], "d") == 0
    assert r.insert([1, 1, 5], salt="a") == 1  # live namespaces keep caching
    r.unlock(held_c)
    assert r.insert([4, 4, 4], salt="d") == 3  # now "c" can go
    assert namespaces(r) == [b"a", b"d"]
    r.unlock(held_a)
    r.check_invariants()


def test_evicting_a_namespace_releases_its_blocks():
    allocator = BlockAllocator(16, 4)
    r = RadixCache(100, 4, allocator, max_namespaces=1)
    allocator.allocate("s", 10)
    r.insert(list(range(10)), allocator.block_table("s"), salt="a")
    r.insert(list(range(6)) + [99], allocator.block_table("s"), salt="a")  # a split: a straddling block twice
    allocator.free("s")
    assert allocator.num_free_blocks == 13
    allocator.allocate("t", 3)
    assert r.insert([5, 5, 5], allocator.block_table("t"), salt="b") == 3
    allocator.free("t")
    assert allocator.num_free_blocks == 15 and r.num_namespaces == 1
    r.check_invariants()
    allocator.check_invariants()


# ------------------------------------------------------------------ bounded by budget + cap
def make(*, real, budget=1024, block_size=16, prompt_tokens=64, max_namespaces=1024):
    num_blocks = budget // block_size + 2 * prompt_tokens // block_size
    allocator = BlockAllocator(num_blocks, block_size) if real else None
    return RadixCache(budget, block_size, allocator, max_namespaces=max_namespaces)


def flood(r, salts, *, prompt_tokens=64, seed=0):
    """One ``prompt_tokens`` prompt per salt index, the engine's flow (match, then insert)."""
    rng = random.Random(seed)
    for index in salts:
        salt = f"tenant-{index}"
        prompt = list(rng.randbytes(prompt_tokens))
        r.match(prompt, salt)
        if r.allocator is None:
            r.insert(prompt, salt=salt)
        else:
            r.allocator.allocate(index, prompt_tokens)
            r.insert(prompt, r.allocator.block_table(index), salt)
            r.allocator.free(index)
    assert r.num_namespaces <= r.max_namespaces


def test_100k_salts_hold_what_10k_hold():
    tracemalloc.start()
    try:
        radix = make(real=False)
        flood(radix, range(10_000))
        at_10k = tracemalloc.get_traced_memory()[0]
        flood(radix, range(10_000, 100_000), seed=1)
        at_100k = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    # before namespaces were dropped: 4.5 MiB at 10k salts, 47 MiB at 100k (a root per salt ever seen)
    assert at_100k < 1.25 * at_10k + 64 * 1024 and at_100k < 2**20, (at_10k, at_100k)
    assert radix.num_namespaces == 16 and radix.num_nodes == 16  # 1,024 / 64 tokens a tenant
    assert len(list(radix.edges())) == radix.num_nodes  # what the summary walks
    radix.check_invariants()


def test_100k_salts_with_the_allocator_and_a_small_cap():
    # budget 1,024 and 16-token prompts: 64 namespaces would fit; the cap of 16 binds
    radix = make(real=True, prompt_tokens=16, max_namespaces=16)
    flood(radix, range(100_000), prompt_tokens=16)
    assert radix.num_namespaces == 16 and radix.num_tokens == 256
    assert radix.stats.evicted_namespaces == 100_000 - 16
    radix.check_invariants()
    radix.allocator.check_invariants()
    start = time.perf_counter()
    hashes = cached_block_hashes(radix, 16)
    assert len(hashes) == 16 and time.perf_counter() - start < 0.05
    radix.clear()
    assert radix.allocator.num_free_blocks == radix.allocator.num_blocks and radix.num_namespaces == 0
