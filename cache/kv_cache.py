"""The KV cache as a scheduler sees it: sequences' paged blocks over the prefix tree.

:class:`KVCache` owns the :class:`~cache.blocks.BlockAllocator` and the
:class:`~cache.radix.RadixCache` and performs every step that touches them:
matching, locking, making room, sharing and copying blocks, caching, freeing.
A scheduler asks it to admit, grow, cache, finish and release sequences by id
and gets back one small record, or ``None`` when the pool cannot make room; it
never sees a block table entry it must manage or a tree node.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from cache.blocks import BlockAllocator, OutOfBlocks
from cache.radix import MatchResult, RadixCache

SeqId = Hashable


@dataclass(frozen=True, slots=True)
class Reservation:
    """Positions :meth:`KVCache.admit` or :meth:`KVCache.append` reserved for a sequence.

    ``num_cached_tokens``: how many of the sequence's first positions already
    hold KV, reused from the tree (admission only; 0 for an append).
    ``copy``: ``(src, dst)`` when the KV rows of block ``src`` must be copied
    into block ``dst`` before the next forward (copy-on-write of a shared
    block), else ``None``.
    """

    num_cached_tokens: int
    copy: tuple[int, int] | None


@dataclass(slots=True)
class _Held:
    """What the KV cache keeps for one admitted sequence."""

    salt: str | None
    lock: MatchResult  # the tree path this sequence keeps locked
    num_admitted_tokens: int  # positions at admission: a sequence admitted over the budget is never cached
    num_cached_tokens: int  # first positions handed to the tree (reused at admission, then cached)
    is_import: bool = False  # KV computed elsewhere (reserve_import): cached as a copy


class KVCache:
    """Paged KV bookkeeping of running sequences with radix prefix reuse.

    Invariants (checked by :meth:`check_invariants`, with the allocator's and
    the tree's):

    1. The sequences it holds are exactly the allocator's, and each holds
       exactly one tree lock (the tree's only locks, but for the pin an
       exporter holds inside :meth:`pinned_prefix`): on the path to its last
       cached position, so what it reuses or cached is never evicted under it.
    2. A held sequence's ``num_cached_tokens <= num_reserved_tokens``.
    3. Nothing writes into a block the tree names: a partly reused block is
       copied at admission and a shared last block before an append (the
       returned ``copy``), and only positions past ``num_cached_tokens`` are
       written by the caller.

    Room: :meth:`admit` needs the sequence's fresh blocks plus
    ``watermark_blocks`` free (headroom for running sequences' appends) and
    :meth:`append` one block; both evict unlocked tree entries, least recently
    used first (segmented: prefixes a lookup reused last longest, with
    ``protected_share``), to get them, and return ``None`` when that is not enough (the
    caller waits or preempts; preempting is :meth:`release`). Reuse is at most
    ``len(token_ids) - 1`` positions, so the last position's logits are
    computed.

    Failures: an unknown or already held sequence id raises ``KeyError`` /
    ``ValueError`` (a caller's bug); ``None`` is the ordinary "does not fit".
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        budget_tokens: int,
        *,
        max_namespaces: int = 1024,
        watermark_blocks: int | None = None,
        clock: Callable[[], float] | None = None,
        protected_share: float = 0.0,
    ) -> None:
        self._allocator = BlockAllocator(num_blocks, block_size)
        self._radix = RadixCache(budget_tokens, block_size, self._allocator, clock, max_namespaces, protected_share)
        if watermark_blocks is None:
            watermark_blocks = max(1, num_blocks // 100)
        if type(watermark_blocks) is not int or not 0 <= watermark_blocks <= num_blocks:
            raise ValueError(f"watermark_blocks must be an int in [0, {num_blocks}], got {watermark_blocks!r}")
        self.block_size = block_size
        self.watermark_blocks = watermark_blocks
        self._held: dict[SeqId, _Held] = {}

    # ------------------------------------------------------------------ views
    @property
    def allocator(self) -> BlockAllocator:
        """The block pool, for reading (free counts, ref counts, audits); only this class changes it."""
        return self._allocator

    @property
    def radix(self) -> RadixCache:
        """The prefix tree, for reading (size, stats, lookups with ``touch=False``); only this class changes it."""
        return self._radix

    @property
    def num_blocks(self) -> int:
        return self._allocator.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self._allocator.num_free_blocks

    def __contains__(self, seq_id: SeqId) -> bool:
        return seq_id in self._held

    def __len__(self) -> int:
        return len(self._held)

    def seq_ids(self) -> Iterator[SeqId]:
        """The held sequences, in admission order."""
        return iter(self._held)

    def block_table(self, seq_id: SeqId) -> list[int]:
        return self._allocator.block_table(seq_id)

    def num_reserved_tokens(self, seq_id: SeqId) -> int:
        return self._allocator.num_tokens(seq_id)

    def num_cached_tokens(self, seq_id: SeqId) -> int:
        """How many of the sequence's first positions it reused or handed to the tree."""
        return self._get(seq_id).num_cached_tokens

    def num_reusable_tokens(self, token_ids: Sequence[int], salt: str | None) -> int:
        """What :meth:`admit` would reuse now (at most ``len(token_ids) - 1``). A pure read."""
        return self._radix.match(token_ids[:-1], salt, touch=False).num_tokens

    # ------------------------------------------------------------- sequences
    def admit(
        self, seq_id: SeqId, token_ids: Sequence[int], salt: str | None, *, is_readmission: bool = False,
    ) -> Reservation | None:
        """Reserve ``len(token_ids)`` positions for a new sequence on its longest
        cached prefix (at most ``len - 1`` tokens): full blocks shared, a partly
        matched last block copied, fresh blocks for the rest; lock that prefix.

        Evicts unlocked entries for the fresh blocks plus the watermark; returns
        ``None`` (nothing reserved, nothing locked, the lookup not counted in the
        tree's stats) when that cannot be done.

        ``is_readmission``: the sequence was admitted before and preempted. Its
        first admission counted the lookup (and protected what it reused); what
        it finds now beyond that is mostly its own work, cached before
        :meth:`release`, so this lookup is a pure read: not counted, no LRU
        touch, nothing protected (the segmented LRU protects a prefix another
        lookup reused, not one a sequence recomputes for itself).
        """
        if not token_ids:
            raise ValueError("a sequence needs at least one token")
        return self._reserve(seq_id, token_ids, token_ids[:-1], salt, is_counted=not is_readmission)

    def reserve_import(self, seq_id: SeqId, token_ids: Sequence[int], salt: str | None) -> Reservation | None:
        """:meth:`admit` for KV computed elsewhere (an imported prefix): reuse the
        longest cached prefix of all of ``token_ids`` (not ``len - 1``), reserve
        the rest, lock. The caller copies ``copy``, writes the rows of positions
        ``[num_cached_tokens, len)``, then :meth:`finish` es (caching them, as a
        copy: the segmented LRU protects them only when reused twice here) or
        :meth:`release` s (on any failure: nothing kept). The lookup is a pure
        read (no LRU touch, not counted); ``None`` when the pool has no room.
        """
        if not token_ids:
            raise ValueError("an imported prefix needs at least one token")
        return self._reserve(seq_id, token_ids, token_ids, salt, is_counted=False, is_import=True)

    def _reserve(
        self, seq_id: SeqId, token_ids: Sequence[int], prefix: Sequence[int], salt: str | None, *, is_counted: bool,
        is_import: bool = False,
    ) -> Reservation | None:
        if seq_id in self._held:
            raise ValueError(f"sequence id {seq_id!r} is already admitted")
        peek = self._radix.match(prefix, salt, touch=False)
        self._radix.lock(peek)  # pin it while making room
        num_fresh_blocks = -(-len(token_ids) // self.block_size) - peek.num_tokens // self.block_size
        if not self._make_room(num_fresh_blocks + self.watermark_blocks):
            self._radix.unlock(peek)
            return None
        match = self._radix.match(prefix, salt, touch=is_counted)  # a counted lookup refreshes LRU
        self._radix.lock(match)
        self._radix.unlock(peek)
        copy = self._allocator.allocate_with_prefix(seq_id, len(token_ids), match.block_ids, match.num_tokens)
        self._held[seq_id] = _Held(salt, match, len(token_ids), match.num_tokens, is_import)
        return Reservation(match.num_tokens, copy)

    def append(self, seq_id: SeqId) -> Reservation | None:
        """Reserve one more position (copy-on-write if the last block is shared),
        evicting unlocked entries for a block if needed; ``None`` (nothing
        changed but evictions) when the pool still has no block."""
        while True:
            try:
                return Reservation(0, self._allocator.append(seq_id))
            except OutOfBlocks:
                if self._radix.evict(self.block_size) == 0:
                    return None

    def cache(self, seq_id: SeqId, token_ids: Sequence[int]) -> int:
        """Hand the sequence's first positions ``token_ids`` (all with KV written)
        to the tree and move its lock to their end; a no-op unless they extend
        what it cached. A sequence admitted longer than the budget is never
        cached, not even its first blocks, so it flushes nothing. Returns the
        positions newly cached (the tree's insert count)."""
        held = self._get(seq_id)
        num_tokens = len(token_ids)
        if num_tokens <= held.num_cached_tokens or held.num_admitted_tokens > self._radix.budget_tokens:
            return 0
        if num_tokens > self._allocator.num_tokens(seq_id):
            raise ValueError(f"{num_tokens} tokens to cache, {seq_id!r} has {self._allocator.num_tokens(seq_id)}")
        num_new = self._radix.insert(token_ids, self._allocator.block_table(seq_id), held.salt, is_copy=held.is_import)
        lock = self._radix.match(token_ids, held.salt, touch=False)
        self._radix.lock(lock)
        self._radix.unlock(held.lock)
        held.lock = lock
        held.num_cached_tokens = num_tokens
        return num_new

    def finish(self, seq_id: SeqId, token_ids: Sequence[int]) -> int:
        """:meth:`cache` ``token_ids`` (prompt + output, those with KV), then
        :meth:`release`; returns the positions newly cached."""
        num_new = self.cache(seq_id, token_ids)
        self.release(seq_id)
        return num_new

    def release(self, seq_id: SeqId) -> None:
        """Free the sequence's blocks and unlock its path (finish, abort or preemption)."""
        held = self._get(seq_id)
        self._allocator.free(seq_id)
        self._radix.unlock(held.lock)
        del self._held[seq_id]

    @contextmanager
    def pinned_prefix(self, token_ids: Sequence[int], salt: str | None) -> Iterator[MatchResult]:
        """The longest cached prefix of ``token_ids`` (a pure read: no LRU touch,
        not counted), locked against eviction until the ``with`` block exits, so
        an exporter can read its ``block_ids`` rows. Change nothing else inside."""
        match = self._radix.match(token_ids, salt, touch=False)
        self._radix.lock(match)
        try:
            yield match
        finally:
            self._radix.unlock(match)

    def evict_all(self) -> int:
        """Evict every unlocked tree entry; returns the positions removed."""
        return self._radix.clear()

    # ------------------------------------------------------------ invariants
    def check_invariants(self) -> None:
        assert set(self._held) == set(self._allocator.seq_ids()), "held sequences != the allocator's"
        assert self._radix.num_locks == len(self._held), (self._radix.num_locks, len(self._held))
        for seq_id, held in self._held.items():
            assert held.num_cached_tokens <= self._allocator.num_tokens(seq_id), seq_id
            assert held.num_admitted_tokens <= self._allocator.num_tokens(seq_id), seq_id
        self._allocator.check_invariants()
        self._radix.check_invariants()

    # ---------------------------------------------------------------- private
    def _get(self, seq_id: SeqId) -> _Held:
        try:
            return self._held[seq_id]
        except KeyError:
            raise KeyError(f"unknown sequence id {seq_id!r}") from None

    def _make_room(self, num_blocks: int) -> bool:
        while self._allocator.num_free_blocks < num_blocks:
            if self._radix.evict((num_blocks - self._allocator.num_free_blocks) * self.block_size) == 0:
                return False
        return True
