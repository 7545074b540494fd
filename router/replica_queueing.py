"""Whether a request in flight at a replica waits or runs: from its reports."""

from __future__ import annotations


class ReplicaQueueing:
    """Per replica, from its reports (``CacheSummary.num_running`` and
    ``num_waiting``): the most requests it was seen running at once, and
    how many waited at its latest report.

    :meth:`queues` says whether a request sent there now waits behind the
    ones in flight. A replica that runs one request at a time (a FIFO
    server: it never reported two running) queues every request behind the
    one it runs; a batching engine runs what it has in flight together, so
    only the requests it reports waiting (its batch or its KV cache full)
    queue. The queued-copy rule (``PolicyConfig.queue_copy_requests``) reads
    it: a copy of a prefix moves a request away from a queue, and where
    the holder batches there is none to move it from, only a second copy
    that costs cache (simulated Mooncake 1.25M under batching, nine summary
    periods: hit 0.5918 → 0.5907 with copies there, 0.5924 without;
    BENCHMARKS.md "Queued copies of a branching prefix").

    Invariants (checked by :meth:`check_invariants`): counts are >= 0.
    """

    def __init__(self) -> None:
        self._reports: dict[str, tuple[int, int]] = {}  # replica -> (most running at once, waiting at the latest)
        self._waited_behind_one: set[str] = set()  # replicas that reported requests waiting while one ran

    def report(self, replica_id: str, num_running: int, num_waiting: int) -> None:
        """A replica's report; O(1)."""
        most, _ = self._reports.get(replica_id, (0, 0))
        self._reports[replica_id] = (max(most, num_running, 0), max(num_waiting, 0))
        if num_running == 1 and num_waiting > 0:
            self._waited_behind_one.add(replica_id)

    def queues(self, replica_id: str) -> bool:
        """Whether a request sent to ``replica_id`` now waits behind those in
        flight: it never reported running two at once (or has not reported
        yet), or its latest report had requests waiting."""
        most, waiting = self._reports.get(replica_id, (0, 0))
        return most <= 1 or waiting > 0

    def batches(self, replica_id: str) -> bool:
        """Whether ``replica_id`` was seen running two requests at once (a
        batching engine; a queued copy's size floor spares it)."""
        return self._reports.get(replica_id, (0, 0))[0] > 1

    def serves_one_at_a_time(self, replica_id: str) -> bool:
        """Whether ``replica_id`` is seen to be a FIFO server: it reported
        requests waiting while it ran one, and never two running at once.
        Its busy time is one request's after another's, so a replica that
        drew long answers decodes where the others prefill (the turnover
        term, ``PolicyConfig.turnover_weight``). A lightly loaded batching
        engine also runs one request at a time, but nothing waits behind it."""
        report = self._reports.get(replica_id)
        return report is not None and report[0] <= 1 and replica_id in self._waited_behind_one

    def remove(self, replica_id: str) -> None:
        self._reports.pop(replica_id, None)
        self._waited_behind_one.discard(replica_id)

    def check_invariants(self) -> None:
        assert all(most >= 0 and waiting >= 0 for most, waiting in self._reports.values()), "a negative count"
        assert self._waited_behind_one <= set(self._reports), "a replica seen queueing that has no report"
