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
    and matches the reports.
    """

    def __init__(self) -> None:
        self._reports: dict[str, tuple[int, int]] = {}  # replica -> (cached tokens, budget tokens)
        self._pressure = 0.0

    @property
    def pressure(self) -> float:
        """The budget share of full caches, 0 before any report."""
        return self._pressure

    def report(self, replica_id: str, num_cached_tokens: int, budget_tokens: int) -> None:
        """A replica's latest report; a budget of 0 (none reported) leaves it out."""
        if budget_tokens > 0:
            self._reports[replica_id] = (min(max(num_cached_tokens, 0), budget_tokens), budget_tokens)
        else:
            self._reports.pop(replica_id, None)
        self._pressure = self._computed()

    def remove(self, replica_id: str) -> None:
        if self._reports.pop(replica_id, None) is not None:
            self._pressure = self._computed()

    def _computed(self) -> float:
        budget = sum(b for _, b in self._reports.values())
        full = sum(b for c, b in self._reports.values() if c >= FULL_SHARE * b)
        return full / budget if budget else 0.0

    def check_invariants(self) -> None:
        assert all(0 <= c <= b and b > 0 for c, b in self._reports.values()), "a report outside its budget"
        assert 0.0 <= self._pressure <= 1.0 and self._pressure == self._computed(), "pressure out of date"
