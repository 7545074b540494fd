"""Block-hash sets as bytes: the sorted hashes as little-endian uint64.

What a summary's hash fields carry (base64 of it: ``"h"`` and ``"rm"`` in
:class:`cache.summary.CacheSummary`'s wire format, ``"block_hashes"`` and
``"removed_hashes"`` in v1) and what a base sent by reference holds
(:func:`pack_block_hashes`): 8 bytes a block, alike on machines of either byte order.
"""

from __future__ import annotations

import base64
import binascii
import sys
from array import array


def pack_block_hashes(hashes: frozenset[int] | set[int]) -> bytes:
    """A block set as bytes: the sorted hashes as little-endian uint64 (what a base by reference holds)."""
    return pack_array(frozenset(hashes)).tobytes()


def unpack_block_hashes(raw: object) -> frozenset[int]:
    """The inverse of :func:`pack_block_hashes`; ``ValueError`` unless ``raw`` is bytes of a multiple of 8."""
    if not isinstance(raw, (bytes, bytearray, memoryview)):
        raise ValueError(f"a packed block set must be bytes, got {type(raw).__name__}")
    return frozenset(_from_bytes(bytes(raw), "a packed block set"))


def pack_array(hashes: frozenset[int]) -> array:
    """The sorted hashes as an array of little-endian uint64 (``.tobytes()`` is the packed set)."""
    packed = array("Q", sorted(hashes))
    if sys.byteorder != "little":
        packed.byteswap()
    return packed


def unpack_base64(encoded: object, name: str) -> array:
    """Hashes from base64 of little-endian uint64 (v2: the count is the length / 8)."""
    if not isinstance(encoded, str):
        raise ValueError(f"{name} must be a base64 str, got {type(encoded).__name__}")
    try:
        raw = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{name} is not valid base64 ({len(encoded)} chars)") from None
    return _from_bytes(raw, name)


def _from_bytes(raw: bytes, name: str) -> array:
    """Little-endian uint64 hashes; ``ValueError`` unless ``raw`` is a multiple of 8 bytes."""
    if len(raw) % 8:
        raise ValueError(f"{name} holds {len(raw)} bytes, not a multiple of 8")
    hashes = array("Q")
    hashes.frombytes(raw)
    if sys.byteorder != "little":
        hashes.byteswap()
    return hashes
