"""cache.hashing: chained block hashes over full blocks, and chains of precomputed keys."""

import struct

import pytest
import xxhash

from cache import block_hashes, chain_block_keys
from cache.hashing import check_tokens, continue_block_hashes, salt_seed


def reference_block_hashes(tokens, block_size, salt=None):
    """The chain spelled out from DESIGN.md: h[i] = xxh3_64(h[i-1] ‖ block_i as int64 LE)."""
    parent = 0 if salt is None else xxhash.xxh3_64_intdigest(b"kvroute-salt:" + (salt.encode() if isinstance(salt, str) else salt))
    out = []
    for start in range(0, len(tokens) // block_size * block_size, block_size):
        block = tokens[start : start + block_size]
        parent = xxhash.xxh3_64_intdigest(struct.pack("<Q", parent) + struct.pack(f"<{block_size}q", *block))
        out.append(parent)
    return out


def test_one_hash_per_full_block_only():
    tokens = list(range(10))
    assert len(block_hashes(tokens, 4)) == 2  # the 2-token tail has no hash
    assert block_hashes(tokens, 4) == block_hashes(tokens[:8], 4)
    assert block_hashes(tokens[:3], 4) == []
    assert block_hashes([], 4) == []
    assert len(block_hashes(tokens, 1)) == 10
    assert len(block_hashes(tokens, 10)) == 1


def test_matches_the_spelled_out_chain():
    tokens = [5, 0, 255, 7, -1, 2**40, 3, 3, 9]
    for block_size in (1, 2, 3, 4):
        for salt in (None, "tenant", b"tenant", ""):
            assert block_hashes(tokens, block_size, salt) == reference_block_hashes(tokens, block_size, salt)


def test_each_hash_depends_on_every_earlier_block():
    base = list(range(16))
    hashes = block_hashes(base, 4)
    for position in range(16):
        changed = list(base)
        changed[position] = 1000
        other = block_hashes(changed, 4)
        first_changed_block = position // 4
        assert other[:first_changed_block] == hashes[:first_changed_block]
        # the changed block and every later one differ: the chain carries the change forward
        for i in range(first_changed_block, 4):
            assert other[i] != hashes[i], (position, i)


def test_hash_is_not_just_the_block_content():
    # the same block at a different place in the chain hashes differently
    assert block_hashes([1, 2, 1, 2], 2)[0] != block_hashes([1, 2, 1, 2], 2)[1]
    # swapping two blocks changes both hashes
    assert block_hashes([1, 2, 3, 4], 2) != block_hashes([3, 4, 1, 2], 2)


def test_salt_namespaces_the_whole_chain():
    tokens = list(range(12))
    plain = block_hashes(tokens, 4)
    a = block_hashes(tokens, 4, salt="a")
    b = block_hashes(tokens, 4, salt="b")
    empty = block_hashes(tokens, 4, salt="")
    for i in range(3):
        assert len({plain[i], a[i], b[i], empty[i]}) == 4
    assert block_hashes(tokens, 4, salt=b"a") == a  # str and bytes name one salt
    assert salt_seed(None) == 0
    assert salt_seed("a") == salt_seed(b"a") != salt_seed("b")


def test_equal_prefixes_share_exactly_their_common_full_blocks():
    a = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    b = [1, 2, 3, 4, 5, 6, 0, 8, 9]  # differs at position 6, inside block 1 (bs 4)
    ha, hb = block_hashes(a, 4), block_hashes(b, 4)
    assert ha[0] == hb[0] and ha[1] != hb[1]
    # chain_block_keys follows the same rule on per-block keys
    ka, kb = chain_block_keys([10, 11, 12]), chain_block_keys([10, 11, 99])
    assert ka[:2] == kb[:2] and ka[2] != kb[2]
    kc = chain_block_keys([99, 11, 12])
    assert all(x != y for x, y in zip(ka, kc))  # an early difference changes every later hash
    assert chain_block_keys([10, 11]) == ka[:2]  # prefix of keys -> prefix of hashes


def test_chain_block_keys_equals_block_hashes_at_block_size_one():
    # a key is chained exactly like a 1-token block, so both paths agree
    keys = [0, 1, 2**63 - 1, -5, 7]
    assert chain_block_keys(keys) == block_hashes(keys, 1)
    assert chain_block_keys(keys, salt="t") == block_hashes(keys, 1, salt="t")
    assert chain_block_keys([]) == []
    assert chain_block_keys(iter([3, 4])) == chain_block_keys([3, 4])  # any iterable


def test_continue_block_hashes_continues_a_chain():
    tokens = list(range(40))
    whole = block_hashes(tokens, 8, salt="s")
    head = block_hashes(tokens[:16], 8, salt="s")
    tail = continue_block_hashes(head[-1], tokens[16:], 8)
    assert head + tail == whole
    assert continue_block_hashes(salt_seed("s"), tokens, 8) == whole
    assert continue_block_hashes(head[-1], tokens[16:20], 8) == []


@pytest.mark.parametrize(
    "bad, index",
    [([1, 2, True], 2), ([False], 0), ([1, 2.0], 1), (["3"], 0), ([1, None], 1), ([1, 2, 3, 4, b"x"], 4)],
)
def test_non_int_tokens_raise_type_error_naming_the_index(bad, index):
    with pytest.raises(TypeError, match=rf"token {index} is {bad[index]!r}"):
        block_hashes(bad, 2)
    with pytest.raises(TypeError, match=rf"token {index}"):
        check_tokens(bad)


def test_int_subclasses_other_than_bool_are_tokens():
    import enum

    class Tok(enum.IntEnum):
        A = 3

    assert block_hashes([Tok.A, 4], 2) == block_hashes([3, 4], 2)


def test_bad_block_keys_raise_type_error_naming_the_index():
    with pytest.raises(TypeError, match=r"block key 1 is 'x'"):
        chain_block_keys([1, "x"])
    with pytest.raises(TypeError, match=r"block key 0 is True"):
        chain_block_keys([True])


@pytest.mark.parametrize("block_size", [0, -1, 2.0, True, "4", None])
def test_bad_block_size_raises_value_error_naming_it(block_size):
    with pytest.raises(ValueError, match=rf"block_size must be a positive int, got {block_size!r}"):
        block_hashes([1, 2, 3], block_size)


def test_bad_salt_and_out_of_range_tokens():
    with pytest.raises(TypeError, match="salt must be str, bytes or None, got int"):
        block_hashes([1], 1, salt=5)
    with pytest.raises(ValueError, match="int64"):
        block_hashes([2**63], 1)
