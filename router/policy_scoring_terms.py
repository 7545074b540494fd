"""Steps 3–4's terms as :class:`router.policy.PrefixAffinityPolicy` reads
them from its state for one decision: the :class:`Scoring` it builds, the
blocks the affinity premium counts (``premium_needs_completion``), the price
of writing into a cache that turns over fast, the queued work and the number
of routers with several routers; the cold home and the least loaded
fallback."""

from __future__ import annotations

from collections.abc import Callable, Collection

from router.candidates import Candidates
from router.cold_home import home_first
from router.decision_memo import PerReplica
from router.request import RoutingRequest
from router.scoring import Scoring


class ScoringTermsMixin:
    """The scoring-terms part of :class:`router.policy.PrefixAffinityPolicy`
    (mixed into it, never used alone): reads the components the policy
    creates (``_loads``, ``_ring``, ``_reported``, ``_queue_priced``,
    ``_outputs``, ``_pending``, ``_fill``, ``_share``, ``_turnover``,
    ``_queueing``, ``_index``, ``_partial``, and for
    :meth:`routing_status` ``_intake``, ``_index``, ``_busy_reports``,
    ``_prices``); changes nothing."""

    def _scoring(self, request: RoutingRequest, now: float, room: bool = False) -> Scoring:
        """Steps 3-4's terms for ``request`` now, with the several-routers knobs
        applied; ``room``: :meth:`_placement_evicts_nothing`."""
        config, loads, ring = self.config, self._loads, self._ring
        mean_recent = loads.recent_total(now) / max(len(ring), 1)
        chance_sd = loads.chance_sd(now)
        routers = (self._routers_seen(now) if config.balance_fleet_scale or config.load_peer_estimate
                   or config.bound_fleet_scale else 1.0)
        peers = routers - 1.0 if config.load_peer_estimate else 0.0  # others' work since the last report
        shared = config.balance_from_reports and all(r in self._reported for r in ring.nodes)
        if shared:
            balance_work, mean_balance = (lambda r: self._reported.value(r, now)), self._reported.mean(ring.nodes, now)
        else:  # None: the balance term reads recent work itself
            balance_work, mean_balance = self._queue_priced.view(now, mean_recent, len(ring)), mean_recent
        if config.balance_busy_share > 0:
            balance_work, mean_balance = self._with_busy(balance_work, mean_balance, mean_recent, now)
        # ~1/K of the real deviations, unless the others' decisions are booked here too
        balance = config.balance_weight * (routers if config.balance_fleet_scale
                                           and not self._share.sees_peers(now) else 1.0)
        load = self._load_view(now, peers) if peers or config.drain_foreign_load else loads.load
        return Scoring(
            config, request.num_prompt_tokens, request.num_output_tokens, mean_recent, chance_sd, max(len(ring), 1),
            one_request=1.0 / routers if config.bound_fleet_scale else 1.0,  # this router's view is ~1/K of the work
            balance=balance, mean_balance=mean_balance,
            dead=config.balance_dead_sd * chance_sd,  # deviations chance explains count for nothing
            load=self._load_left(load, now) if room and config.fifo_work_left else load,
            recent=loads.recent_view(now), expected_output=self._outputs.expected,
            balance_work=balance_work, turnover=self._turnover_price(now), cold_queue=self._cold_queue_weight(),
            cold_balance=balance * config.cold_balance_share if room else None)

    def _placement_evicts_nothing(self, request: RoutingRequest) -> bool:
        """Whether placing ``request`` decides its wait and nothing else, as
        far as this router can tell: it is the one router (every request in
        flight is its own), every cache had room at its last report for
        twice the request's prompt (a placement evicts nothing), and the
        replicas have reported their rates and output quantiles
        (:class:`WorkLeft`: what a running request has left). Then
        ``fifo_work_left`` prices a FIFO replica's running request at what
        it has left, and a cold request weighs every replica's queue
        (``num_cold_candidates``, ``cold_balance_share``). O(1) but after
        the least free cache's report."""
        if not (self._work_left.is_ready and not self._shares_traffic()):
            return False
        free = self._fill.min_free_tokens()  # kept: O(replicas) only after the least one's report
        return free is not None and free >= 2 * request.num_prompt_tokens

    def _load_left(self, load: Callable[[str], float], now: float) -> Callable[[str], float]:
        """``load`` with the request a FIFO replica runs (this router's
        first in flight there, :meth:`ReplicaQueueing.serves_one_at_a_time`)
        at what it has left (:class:`WorkLeft`) instead of its booked work:
        for a decision where ``fifo_work_left`` is on and
        :meth:`_placement_evicts_nothing`. O(1) per replica asked, once a
        decision."""
        config, work_left = self.config, self._work_left
        one_at_a_time, expected = self._queueing.serves_one_at_a_time, self._outputs.expected
        first_in_flight, queue_cost = self._loads.first_in_flight, config.queue_token_cost
        left = work_left.view(now, config.decode_token_cost, queue_cost)

        def load_left(replica_id: str) -> float:
            entry = first_in_flight(replica_id) if one_at_a_time(replica_id) else None
            if entry is None:
                return load(replica_id)
            # booked as prefill + output at min(max_tokens, mean): a lower cap reads as less prefill here
            prefill = entry.num_tokens - queue_cost * expected(None, replica_id)
            value = load(replica_id) - entry.num_tokens + left(replica_id, prefill if prefill > 0.0 else 0.0,
                                                               entry.routed_at)
            return value if value > 0.0 else 0.0  # max(value, 0.0)
        return PerReplica(load_left).__getitem__  # a decision asks a replica's load several times

    def _cold_queue_weight(self) -> Callable[[str], float] | None:
        """Step 3's extra weight on a cold request's queue (``cold_queue_weight``)
        at a replica that serves one request at a time
        (:meth:`ReplicaQueueing.serves_one_at_a_time`), 0 at another; None while off."""
        weight = self.config.cold_queue_weight
        if not weight > 0:
            return None
        one_at_a_time = self._queueing.serves_one_at_a_time
        return lambda replica_id: weight if one_at_a_time(replica_id) else 0.0

    def _turnover_price(self, now: float) -> Callable[[str], float] | None:
        """Step 3's turnover term per token written (``turnover_weight``):
        ``replica -> turnover_weight x pressure x (written / mean - 1)``
        (:class:`CacheTurnover`; ``pressure``: :class:`FleetCacheFill`, the
        fleet's share of full caches) for a replica that serves one request
        at a time (:meth:`ReplicaQueueing.serves_one_at_a_time`); for
        another only a price below 0 (which counts for a cold request
        alone: :meth:`Scoring.order`) with ``batching_turnover_credit``,
        else 0. None while off, while no cache is full, or until every
        replica has reported its counters."""
        weight = self.config.turnover_weight * self._fill.pressure
        if not weight > 0:
            return None
        relative = self._turnover.relative(len(self._ring), now)
        if relative is None:
            return None
        one_at_a_time, credit_anywhere = self._queueing.serves_one_at_a_time, self.config.batching_turnover_credit

        def price(replica_id: str) -> float:
            value = weight * relative(replica_id)
            return value if one_at_a_time(replica_id) or (credit_anywhere and value < 0.0) else 0.0
        return price

    def _home_first(self, request: RoutingRequest, found, live: Collection[str], cached_at: dict[str, int],
                    ranked: list[str], now: float) -> list[str]:
        """``ranked`` with the cold home first when the request is cold (:func:`home_first`)."""
        def cached_there(replica_id: str) -> int:
            within = found.within_tokens if replica_id == found.within_replica else 0
            return self._cached_tokens(request, self._index.depth(replica_id, request.block_hashes), within)
        return home_first(self.config.cold_home, self._ring, found.key, live, self._reported, now,
                          self.config.cold_home_load_factor, self._work_tokens(request, 0), cached_at,
                          cached_there, ranked)

    def _least_loaded(self, live: Collection[str]) -> list[str]:
        now = self._clock()
        ordered = sorted(live, key=lambda r: (self._loads.load(r), self._loads.recent_work(r, now), r))
        return ordered[: self.config.num_ranked]

    def _with_busy(self, balance_work: Callable[[str], float] | None, mean_balance: float, mean_recent: float,
                   now: float) -> tuple[Callable[[str], float] | None, float]:
        """The balance term's measure with ``balance_busy_share`` of it the
        replicas' recent busy time as this router saw it (:class:`BusySpans`),
        scaled so its mean is ``mean_recent``: its deviations are in work
        units like the rest. Unchanged before any busy time."""
        busy, mean_busy = self._loads.busy_view(now)
        share = self.config.balance_busy_share
        if self._reads_busy_counters(now):
            busy, mean_busy = self._busy_reports.view(now, busy, mean_busy)
            share = self.config.reported_busy_share
        if not mean_busy > 0:
            return balance_work, mean_balance
        work = balance_work if balance_work is not None else self._loads.recent_view(now)
        scale = share * mean_recent / mean_busy
        return (lambda replica_id: (1.0 - share) * work(replica_id) + scale * busy(replica_id),
                (1.0 - share) * mean_balance + share * mean_recent)

    def _computed_view(self, request: RoutingRequest, found: Candidates) -> Callable[[str, int], float]:
        """(replica, cached tokens) -> those the affinity premium counts there
        (``premium_needs_completion``): all, unless an in-flight request there
        still computes some of the matched blocks *and* the in-flight requests
        there waiting on the first of them are at least ``premium_pending_min_users`` and more than one
        replica's share of this router's requests in flight (the prefix's
        demand is more than one replica should carry: it will need a second
        copy anyway). Then the leading computed blocks count, plus the pending
        rest weighed by the fleet's cache pressure (:class:`FleetCacheFill`:
        while caches have room a second copy of a prefix nobody has computed
        yet costs only its prefill; once they are full it evicts, and the
        premium holds as before). A within-block match counts whole only
        behind a computed chain."""
        pending, hashes, block_size = self._pending, request.block_hashes, self.config.block_size
        pressure, min_users = self._fill.pressure, self.config.premium_pending_min_users
        share = (self._loads.num_in_flight() + 1) / max(len(self._ring), 1)  # one replica's share in flight

        def computed(replica_id: str, cached: int) -> float:
            if not pending.has_pending(replica_id):
                return cached
            depth = found.depths.get(replica_id, 0)
            done = pending.computed_depth(replica_id, hashes, depth)
            if done == depth:
                return cached
            users = pending.users(replica_id, hashes[done])
            if users < min_users or users <= share:
                return cached  # one replica can take what waits on it: it keeps its premium
            done_tokens = min(cached, done * block_size)
            return done_tokens + pressure * (cached - done_tokens)
        return computed

    def _load_view(self, now: float, peers: float) -> Callable[[str], float]:
        """Queued work as this router estimates it with several routers: its
        own in flight, plus the others' as last reported (drained since at the
        fastest rate a replica was seen to work, with ``drain_foreign_load``),
        plus ``peers`` × what it sent since that report (the other routers,
        seeing alike traffic, likely sent as much each)."""
        loads, reported = self._loads, self._reported
        drain_rate = reported.peak_rate(now) if self.config.drain_foreign_load else 0.0
        def load(replica_id: str) -> float:
            drained = min(loads.foreign(replica_id), drain_rate * reported.age(replica_id, now)) if drain_rate else 0.0
            return loads.load(replica_id) - drained + peers * reported.pending(replica_id)
        return load

    def routing_status(self) -> dict:
        """What this router reads now, for an operator (the Ingress's
        ``/stats``): the replicas it routes over and how many of them have
        reported a summary, the blocks its index holds, how many routers it
        reads sharing the traffic (:class:`RouterShare`), where the balance
        term's busy time comes from (``replica_counters`` with several
        routers once every replica's counter moved, ``own_spans``, or
        ``off``), the token prices in force and whether a replica measured
        them, its requests in flight, and the other routers' decisions it has
        booked (``peer_decisions``: ``router.serve_decisions``). Plain JSON
        values; changes nothing."""
        now = self._clock()
        nodes = self._ring.nodes
        if not self.config.balance_busy_share > 0:
            busy_source = "off"
        else:
            busy_source = "replica_counters" if self._reads_busy_counters(now) else "own_spans"
        return {
            "replicas": len(nodes),
            "replicas_reporting": len(nodes & self._intake.replica_ids),
            "index_blocks": sum(self._index.num_blocks(r) for r in nodes),
            "routers_seen": round(self._routers_seen(now), 2),
            "balance_busy_source": busy_source,
            "decode_token_cost": round(self.config.decode_token_cost, 3),
            "queue_token_cost": round(self.config.queue_token_cost, 3),
            "token_costs_measured": self._prices.is_measured,
            "in_flight": self._loads.num_in_flight(),
            "peer_decisions": self._share.num_peer_decisions,
        }

    def _reads_busy_counters(self, now: float) -> bool:
        """The balance term's busy time is the replicas' own counters
        (:class:`ReportedBusy`): ``busy_from_reports``, every replica's
        counter has moved, and other routers share the traffic."""
        return (self.config.busy_from_reports and self._busy_reports.num_counting == len(self._ring)
                and self._routers_seen(now) > 1.0)

    def _routers_seen(self, now: float) -> float:
        """How many routers share the traffic (:class:`RouterShare`, >= 1):
        this router's balance deviations are ~1/that of the real ones."""
        return self._share.routers(now, self._outputs.expected(None))
