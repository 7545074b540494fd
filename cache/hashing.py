"""Chained block hashes: the one fingerprint of a token prefix that the router
and the workers agree on.

``h[i] = xxh3_64(h[i-1] ‖ key_i)`` with ``h[-1]`` derived from the salt, so
``h[i]`` names the whole prefix ``blocks[0..i]`` (and its tenant), not just the
block's own tokens. Two prompts share ``h[i]`` iff (barring 64-bit collisions)
they share their first ``i + 1`` blocks and their salt.

Only FULL blocks are hashed: a partial trailing block has no hash.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from functools import lru_cache
from operator import countOf

import xxhash

_U64 = struct.Struct("<Q")
_MASK_64 = (1 << 64) - 1


def salt_seed(salt: str | bytes | None) -> int:
    """The chain's starting value: 0 for no salt, else a hash of the salt."""
    if salt is None:
        return 0
    if isinstance(salt, str):
        salt = salt.encode()
    if not isinstance(salt, bytes):
        raise TypeError(f"salt must be str, bytes or None, got {type(salt).__name__}")
    return xxhash.xxh3_64_intdigest(b"kvroute-salt:" + salt)


def check_tokens(tokens: Sequence[int]) -> None:
    """Raise TypeError naming the first element that is not an int (bools rejected)."""
    if countOf(map(type, tokens), int) == len(tokens):  # fast path, C loops only
        return
    for index, token in enumerate(tokens):
        if not isinstance(token, int) or isinstance(token, bool):
            raise TypeError(f"token {index} is {token!r} ({type(token).__name__}), not an int")


def block_hashes(tokens: Sequence[int], block_size: int, salt: str | bytes | None = None) -> list[int]:
    """One chained xxh3_64 hash per full block of ``tokens``.

    ``len(result) == len(tokens) // block_size``; ``result[i]`` depends on every
    token in blocks ``0..i`` and on ``salt``. Cost O(len(tokens)).
    """
    return continue_block_hashes(salt_seed(salt), tokens, block_size)


def continue_block_hashes(parent_hash: int, tokens: Sequence[int], block_size: int) -> list[int]:
    """:func:`block_hashes` of ``tokens`` continuing a chain whose last value is
    ``parent_hash`` (``salt_seed(salt)`` starts a chain)."""
    if type(block_size) is not int or block_size <= 0:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    check_tokens(tokens)
    num_full = len(tokens) // block_size
    if num_full == 0:
        return []
    num_tokens = num_full * block_size
    try:  # one C call for the whole prompt (array("q", ...) parses a format per token)
        packed = _int64s(num_tokens).pack(*(tokens if len(tokens) == num_tokens else tokens[:num_tokens]))
    except struct.error as error:
        raise ValueError(f"token id out of the int64 range: {error}") from None
    stride = block_size * 8
    hashes: list[int] = []
    parent = parent_hash
    for start in range(0, len(packed), stride):
        parent = xxhash.xxh3_64_intdigest(_U64.pack(parent) + packed[start : start + stride])
        hashes.append(parent)
    return hashes


@lru_cache(maxsize=256)
def _int64s(count: int) -> struct.Struct:
    """Packs ``count`` ints as little-endian int64 (the bytes ``array("q")``
    gives on the little-endian machines we run on, and DESIGN.md's layout)."""
    return struct.Struct(f"<{count}q")


def chain_block_keys(block_keys: Iterable[int], salt: str | bytes | None = None) -> list[int]:
    """Chain precomputed per-block keys the way :func:`block_hashes` chains blocks.

    Trace replay uses this: a Mooncake ``hash_ids`` list names each 512-token
    block by an id; chaining the ids gives prefix fingerprints that behave like
    :func:`block_hashes` of the synthesized tokens (equal iff equal prefixes).
    """
    hashes: list[int] = []
    parent = salt_seed(salt)
    for index, key in enumerate(block_keys):
        if type(key) is not int:
            raise TypeError(f"block key {index} is {key!r}, not an int")
        parent = xxhash.xxh3_64_intdigest(_U64.pack(parent) + _U64.pack(key & _MASK_64))
        hashes.append(parent)
    return hashes
