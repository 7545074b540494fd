"""KeyedMin: the least of one entry per key, against a plain min."""

from __future__ import annotations

import random

import pytest

from router.keyed_min import GROUP_SIZE, KeyedMin


@pytest.mark.parametrize("seed", range(6))
def test_the_least_entry_is_always_the_plain_min_through_sets_removals_and_rejoins(seed):
    """Random replacements (up, down, equal first fields), removals and keys
    coming back, over more keys than two groups hold: after each step the
    least entry is exactly what ``min`` over the current entries gives."""
    rng = random.Random(seed)
    keys = [f"r{i}" for i in range(2 * GROUP_SIZE + 5)]
    keyed, current, version = KeyedMin(), {}, 0
    for _ in range(3000):
        key = rng.choice(keys)
        if rng.random() < 0.1:
            keyed.remove(key)
            current.pop(key, None)
        else:
            version += 1
            entry = (float(rng.randrange(4)), rng.random() if rng.random() < 0.5 else 0.0, version, key)
            keyed.set(key, entry)
            current[key] = entry
        keyed.check_invariants()
        assert len(keyed) == len(current)
        assert keyed.least() == (min(current.values()) if current else None)
        if key in current:
            assert keyed.entry(key) is current[key]


def test_removing_a_key_frees_its_slot_for_the_next_key():
    keyed = KeyedMin()
    for i in range(GROUP_SIZE + 1):
        keyed.set(i, (float(i), i))
    keyed.remove(3)
    keyed.remove(3)  # again: nothing happens
    assert 3 not in keyed and keyed.least() == (0.0, 0)
    keyed.set("new", (-1.0, "new"))
    keyed.check_invariants()
    assert len(keyed._key_at) == GROUP_SIZE + 1, "a freed slot was not reused"
    assert keyed.least() == (-1.0, "new")
    with pytest.raises(KeyError):
        keyed.entry(3)


def test_an_empty_keyed_min_has_no_least_entry():
    keyed = KeyedMin()
    assert keyed.least() is None
    keyed.set("a", (1.0, "a"))
    keyed.remove("a")
    assert keyed.least() is None and len(keyed) == 0
