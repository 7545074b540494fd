"""How much recent work each cached prefix drew: the demand that earns a hot
prefix another holder (``replicate_hot_prefixes``, step 5 of
:class:`router.policy.PrefixAffinityPolicy`)."""

from __future__ import annotations

import math
from collections import OrderedDict


class PrefixDemand:
    """Per prefix, the work this router routed to requests that reused it,
    each decayed by ``exp(-age / window_s)`` (the recent-work window of
    :class:`router.load.LoadTracker`, so the two compare in the same units).

    A prefix is named by the chained hash of its last block (the deepest
    block some replica was known to hold when the request was routed):
    requests that reuse the same prefix and go on differently book under
    one key; a conversation's later turns book under their own history.

    Memory: at most ``max_keys`` prefixes, the least recently booked out
    first (a forgotten prefix reads 0: at worst it is not replicated).

    Invariants (checked by :meth:`check_invariants`): at most ``max_keys``
    entries; every value is finite and >= 0.
    """

    def __init__(self, window_s: float, max_keys: int = 1 << 16) -> None:
        if not window_s > 0:
            raise ValueError(f"window_s must be > 0, got {window_s!r}")
        if type(max_keys) is not int or max_keys <= 0:
            raise ValueError(f"max_keys must be a positive int, got {max_keys!r}")
        self.window_s = float(window_s)
        self.max_keys = max_keys
        self._entries: OrderedDict[int, tuple[float, float]] = OrderedDict()  # key -> (value, booked at)

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, key: int, work: float, now: float) -> None:
        """Book ``work`` (>= 0, the request's work units) against ``key`` at ``now``. O(1)."""
        value = self.value(key, now)
        self._entries[key] = (value + max(work, 0.0), now)
        self._entries.move_to_end(key)
        if len(self._entries) > self.max_keys:
            self._entries.popitem(last=False)

    def clear(self) -> None:
        """Forget every prefix's demand (the recent-work window starts afresh)."""
        self._entries.clear()

    def value(self, key: int, now: float) -> float:
        """The decayed work booked against ``key`` as of ``now`` (0 if none). O(1), no change."""
        entry = self._entries.get(key)
        if entry is None:
            return 0.0
        value, booked_at = entry
        return value * math.exp(min(booked_at - now, 0.0) / self.window_s)

    def check_invariants(self) -> None:
        assert len(self._entries) <= self.max_keys, "more prefixes than max_keys"
        assert all(math.isfinite(v) and v >= 0 for v, _ in self._entries.values()), "a demand not finite or < 0"
