"""Each replica's recent work as its own counters report it (the same for every router)."""

from __future__ import annotations

import math


class ReportedWork:
    """Recent work per replica from the token counters its summaries carry
    (``num_prefill_tokens_total``, ``num_output_tokens_total``): each report
    adds ``Δprefill + decode_token_cost × Δoutput`` since the previous one to
    a counter decayed by ``exp(-age / window_s)``. Every router reads the
    same summaries, so every router holds (within a period) the same
    figures — unlike its own recent work, which counts only its own
    decisions. A new epoch, or counters that went back, restart a replica
    at the others' mean. O(1) per report; :meth:`mean` O(replicas)."""

    def __init__(self, window_s: float, decode_token_cost: float) -> None:
        self.window_s = float(window_s)
        self.decode_token_cost = float(decode_token_cost)
        self._last: dict[str, tuple[str, int, int]] = {}  # replica -> (epoch, prefill, output) last seen
        self._value: dict[str, tuple[float, float]] = {}  # replica -> (decayed work, as of time)
        self._queued: dict[str, float] = {}  # replica -> work it reported queued (routed, not yet done)

    def __contains__(self, replica_id: object) -> bool:
        return replica_id in self._value

    def report(self, replica_id: str, epoch: str, num_prefill_total: int, num_output_total: int,
               now: float, queued_work: float = 0.0) -> None:
        """``queued_work``: what the replica holds not yet done (counted as
        routed work, so the figure leads the counters instead of lagging)."""
        self._queued[replica_id] = queued_work
        last = self._last.get(replica_id)
        self._last[replica_id] = (epoch, num_prefill_total, num_output_total)
        if last is None or last[0] != epoch or num_prefill_total < last[1] or num_output_total < last[2]:
            others = [self.value(r, now) for r in self._value if r != replica_id]
            self._value[replica_id] = (sum(others) / len(others) if others else 0.0, now)
            return
        added = (num_prefill_total - last[1]) + self.decode_token_cost * (num_output_total - last[2])
        self._value[replica_id] = (self.value(replica_id, now) + added, now)

    def value(self, replica_id: str, now: float) -> float:
        work, as_of = self._value.get(replica_id, (0.0, now))
        return work * math.exp(-max(0.0, now - as_of) / self.window_s) + self._queued.get(replica_id, 0.0)

    def mean(self, replica_ids, now: float) -> float:
        values = [self.value(r, now) for r in replica_ids]
        return sum(values) / len(values) if values else 0.0

    def remove(self, replica_id: str) -> None:
        self._last.pop(replica_id, None)
        self._value.pop(replica_id, None)
        self._queued.pop(replica_id, None)
