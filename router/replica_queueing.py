"""Whether a request in flight at a replica waits or runs: from its reports."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

MAX_PEER_REQUESTS = 1024  # other routers' shared decisions remembered per replica


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

    :meth:`peer_work`: of the other routers' shared decisions sent to a
    replica that serves in arrival order (never seen batching), those its
    latest report may still hold, and their queued work
    (``PolicyConfig.peer_queue_until_done``).

    Invariants (checked by :meth:`check_invariants`): counts and peer work
    are >= 0, at most ``MAX_PEER_REQUESTS`` peer decisions per replica.
    """

    def __init__(self) -> None:
        self._reports: dict[str, tuple[int, int]] = {}  # replica -> (most running at once, waiting at the latest)
        self._waited_behind_one: set[str] = set()  # replicas that reported requests waiting while one ran
        self._peers: dict[str, deque[float]] = {}  # replica -> other routers' decisions' queued work, oldest first

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

    def add_peer(self, replica_id: str, queued_tokens: float) -> None:
        """Another router sent a request of ``queued_tokens`` queued work to
        ``replica_id`` (its shared decision), kept unless the replica was
        seen batching (:meth:`peer_work` reads none there); O(1)."""
        if self.batches(replica_id):
            return
        peers = self._peers.setdefault(replica_id, deque(maxlen=MAX_PEER_REQUESTS))
        peers.append(max(float(queued_tokens), 0.0))

    def peer_work(self, replica_id: str, num_requests: int, num_own: Callable[[str], int]) -> float:
        """At a report of ``num_requests`` requests running and waiting at
        ``replica_id``, ``num_own(replica_id)`` of them this router's (asked
        only where peers' decisions are kept): the queued work of the other
        routers' decisions there that may still be in it.

        A replica that serves in arrival order holds the newest requests
        sent to it, so of the peers' decisions the newest ``num_requests -
        num_own`` may still be there (this router's own stay counted until
        they complete); the older ones are forgotten. Why: a report prices
        a running request at half its expected decode and a prompt in
        prefill at nothing, so from the report alone another router's long
        cold prefill vanished from this router's view at the next summary,
        and a request sent behind it waited seconds (simulated Mooncake,
        2 routers, FIFO: BENCHMARKS.md "Several routers: a peer's prefill
        outlives the next summary"). 0, and nothing kept, at a replica seen
        batching: what it runs does not wait in order. O(kept + forgotten)."""
        peers = self._peers.get(replica_id)
        if not peers:
            return 0.0
        if self.batches(replica_id):
            peers.clear()
            return 0.0
        keep = max(num_requests - num_own(replica_id), 0)
        while len(peers) > keep:
            peers.popleft()
        return sum(peers)

    def remove(self, replica_id: str) -> None:
        self._reports.pop(replica_id, None)
        self._waited_behind_one.discard(replica_id)
        self._peers.pop(replica_id, None)

    def check_invariants(self) -> None:
        assert all(most >= 0 and waiting >= 0 for most, waiting in self._reports.values()), "a negative count"
        assert self._waited_behind_one <= set(self._reports), "a replica seen queueing that has no report"
        assert all(len(p) <= MAX_PEER_REQUESTS and all(w >= 0 for w in p) for p in self._peers.values()), "peer work"
