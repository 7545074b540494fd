"""Eviction order with a protected segment whose size adapts: segmented LRU
(SLRU) steered as ARC steers its split.

An entry a lookup has reused is usually worth more than one cached once and
never asked for again (a unique question, the tail of a one-off prompt).
Plain LRU ranks them by recency alone, so a burst of one-off entries pushes
out a shared system prompt that is reused every few seconds. SLRU (Karedla,
Love and Wherry, 1994) keeps reused entries in a protected segment: one-off
entries are evicted first, least recently used first, and the protected
segment is itself LRU, so what stops being reused ages out. How much to
protect depends on the traffic and the cache's size: where the cache holds a
small part of the working set, protecting old reused entries costs the
recent ones that would have been reused soon. So the protected segment's
target moves as ARC's split does (Megiddo and Modha, 2003): the cache
remembers what it evicted lately (ghosts: size, and whether it had been
reused), and a lookup that misses where a ghost was grows the segment that
ghost came from.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Generic, Protocol, TypeVar

from cache.lru import LruQueue

# What the serving engine (worker.EngineConfig.cache_protected_share) and the simulator's replicas start
# from: 80 % of a cache's budget for reused prefixes, the usual SLRU split; it adapts from there
# (BENCHMARKS.md, "Reused prefixes kept: segmented LRU").
SERVING_PROTECTED_SHARE = 0.8


class _Segmented(Protocol):
    last_access: float
    is_protected: bool
    was_reused: bool
    is_copy: bool
    tokens: tuple[int, ...]


T = TypeVar("T", bound=_Segmented)


class SegmentedLru(Generic[T]):
    """Evictable items, unprotected least recently used first, then protected.

    1. An item becomes *protected* when :meth:`protect` is called on it (a
       counted lookup reused it); it stays protected until demoted or forgotten.
       A copy (``is_copy``: KV imported from another cache, held there too)
       is not: the first :meth:`protect` only clears the mark, so it is
       protected when reused a second time here, and until then it is among
       the first entries to go (losing it costs a fetch, not a recompute).
    2. Protected items hold at most :attr:`protected_target` positions
       (``len(item.tokens)`` each, counted in :attr:`num_protected_tokens`)
       after every :meth:`demote_overflow`, which demotes the least recently
       used protected items (of equal access, the deepest of a path first).
       Demoted items are ordinary LRU entries with their access time.
    3. :meth:`pop` returns the least recently used evictable unprotected item,
       and only when there is none the least recently used evictable protected
       one: nothing is lost that plain LRU would have kept once the cache holds
       nothing but reused entries.
    4. Adaptation (``protected_target`` > 0 at the start): :meth:`remember_eviction`
       keeps ghosts of evicted items, ``key -> (positions, was it reused)``, at most
       ``capacity`` positions of them, the oldest dropped first. A lookup that
       missed at a ghost's key (:meth:`adapt_on_miss`) consumes it and moves
       :attr:`protected_target` within ``[0, capacity]``: up by the ghost's
       positions x max(1, one-off ghosts' positions / reused ghosts' positions)
       when a reused item came back too late, down by its positions x max(1,
       reused / one-off) when a one-off item did.

    With ``protected_target`` 0 nothing is ever protected and nothing adapts:
    plain LRU, in the same order as one :class:`~cache.lru.LruQueue`.

    The owner calls :meth:`push` whenever an item becomes evictable or is
    touched (as for :class:`~cache.lru.LruQueue`), :meth:`touched` with the
    path it refreshed, and :meth:`forget` when it removes an item. Cost:
    O(log n) per push, pop and demotion; :meth:`touched` pushes each
    protected item on the path; ghosts cost O(1) each.
    """

    def __init__(self, is_evictable: Callable[[T], bool], protected_target: int = 0, capacity: int = 0) -> None:
        if type(capacity) is not int or capacity < 0:
            raise ValueError(f"capacity must be a non-negative int, got {capacity!r}")
        if type(protected_target) is not int or not 0 <= protected_target <= capacity:
            raise ValueError(f"protected_target must be an int within [0, capacity {capacity}], got {protected_target!r}")
        self.protected_target = protected_target
        self.capacity = capacity
        self.is_adaptive = protected_target > 0
        self.num_protected_tokens = 0
        self._probation: LruQueue[T] = LruQueue(lambda item: is_evictable(item) and not item.is_protected)
        self._protected: LruQueue[T] = LruQueue(lambda item: is_evictable(item) and item.is_protected)
        self._by_recency: LruQueue[T] = LruQueue(lambda item: item.is_protected)  # every protected item
        self._ghosts: OrderedDict[Hashable, tuple[int, bool]] = OrderedDict()  # oldest first
        self._ghost_tokens = {False: 0, True: 0}  # positions of one-off / reused ghosts

    def __len__(self) -> int:
        """Entries held in the two eviction queues, stale ones included."""
        return len(self._probation) + len(self._protected)

    @property
    def num_ghost_tokens(self) -> tuple[int, int]:
        """Positions remembered in ghosts: (one-off, reused)."""
        return self._ghost_tokens[False], self._ghost_tokens[True]

    def push(self, item: T) -> None:
        """Queue ``item`` (evictable now, or just touched) in its segment."""
        (self._protected if item.is_protected else self._probation).push(item)

    def pop(self) -> T | None:
        """Remove and return the next item to evict, or None (rule 3)."""
        item = self._probation.pop()
        return item if item is not None else self._protected.pop()

    def protect(self, items: Iterable[T]) -> None:
        """Mark ``items`` reused (rule 1); call :meth:`touched` and then
        :meth:`demote_overflow` after refreshing their access times."""
        if not self.is_adaptive:
            return
        for item in items:
            if item.is_copy:  # its first use here: the request it was imported for
                item.is_copy = False
                continue
            item.was_reused = True
            if not item.is_protected:
                item.is_protected = True
                self.num_protected_tokens += len(item.tokens)

    def touched(self, path: Sequence[T]) -> None:
        """Record the new ``last_access`` of the protected items on ``path``
        (root first, all touched at one tick): among items of equal access the
        deepest is demoted first, so a shared prefix outlives what follows it."""
        if self.num_protected_tokens:
            for item in reversed(path):
                if item.is_protected:
                    self._by_recency.push(item)

    def demote_overflow(self, is_evictable: Callable[[T], bool]) -> None:
        """Demote least recently used protected items until rule 2 holds."""
        while self.num_protected_tokens > self.protected_target:
            item = self._by_recency.pop()
            assert item is not None, "protected tokens counted without a protected item"
            self.demote(item, is_evictable)

    def demote(self, item: T, is_evictable: Callable[[T], bool]) -> None:
        """Move a protected ``item`` back to the unprotected segment (a no-op otherwise)."""
        if item.is_protected:
            self.forget(item)
            if is_evictable(item):
                self._probation.push(item)

    def forget(self, item: T) -> None:
        """``item`` left the tree or its protected part (a split): it no longer counts as protected."""
        if item.is_protected:
            item.is_protected = False
            self.num_protected_tokens -= len(item.tokens)

    def remember_eviction(self, key: Hashable, num_tokens: int, was_reused: bool) -> None:
        """Keep a ghost of an evicted item (rule 4); a no-op unless adaptive."""
        if not self.is_adaptive:
            return
        self._drop_ghost(key)
        self._ghosts[key] = (num_tokens, was_reused)
        self._ghost_tokens[was_reused] += num_tokens
        while self._ghost_tokens[False] + self._ghost_tokens[True] > self.capacity:
            self._drop_ghost(next(iter(self._ghosts)))

    def adapt_on_miss(self, key: Hashable) -> None:
        """A counted lookup missed at ``key``: if a ghost is there, move the target (rule 4)."""
        if not self.is_adaptive or key not in self._ghosts:
            return
        num_tokens, was_reused = self._ghosts[key]
        one_off, reused = self._ghost_tokens[False], self._ghost_tokens[True]
        self._drop_ghost(key)
        if was_reused:
            step = int(num_tokens * max(1.0, one_off / max(reused, 1)))
            self.protected_target = min(self.capacity, self.protected_target + step)
        else:
            step = int(num_tokens * max(1.0, reused / max(one_off, 1)))
            self.protected_target = max(0, self.protected_target - step)

    def live_keys(self) -> set[tuple[int, float]]:
        """``(id(item), last_access)`` of every live eviction entry, for invariant checks. O(n)."""
        return self._probation.live_keys() | self._protected.live_keys()

    def recency_keys(self) -> set[tuple[int, float]]:
        """The same for the protected items' recency order (rule 2's demotions)."""
        return self._by_recency.live_keys()

    def check_invariants(self) -> None:
        """Rules 2 and 4's bounds (the owner checks which items are protected)."""
        assert 0 <= self.num_protected_tokens <= self.protected_target <= self.capacity, (
            self.num_protected_tokens, self.protected_target, self.capacity)
        assert sum(n for n, _ in self._ghosts.values()) == sum(self._ghost_tokens.values()) <= self.capacity
        assert sum(n for n, reused in self._ghosts.values() if reused) == self._ghost_tokens[True]

    def _drop_ghost(self, key: Hashable) -> None:
        ghost = self._ghosts.pop(key, None)
        if ghost is not None:
            self._ghost_tokens[ghost[1]] -= ghost[0]
