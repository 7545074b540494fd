"""Eviction order for the radix tree: least recently used first ("priority is
last access time"), as a lazy min-heap."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar


class _Timed(Protocol):
    last_access: float


T = TypeVar("T", bound=_Timed)


class LruQueue(Generic[T]):
    """Evictable items, least recently used first.

    1. The owner pushes an item whenever it becomes evictable, and again
       whenever it is touched while evictable; the entry records the item's
       ``last_access`` at that moment.
    2. An entry is live iff its item is still evictable (``is_evictable``)
       and its ``last_access`` is unchanged; :meth:`pop` skips and drops
       stale entries. Equal ``last_access`` values go to the earlier push.

    Cost: O(log n) per push and pop. Stale entries are dropped in bulk when
    the heap outgrows twice its size after the last clean-up, so memory stays
    within a constant factor of the live entries (amortised O(1) extra).
    """

    def __init__(self, is_evictable: Callable[[T], bool]) -> None:
        self._is_evictable = is_evictable
        self._heap: list[tuple[float, int, T]] = []
        self._push_order = itertools.count()
        self._compact_above = 64

    def __len__(self) -> int:
        """Entries held, stale ones included."""
        return len(self._heap)

    def push(self, item: T) -> None:
        heapq.heappush(self._heap, (item.last_access, next(self._push_order), item))
        if len(self._heap) > self._compact_above:
            self._heap = [entry for entry in self._heap if self._is_live(entry)]
            heapq.heapify(self._heap)
            self._compact_above = 2 * len(self._heap) + 64

    def pop(self) -> T | None:
        """Remove and return the least recently used evictable item, or None."""
        while self._heap:
            entry = heapq.heappop(self._heap)
            if self._is_live(entry):
                return entry[2]
        return None

    def live_keys(self) -> set[tuple[int, float]]:
        """``(id(item), last_access)`` of every live entry, for invariant checks. O(n)."""
        return {(id(entry[2]), entry[0]) for entry in self._heap if self._is_live(entry)}

    def _is_live(self, entry: tuple[float, int, T]) -> bool:
        access, _, item = entry
        return item.last_access == access and self._is_evictable(item)
