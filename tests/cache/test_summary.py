"""cache.summary.cached_block_hashes: the router's view of what a radix tree holds."""

import random

import pytest

from cache import RadixCache, block_hashes
from cache.summary import cached_block_hashes


def expected_hashes(radix, inserted, block_size):
    """Union of block_hashes over the cached part of every inserted sequence.

    Every cached position lies on some inserted sequence, so this is the union
    over all cached root-to-node paths.
    """
    out = set()
    for salt, tokens in inserted:
        num_cached = radix.match(tokens, salt, touch=False).num_tokens
        out.update(block_hashes(tokens[:num_cached], block_size, salt))
    return out


def test_exact_hashes_of_a_small_tree():
    r = RadixCache(100, block_size=16)
    r.insert([1, 2, 3, 4, 5])
    r.insert([1, 2, 3, 9, 9, 9])
    r.insert([1, 2, 3, 4, 5], salt="t")
    assert cached_block_hashes(r, 2) == {
        *block_hashes([1, 2, 3, 4, 5], 2),  # (1,2), (3,4)
        *block_hashes([1, 2, 3, 9, 9, 9], 2),  # (1,2) again, (3,9), (9,9)
        *block_hashes([1, 2, 3, 4, 5], 2, salt="t"),
    }
    assert len(cached_block_hashes(r, 2)) == 6
    # a block is reported only when all its tokens are cached
    assert cached_block_hashes(r, 6) == set(block_hashes([1, 2, 3, 9, 9, 9], 6))
    assert cached_block_hashes(r, 7) == set()
    assert cached_block_hashes(RadixCache(10), 4) == set()


def test_salt_given_as_str_or_bytes_hashes_alike():
    r = RadixCache(100, block_size=4)
    r.insert([1, 2, 3, 4], salt=b"t")
    assert cached_block_hashes(r, 4) == set(block_hashes([1, 2, 3, 4], 4, salt="t"))


def test_reads_without_touching():
    r = RadixCache(100, block_size=4)
    r.insert([1, 2, 3, 4])
    stats = (r.stats.hits, r.stats.misses)
    cached_block_hashes(r, 2)
    assert (r.stats.hits, r.stats.misses) == stats


@pytest.mark.parametrize("seed", range(4))
def test_equals_the_union_over_cached_paths_per_salt(seed):
    rng = random.Random(seed)
    r = RadixCache(120, block_size=4)
    inserted = []
    for step in range(60):
        salt = rng.choice([None, "a", "b"])
        base = inserted[rng.randrange(len(inserted))][1] if inserted and rng.random() < 0.7 else []
        tokens = base[: rng.randint(0, len(base))] + [rng.randrange(3) for _ in range(rng.randint(1, 12))]
        if r.insert(tokens, salt=salt):
            inserted.append((salt, tokens))
        if step % 5 == 0:
            for block_size in (1, 3, 4, 5):
                assert cached_block_hashes(r, block_size) == expected_hashes(r, inserted, block_size)
    assert r.stats.evictions > 0  # the budget made it evict along the way
    r.check_invariants()


@pytest.mark.parametrize("block_size", [0, -4, 2.0, None])
def test_bad_block_size(block_size):
    with pytest.raises(ValueError, match=rf"block_size must be a positive int, got {block_size!r}"):
        cached_block_hashes(RadixCache(10), block_size)
