"""Where a prompt's partial last block went: affinity finer than one block.

The prefix index knows full routing blocks only (64 tokens by default). A
chat's next turn extends the previous prompt (plus its answer), so what the
two share beyond their common full blocks is the previous prompt's partial
last block: up to 63 tokens the index cannot see. When every replica holds
the full blocks they share (a system prompt), the index ties and the turn
goes wherever load says, and its history is prefilled again.

:class:`PartialBlockIndex` remembers, for each routed prompt with a partial
last block, the chained hashes of that block's first ``S``, ``2S``, ...
tokens (``S = sub_block_tokens``) under its parent chain hash, and which
replica the prompt went to. A later prompt whose first unmatched block
starts with the same tokens finds that replica and how many tokens it
shares, at most ``block_size / S - 1`` lookups.
"""

from __future__ import annotations

import struct
from collections import OrderedDict
from collections.abc import Sequence
from functools import lru_cache

import xxhash

_MASK_64 = (1 << 64) - 1


@lru_cache(maxsize=64)
def _parent_and_tokens(num_tokens: int) -> struct.Struct:
    """A chain value (uint64) then ``num_tokens`` int64, little-endian: the bytes
    ``cache.continue_block_hashes`` hashes for one block."""
    return struct.Struct(f"<Q{num_tokens}q")


def sub_block_keys(parent_hash: int, block_tokens: Sequence[int], sub_block_tokens: int, max_keys: int) -> list[int]:
    """Key ``j - 1`` names the first ``j * sub_block_tokens`` tokens of a block
    after the chain ``parent_hash`` (the chained hash of those tokens taken as
    one block, as ``cache.continue_block_hashes`` would), for
    ``j = 1 .. min(max_keys, len(block_tokens) // sub_block_tokens)``. One
    packing, one hash call per key. Raises ValueError for tokens that are
    not int64 ids."""
    count = min(max_keys, len(block_tokens) // sub_block_tokens)
    if count <= 0:
        return []
    num_tokens = count * sub_block_tokens
    try:
        packed = _parent_and_tokens(num_tokens).pack(parent_hash & _MASK_64, *block_tokens[:num_tokens])
    except struct.error as error:
        raise ValueError(f"not int64 token ids: {error}") from None
    stride = 8 * sub_block_tokens
    return [xxhash.xxh3_64_intdigest(packed[: 8 + j * stride]) for j in range(1, count + 1)]


class PartialBlockIndex:
    """Sub-block key → ``(replica, tokens shared)``, most recent router wins.

    Bounded: at most ``max_entries`` keys, least recently learned or matched
    out first (an entry whose replica evicted the prefix only ever costs a
    tie-break, so no summary corrects this index; the caller checks that the
    replica still holds the parent chain).

    Invariants (checked by :meth:`check_invariants`): ``len <= max_entries``;
    every entry's token count is a positive multiple of ``sub_block_tokens``
    below ``block_size``.
    """

    def __init__(self, block_size: int, sub_block_tokens: int, max_entries: int = 1 << 17) -> None:
        for name, value in (("block_size", block_size), ("sub_block_tokens", sub_block_tokens),
                            ("max_entries", max_entries)):
            if type(value) is not int or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if block_size % sub_block_tokens or sub_block_tokens >= block_size:
            raise ValueError(f"sub_block_tokens {sub_block_tokens} must divide block_size {block_size} "
                             "and be smaller than it")
        self.block_size = block_size
        self.sub_block_tokens = sub_block_tokens
        self.max_entries = max_entries
        self._max_keys = block_size // sub_block_tokens - 1
        self.max_shared_tokens = self._max_keys * sub_block_tokens  # the most a match can share: match reads no more
        self._entries: OrderedDict[int, tuple[str, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def learn(self, replica_id: str, parent_hash: int, tail_tokens: Sequence[int]) -> None:
        """A prompt whose partial last block is ``tail_tokens`` (after the chain
        ``parent_hash``) went to ``replica_id``."""
        if len(tail_tokens) < self.sub_block_tokens:
            return  # no sub-block to name
        entries = self._entries
        for j, key in enumerate(self._keys(parent_hash, tail_tokens), 1):
            entries[key] = (replica_id, j * self.sub_block_tokens)
            entries.move_to_end(key)
        while len(entries) > self.max_entries:
            entries.popitem(last=False)

    def match(self, parent_hash: int, block_tokens: Sequence[int]) -> tuple[str, int] | None:
        """``(replica, tokens shared)`` for the longest known start of the block
        ``block_tokens`` after the chain ``parent_hash`` (only its first
        ``max_shared_tokens`` are read); None if none."""
        entries = self._entries
        for key in reversed(self._keys(parent_hash, block_tokens)):
            found = entries.get(key)
            if found is not None:
                entries.move_to_end(key)
                return found
        return None

    def _keys(self, parent_hash: int, tokens: Sequence[int]) -> list[int]:
        try:
            return sub_block_keys(parent_hash, tokens, self.sub_block_tokens, self._max_keys)
        except (TypeError, ValueError, OverflowError):  # not token ids: no fine affinity, never an error
            return []

    def check_invariants(self) -> None:
        assert len(self._entries) <= self.max_entries
        for replica_id, num_tokens in self._entries.values():
            assert isinstance(replica_id, str)
            assert 0 < num_tokens < self.block_size and num_tokens % self.sub_block_tokens == 0, num_tokens
