"""How much of the fleet's cache budget sits in caches that are full."""

from __future__ import annotations

FULL_SHARE = 0.95  # a cache holding this share of its budget evicts on most insertions


class FleetCacheFill:
    """From each replica's latest report (cached tokens of its budget), the
    share of the fleet's budget held by full caches: 0 while every cache has
    room (a copy of a prefix evicts nothing), 1 once all are full (every
    copy evicts something another request may need).

    Invariants (checked by :meth:`check_invariants`): every report has a
    positive budget and cached tokens within it; ``pressure`` is in 0..1
    and matches the reports; the least free budget, once read, too.
    """

    def __init__(self) -> None:
        self._reports: dict[str, tuple[int, int]] = {}  # replica -> (cached tokens, budget tokens)
        self._budget = 0  # sum of the reports' budgets
        self._full = 0  # sum of the budgets of full caches
        self._min_free: int | None = None  # the least free budget of any report (when not _min_stale)
        self._min_count = 0  # the reports with that least free budget (when not _min_stale)
        self._min_stale = False  # every report that had the least free budget changed or left

    @property
    def pressure(self) -> float:
        """The budget share of full caches, 0 before any report."""
        return self._full / self._budget if self._budget else 0.0

    def free_tokens(self, replica_id: str) -> int | None:
        """Budget tokens ``replica_id``'s cache had free at its latest report; None before one."""
        report = self._reports.get(replica_id)
        return None if report is None else report[1] - report[0]

    def min_free_tokens(self) -> int | None:
        """The least free budget of any cache at its latest report; None before any. O(1), and
        O(replicas) once after every report that had the least was replaced or removed."""
        if self._min_stale:
            self._min_stale = False
            frees = [budget - cached for cached, budget in self._reports.values()]
            self._min_free = min(frees, default=None)
            self._min_count = frees.count(self._min_free)
        return self._min_free

    def report(self, replica_id: str, num_cached_tokens: int, budget_tokens: int) -> None:
        """A replica's latest report (O(1)); a budget of 0 (none reported) leaves it out."""
        self.remove(replica_id)
        if budget_tokens > 0:
            cached = min(max(num_cached_tokens, 0), budget_tokens)
            self._reports[replica_id] = (cached, budget_tokens)
            self._budget += budget_tokens
            self._full += budget_tokens if _is_full(cached, budget_tokens) else 0
            free = budget_tokens - cached
            if self._min_stale or (self._min_free is not None and free > self._min_free):
                return
            self._min_count = self._min_count + 1 if free == self._min_free else 1
            self._min_free = free

    def remove(self, replica_id: str) -> None:
        old = self._reports.pop(replica_id, None)
        if old is not None:
            cached, budget = old
            self._budget -= budget
            self._full -= budget if _is_full(cached, budget) else 0
            if not self._min_stale and budget - cached == self._min_free:
                self._min_count -= 1
                self._min_stale = self._min_count == 0

    def check_invariants(self) -> None:
        assert all(0 <= c <= b and b > 0 for c, b in self._reports.values()), "a report outside its budget"
        assert self._budget == sum(b for _, b in self._reports.values()), "budget sum out of date"
        assert self._full == sum(b for c, b in self._reports.values() if _is_full(c, b)), "full sum out of date"
        assert 0.0 <= self.pressure <= 1.0
        frees = [b - c for c, b in self._reports.values()]
        least = min(frees, default=None)
        assert self._min_stale or (self._min_free, self._min_count) == (least, frees.count(least)), "least free"


def _is_full(cached: int, budget: int) -> bool:
    return cached >= FULL_SHARE * budget
