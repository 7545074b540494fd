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

    def __init__(self, window_s: float, decode_token_cost: float, queue_token_cost: float | None = None) -> None:
        self.window_s = float(window_s)
        self.decode_token_cost = float(decode_token_cost)
        self.queue_token_cost = self.decode_token_cost if queue_token_cost is None else float(queue_token_cost)
        self._reported_at: dict[str, float] = {}  # replica -> time of its last report
        self._peak_rate = (0.0, 0.0)  # (fastest queued-work rate a replica reported, as of)
        self._last: dict[str, tuple[str, int, int]] = {}  # replica -> (epoch, prefill, output) last seen
        self._value: dict[str, tuple[float, float]] = {}  # replica -> (decayed work, as of time)
        self._queued: dict[str, float] = {}  # replica -> work it reported queued (routed, not yet done)
        self._pending: dict[str, float] = {}  # replica -> work this router sent it since its last report

    def __contains__(self, replica_id: object) -> bool:
        return replica_id in self._value

    def report(self, replica_id: str, epoch: str, num_prefill_total: int, num_output_total: int,
               now: float, queued_work: float = 0.0) -> None:
        """``queued_work``: what the replica holds not yet done (counted as
        routed work, so the figure leads the counters instead of lagging)."""
        self._queued[replica_id] = queued_work
        self._pending[replica_id] = 0.0
        previous_at = self._reported_at.get(replica_id)
        self._reported_at[replica_id] = now
        last = self._last.get(replica_id)
        self._last[replica_id] = (epoch, num_prefill_total, num_output_total)
        if last is None or last[0] != epoch or num_prefill_total < last[1] or num_output_total < last[2]:
            others = [self._done(r, now) for r in self._value if r != replica_id]  # no queues: those are theirs
            self._value[replica_id] = (sum(others) / len(others) if others else 0.0, now)
            return
        added = (num_prefill_total - last[1]) + self.decode_token_cost * (num_output_total - last[2])
        elapsed = now - previous_at if previous_at is not None else 0.0
        if elapsed > 0:
            drained = (num_prefill_total - last[1]) + self.queue_token_cost * (num_output_total - last[2])
            self._peak_rate = (max(self.peak_rate(now), drained / elapsed), now)
        self._value[replica_id] = (self._done(replica_id, now) + added, now)

    def value(self, replica_id: str, now: float) -> float:
        return self._done(replica_id, now) + self._queued.get(replica_id, 0.0)

    def _done(self, replica_id: str, now: float) -> float:
        work, as_of = self._value.get(replica_id, (0.0, now))
        return work * math.exp(-max(0.0, now - as_of) / self.window_s)

    def peak_rate(self, now: float) -> float:
        """The fastest a replica was seen to work off queued work (prefill
        tokens + ``queue_token_cost`` per output token, per second, between
        two of its reports), decayed by ``exp(-age / window_s)``: what a busy
        replica's queue drains at. 0 until two reports of one replica."""
        rate, as_of = self._peak_rate
        return rate * math.exp(-max(0.0, now - as_of) / self.window_s)

    def age(self, replica_id: str, now: float) -> float:
        """Seconds since ``replica_id`` last reported (0 if it never did)."""
        return max(0.0, now - self._reported_at.get(replica_id, now))

    def on_routed(self, replica_id: str, work: float) -> None:
        """This router sent ``work`` to ``replica_id`` (what no report shows yet)."""
        self._pending[replica_id] = self._pending.get(replica_id, 0.0) + work

    def pending(self, replica_id: str) -> float:
        """Work this router sent ``replica_id`` since its last report."""
        return self._pending.get(replica_id, 0.0)

    def mean(self, replica_ids, now: float) -> float:
        values = [self.value(r, now) for r in replica_ids]
        return sum(values) / len(values) if values else 0.0

    def remove(self, replica_id: str) -> None:
        self._last.pop(replica_id, None)
        self._value.pop(replica_id, None)
        self._queued.pop(replica_id, None)
        self._pending.pop(replica_id, None)
        self._reported_at.pop(replica_id, None)
