"""The last few reports of each replica, pooled: the medians that
:class:`router.fetch_cost.ReportedFetchCost` and
:class:`router.token_prices.ReportedTokenPrices` put in force."""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable, Collection


class PooledReports:
    """Per replica, its last ``history`` measured reports (pairs of numbers);
    :meth:`medians` of each term over every replica's reports together.

    A replica's history is created by its first report and dropped by
    :meth:`remove` (it left the ring). Memory: ``history`` pairs per replica.

    Invariants (:meth:`check_invariants`): only replicas the caller knows
    hold reports; each holds 1 to ``history`` of them.
    """

    def __init__(self, history: int) -> None:
        if type(history) is not int or history <= 0:
            raise ValueError(f"history must be a positive int, got {history!r}")
        self.history = history
        self._replica_to_reports: dict[str, deque[tuple[float, float]]] = {}

    def add(self, replica_id: str, first: float, second: float) -> None:
        """Keep a measured report; the oldest of ``replica_id``'s goes beyond ``history``. O(1)."""
        reports = self._replica_to_reports.setdefault(replica_id, deque(maxlen=self.history))
        reports.append((float(first), float(second)))

    def remove(self, replica_id: str) -> bool:
        """Forget ``replica_id``'s reports; True if it had any."""
        return self._replica_to_reports.pop(replica_id, None) is not None

    def medians(self) -> tuple[float, float] | None:
        """The median of each term over every report held; None with none. O(reports)."""
        if not self._replica_to_reports:
            return None
        reports = [report for history in self._replica_to_reports.values() for report in history]
        return statistics.median(a for a, _ in reports), statistics.median(b for _, b in reports)

    def check_invariants(self, replica_ids: Collection[str], is_valid: Callable[[float, float], bool],
                         what: str) -> None:
        """The docstring's invariants, and ``is_valid`` of every report (``what`` names them)."""
        assert set(self._replica_to_reports) <= set(replica_ids), f"{what} of a replica off the ring"
        for history in self._replica_to_reports.values():
            assert 0 < len(history) <= self.history, len(history)
            assert all(is_valid(a, b) for a, b in history), (what, history)
