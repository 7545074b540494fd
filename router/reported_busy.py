"""Each replica's recent busy time as its own counter reports it, topped up
with this router's spans since: the same figure for every router."""

from __future__ import annotations

import math
from collections.abc import Callable

from router.decay_base import DecayBase

#: How far a counter may read below its last report and still count as the
#: same run (no increment): float noise, or a rounding of the counter. The
#: live Worker rounds it to 1 ms; the simulated replicas' counter, a
#: difference of floats, once read 1e-15 s lower a period later, and read as
#: a restart it made that replica look idle to the router (2026-12-06).
COUNTER_SLACK_S = 1e-3


class ReportedBusy:
    """Recent busy seconds per replica from ``CacheSummary.busy_s_total``.

    A report adds the counter's increment since the replica's previous
    report to a value decayed by ``exp(-age / window_s)``, as
    :class:`router.busy_spans.BusySpans` decays this router's own spans.
    Until the next report the value grows by what this router itself saw
    the replica busy with since (its own spans' decayed integral past the
    report), so a replica this router has just loaded does not look idle
    for a period; the next report's increment replaces that guess. So

        ``busy(r, now) = (R(r) - own(r, t_r)) · d(now - t_r) + own(r, now)``

    with ``t_r`` the last report's moment, ``R(r)`` the reported value then,
    ``own`` this router's own decayed figure and ``d(a) = exp(-a /
    window_s)``. ``busy(r, now) >= own(r, now) - own(r, t_r)·d(now - t_r)
    >= 0``: own spans only add after ``t_r``.

    Why: with several routers each sees only its own requests' spans, about
    1/K of a replica's busy time, and its view of who is busy is mostly
    noise at light load; the replica knows how long its engine was busy, and
    every router reads the same report. The first report of a replica (or
    of a new epoch, or a counter that went back by more than
    :data:`COUNTER_SLACK_S`) seeds it with this router's own figure; one
    that went back by less adds nothing, and its last count stays the
    higher one. :attr:`num_counting` is how many replicas'
    counters have moved: a worker from before the field reports 0 for
    ever, and read as a counter it would look idle, so the policy reads
    these figures only when every replica's has.

    Stored per replica as ``a[r] = (R(r) - own(r, t_r)) · e^{(t_r - base)/W}``,
    so ``busy(r, now) = a[r] · e^{(base - now)/W} + own(r, now)`` and the
    fleet's mean is ``sum(a) · e^{(base - now)/W} / N`` plus the mean of the
    own figures: O(1) per report and per read.

    Invariants (checked by :meth:`check_invariants`): ``_total == sum(a)``;
    the replicas with a value are those with a last count.
    """

    def __init__(self, window_s: float) -> None:
        self._base = DecayBase(window_s)  # raises for window_s <= 0
        self.window_s = self._base.window_s
        self._last: dict[str, tuple[str, float]] = {}  # replica -> (epoch, busy_s_total) last seen
        self._scaled: dict[str, float] = {}  # a[r]
        self._reported: dict[str, tuple[float, float]] = {}  # replica -> (t_r, R(r))
        self._total = 0.0  # sum of a
        self._counting: set[str] = set()  # replicas whose counter has moved (reported > 0)

    def __contains__(self, replica_id: object) -> bool:
        return replica_id in self._scaled

    def __len__(self) -> int:
        return len(self._scaled)

    @property
    def num_counting(self) -> int:
        """Replicas whose busy counter has reported more than 0."""
        return len(self._counting)

    def report(self, replica_id: str, epoch: str, busy_s_total: float, now: float, own_busy_s: float) -> None:
        """A summary of ``replica_id`` counted ``busy_s_total`` busy seconds;
        ``own_busy_s`` is this router's own decayed busy figure for it now."""
        last = self._last.get(replica_id)
        if last is None or last[0] != epoch or busy_s_total < last[1] - COUNTER_SLACK_S:
            reported = own_busy_s  # nothing to difference: this router's own figure
        else:
            at_s, before = self._reported[replica_id]
            busy_s_total = max(busy_s_total, last[1])  # within the slack: no increment
            reported = before * math.exp(-max(0.0, now - at_s) / self.window_s) + (busy_s_total - last[1])
        self._last[replica_id] = (epoch, busy_s_total)
        if busy_s_total > 0:
            self._counting.add(replica_id)
        else:
            self._counting.discard(replica_id)
        self._reported[replica_id] = (now, reported)
        self._rebase_if_due(now)
        scaled = (reported - own_busy_s) / self._decay(now)
        self._total += scaled - self._scaled.get(replica_id, 0.0)
        self._scaled[replica_id] = scaled

    def view(self, now: float, own: Callable[[str], float], own_mean: float
             ) -> tuple[Callable[[str], float], float]:
        """``(busy_s(·), mean)`` now, given this router's own view (``own``,
        and its mean over the same replicas): valid until the next update."""
        scaled, decay = self._scaled, self._decay(now)
        mean = self._total * decay / len(scaled) + own_mean if scaled else own_mean
        return (lambda replica_id: scaled.get(replica_id, 0.0) * decay + own(replica_id)), mean

    def remove(self, replica_id: str) -> None:
        self._last.pop(replica_id, None)
        self._reported.pop(replica_id, None)
        self._counting.discard(replica_id)
        self._total -= self._scaled.pop(replica_id, 0.0)

    # ----------------------------------------------------------------- private
    def _decay(self, now: float) -> float:
        return self._base.decay(now)

    def _rebase_if_due(self, now: float) -> None:
        scale = self._base.rebase_if_due(now)
        if scale is not None:
            self._scaled = {r: a * scale for r, a in self._scaled.items()}
            self._total = sum(self._scaled.values())

    def check_invariants(self) -> None:
        assert set(self._scaled) == set(self._last) == set(self._reported), "replicas tracked in part"
        assert self._counting <= set(self._scaled), "a counting replica without a value"
        assert math.isclose(sum(self._scaled.values()), self._total, rel_tol=1e-9, abs_tol=1e-6), "total"
