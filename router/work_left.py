"""How much work the request a one-at-a-time replica is serving has left, as
one router can tell.

A FIFO server's queue is the work of everything in it, and this router
books each request at its expected work when it sends it. The first in
line is the one running, and by the time the next request is placed it
may have done most of its work, or have run past the mean output length
and still be decoding. Output lengths are heavy-tailed (Mooncake: median
69 tokens, mean 149, p99 769), so a request that has decoded past the mean
is probably a long one with more to come. Pricing that request at its
booked work puts the next request behind a replica that is about to free
up, or next to one that will decode for seconds more.

:class:`WorkLeft` replaces the first request's booked work with an
estimate of what it has left, from three things a live router has:

- **when it started**: when this router sent it, or when the replica last
  finished one of this router's requests, whichever is later (FIFO: the
  oldest unfinished request is the one running). Only right where every
  request at the replica is this router's (one router);
- **how fast the replica works**: ``(num_prefill_tokens_total +
  decode_token_cost x num_output_tokens_total) / busy_s_total`` from each
  replica's latest summary (work tokens per busy second), the median over
  replicas that have been busy at least ``MIN_BUSY_S``;
- **how long outputs run**: the replicas' ``output_quantiles``, pooled.
  A request that has decoded ``k`` tokens has left the mean of the pooled
  points above ``k``, less ``k`` (the mean residual life; past every point,
  the pooled mean).

With ``elapsed x rate`` of work done against a booked prefill ``P``: in
prefill, ``P - done + queue_token_cost x mean output`` is left; decoding,
``queue_token_cost x residual(k)`` with ``k = (done - P) /
decode_token_cost``. Measured where it is used (FIFO replicas whose caches
have room, one router): BENCHMARKS.md "Work left at a FIFO server".

Invariants (:meth:`check_invariants`): only known replicas hold reports
and completion times; the pooled points are the sorted union of the
replicas' latest quantiles, with their suffix sums; the rate is the median
of the replicas' latest (None with none).
"""

from __future__ import annotations

import bisect
import itertools
import statistics
from collections.abc import Callable

from cache.summary import CacheSummary

MIN_BUSY_S = 1.0  # a replica's rate counts once it has been busy this long (its counters mean something)


