"""What an output token costs, in prefill-token equivalents, as the replicas
measure it (``CacheSummary.decode_token_cost`` / ``queue_token_cost``)."""

from __future__ import annotations

import math

from router.pooled_reports import PooledReports


class ReportedTokenPrices:
    """The two prices of an expected output token the policy uses, learned
    from what the replicas report about their own engines.

    - ``decode_token_cost``: how long a decode keeps a replica busy (a lone
      decode step: the step's fixed cost plus one sequence), for recent work
      and the load bound;
    - ``queue_token_cost``: the delay a decoding sequence adds to requests
      queued behind it (its row in each shared step), for the load term.

    A FIFO server has one price (a decode blocks the queue as long as it
    runs); a continuous-batching engine has two far apart (tiny-llama on
    one CPU thread: ~209 and ~5; an 8B model on an H100: ~84 and ~4), and
    no configured constant fits both.

    The prices in force start at the configured ones and follow the median
    of the last ``history`` reports of every replica that has reported a
    measurement, pooled (a replica's ``decode_token_cost`` 0 means it has
    not measured yet and leaves its earlier reports standing). They move
    only when a median drifts more than ``tolerance`` (relative) from the
    price in force, so a noisy measurement does not reprice every decision
    each period.

    Why a history (default 16 reports, ~16 s at a 1-s summary period): a
    Worker fits its prices over its last 128 steps of each kind, a couple of
    seconds, and live on the CPU engine its reports ranged 30-68 (busy) and
    0-10 (queued) within minutes; with only the latest report of each
    replica the prices in force followed every swing. Live (2 Workers,
    multi-turn 48 chats × 6, 3 rounds an arm; BENCHMARKS.md "Token prices
    the Workers measure"): with the balance term priced when read
    (:class:`router.queue_priced.QueuePricedWork`) hit 0.907 with the
    history against 0.901 with the latest reports (configured 40 / 40:
    0.905), TTFT p99 0.303 against 0.398 s. The history alone, with work
    priced when booked, did not help (0.893): the priors' transient was
    the larger part.

    Invariants: both prices are finite and >= 0; with no report they are the
    configured ones; each replica holds at most ``history`` reports, all
    measured (busy price > 0).
    """

    def __init__(self, decode_token_cost: float, queue_token_cost: float, tolerance: float = 0.1,
                 history: int = 16) -> None:
        self._reports = PooledReports(history)
        self.decode_token_cost = float(decode_token_cost)
        self.queue_token_cost = float(queue_token_cost)
        self._tolerance = tolerance
        self.is_measured = False  # a replica has reported a measurement: the prices are no longer the priors


    def report(self, replica_id: str, decode_token_cost: float, queue_token_cost: float) -> bool:
        """Take a replica's measured prices; True when the prices in force changed."""
        if not decode_token_cost > 0:
            return False  # not measured yet
        self._reports.add(replica_id, decode_token_cost, queue_token_cost)
        self.is_measured = True  # for good: when every reporter leaves, the last prices stay in force
        return self._refresh()

    def remove(self, replica_id: str) -> bool:
        """Forget a replica's report; True when the prices in force changed."""
        return self._reports.remove(replica_id) and self._refresh()

    def _refresh(self) -> bool:
        medians = self._reports.medians()
        if medians is None:
            return False  # keep the last prices in force: the fleet's engines did not change
        decode, queue = medians
        if not (self._drifted(decode, self.decode_token_cost) or self._drifted(queue, self.queue_token_cost)):
            return False
        self.decode_token_cost, self.queue_token_cost = decode, queue
        return True

    def check_invariants(self, replica_ids) -> None:
        """The docstring's invariants; ``replica_ids``: the replicas the policy knows."""
        for price in (self.decode_token_cost, self.queue_token_cost):
            assert math.isfinite(price) and price >= 0, f"token price {price!r}"
        self._reports.check_invariants(replica_ids, lambda decode, queue: decode > 0 and queue >= 0, "prices")

    def _drifted(self, measured: float, in_force: float) -> bool:
        return abs(measured - in_force) > self._tolerance * max(in_force, 1.0)