class WorkLeft:
    """Per replica: its latest rate and output quantiles, and when this
    router last heard one of its requests complete there. A report that
    moves a replica's quantiles updates the pool there, off the decision
    path: its old points out and its new ones in (O(Q log P + P), Q points
    a report, P pooled, both in C but the Q steps) and the suffix sums
    again (O(P), in C). Every report moves a rate, and the median is taken
    then (O(R log R), R replicas). O(log P) per :meth:`head_left`
    otherwise (BENCHMARKS.md "The running request's work left, off the
    decision path", ``router.bench --fifo-room``)."""

    def __init__(self) -> None:
        self._rates: dict[str, float] = {}  # replica -> work tokens per busy second, by its counters
        self._quantiles: dict[str, tuple[int, ...]] = {}  # replica -> its latest non-empty output quantiles
        self._last_done: dict[str, float] = {}  # replica -> when this router last heard a completion there
        self._points: list[int] = []  # the replicas' quantile points, pooled, sorted
        self._suffix: list[int] = [0]  # _suffix[i] = sum(_points[i:])
        self._rate: float | None = None  # the median of _rates

    @property
    def is_ready(self) -> bool:
        """Whether some replica has reported a rate and output quantiles."""
        return bool(self._rates) and bool(self._quantiles)

    def report(self, summary: CacheSummary, decode_token_cost: float) -> None:
        """A replica's summary: its output quantiles and, once it has been
        busy ``MIN_BUSY_S``, its work rate (output tokens at ``decode_token_cost``)."""
        replica_id = summary.replica_id
        if summary.busy_s_total >= MIN_BUSY_S:
            work = summary.num_prefill_tokens_total + decode_token_cost * summary.num_output_tokens_total
            if work > 0:
                self._set_rate(replica_id, work / summary.busy_s_total)
        if summary.output_quantiles and self._quantiles.get(replica_id) != summary.output_quantiles:
            self._pool(replica_id, summary.output_quantiles)

    def on_completed(self, replica_id: str, now: float) -> None:
        """This router heard one of its requests at ``replica_id`` complete at ``now``."""
        self._last_done[replica_id] = max(now, self._last_done.get(replica_id, now))

    def remove(self, replica_id: str) -> None:
        self._set_rate(replica_id, None)
        self._last_done.pop(replica_id, None)
        self._pool(replica_id, ())

    def residual_output(self, decoded: float) -> float:
        """Expected output tokens still to come of a request that has
        decoded ``decoded``: the mean of the pooled points above it, less
        it; past every point (or with none), the pooled mean (0 with none)."""
        points = self._points
        if not points:
            return 0.0
        first = bisect.bisect_right(points, decoded)
        if first == len(points):
            return self._suffix[0] / len(points)
        return self._suffix[first] / (len(points) - first) - decoded

    def head_left(self, replica_id: str, booked_tokens: float, prefill_tokens: float, routed_at: float,
                  now: float, decode_token_cost: float, queue_token_cost: float) -> float:
        """Work (load units) the first request in line at ``replica_id`` has
        left: booked at ``booked_tokens`` of which ``prefill_tokens`` prefill,
        sent at ``routed_at``. ``booked_tokens`` until :attr:`is_ready`."""
        if not self.is_ready:
            return booked_tokens
        return self.view(now, decode_token_cost, queue_token_cost)(replica_id, prefill_tokens, routed_at)

    def view(self, now: float, decode_token_cost: float, queue_token_cost: float
             ) -> Callable[[str, float, float], float]:
        """:meth:`head_left` at ``now`` once :attr:`is_ready`, as ``left(replica_id,
        prefill_tokens, routed_at)``: what one moment shares (the rate, the
        pool) read once, for a decision that asks several replicas. Valid
        until the next report."""
        rate, last_done, residual = self._rate, self._last_done, self.residual_output
        mean_left = queue_token_cost * self._suffix[0] / len(self._points)  # the pooled mean output, all to come

        def left(replica_id: str, prefill_tokens: float, routed_at: float) -> float:
            started = last_done.get(replica_id, routed_at)
            elapsed = now - (started if started > routed_at else routed_at)
            done = elapsed * rate if elapsed > 0.0 else 0.0  # max(now - max(routed_at, last done), 0) x rate
            if done < prefill_tokens:
                return prefill_tokens - done + mean_left
            decoded = (done - prefill_tokens) / decode_token_cost if decode_token_cost > 0 else 0.0
            return queue_token_cost * residual(decoded)
        return left

    def _set_rate(self, replica_id: str, rate: float | None) -> None:
        """``replica_id``'s rate is now ``rate`` (None: it has none); the
        median follows, on the report path, not on a decision's."""
        if rate is None:
            self._rates.pop(replica_id, None)
        else:
            self._rates[replica_id] = rate
        self._rate = statistics.median(self._rates.values()) if self._rates else None

    def _pool(self, replica_id: str, quantiles: tuple[int, ...]) -> None:
        """``replica_id``'s points in the pool are now ``quantiles`` (``()``: none)."""
        points = self._points
        for point in self._quantiles.pop(replica_id, ()):
            del points[bisect.bisect_left(points, point)]
        if quantiles:
            self._quantiles[replica_id] = quantiles
            for point in quantiles:
                bisect.insort(points, point)
        self._suffix = list(itertools.accumulate(reversed(points), initial=0))[::-1]

    def check_invariants(self, replica_ids) -> None:
        known = set(replica_ids)
        assert set(self._rates) <= known and set(self._quantiles) <= known and set(self._last_done) <= known, \
            "a report or completion of an unknown replica"
        assert self._rate == (statistics.median(self._rates.values()) if self._rates else None), "rate not the median"
        assert self._points == sorted(p for points in self._quantiles.values() for p in points), "pool out of date"
        assert self._suffix == [sum(self._points[i:]) for i in range(len(self._points) + 1)], "suffix sums"
