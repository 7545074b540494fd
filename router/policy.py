"""The routing rule: prefill avoided against load, ring homes, bounded loads."""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterable

from router.cache_fill import FleetCacheFill
from router.cache_turnover import CacheTurnover
from router.candidates import Candidates, gather, within_block
from router.fetch import FetchHint, RoutingDecision
from router.fetch_cost import ReportedFetchCost
from router.load import LoadTracker
from router.output_estimate import OutputEstimate
from router.partial_blocks import PartialBlockIndex
from router.pending_blocks import PendingBlocks
from router.policy_bookings import RequestBookingMixin
from router.policy_config import PolicyConfig
from router.policy_new_holders import NewHoldersMixin
from router.policy_reports import ReplicaReportsMixin
from router.policy_scoring_terms import ScoringTermsMixin
from router.prefix_demand import PrefixDemand
from router.prefix_index import PrefixIndex
from router.queue_priced import QueuePricedWork
from router.replica_queueing import ReplicaQueueing
from router.request import RoutingRequest
from router.reported_busy import ReportedBusy
from router.reported_work import ReportedWork
from router.ring import HashRing
from router.router_share import RouterShare
from router.scoring import holder_premium
from router.summary_intake import SummaryIntake
from router.token_prices import ReportedTokenPrices
from router.work_left import WorkLeft

logger = logging.getLogger(__name__)


class PrefixAffinityPolicy(ReplicaReportsMixin, RequestBookingMixin, ScoringTermsMixin, NewHoldersMixin):
    """Send each request where its prefix is cached unless that costs more
    than it saves; place cold prefixes by a consistent hash ring; keep every
    replica's share of the work within a bound.

    For a request with chained block hashes ``h[0..n)`` and ``T`` prompt tokens:

    1. **Known prefix.** The :class:`PrefixIndex` (this router's decisions, corrected by replica summaries)
       gives ``m``, how many leading blocks some replica holds, and up to ``max_affinity_candidates``
       holders with their depth, deepest first. O(log n) lookups per holder depth (binary search over the
       chain), whatever the fleet or index size.
    2. **Ring home.** Key ``k = h[min(m, n-1)]``: the first block *past* what
       is cached anywhere. A prefix every request shares (a system prompt) is
       known after its first request, so the key reaches past it and each
       prompt's own part gets its own home; a cold prompt keys on its first
       block, so prompts sharing it meet on one replica, and every router agrees on where. The first
       ``num_ring_candidates`` distinct nodes from ``k`` compete (``num_cold_candidates`` for a cold prompt
       where caches have room), and so does the least loaded replica (O(√N): :class:`KeyedMin`).
    3. **Score** (lowest wins): ``cost(r) = load(r) + T - w(r) * cached(r)
       + balance_weight * (recent(r) - mean recent)``
       with ``cached(r) = min(depth(r) * block_size + within(r), T - 1)`` and
       ``w(r) = 1 + (affinity_weight - 1) * premium(r) / T``, ``premium(r)``
       the cached tokens each divided by the number of replicas the index
       knows to hold its block (``split_affinity_by_holders``;
       :func:`router.scoring.holder_premium`; off: ``cached(r)``). ``load`` is the
       work queued there (this router's in-flight requests, each weighing
       its uncached tokens + ``queue_decode_token_cost`` per expected output
       token, plus what the replica last reported beyond that; at a FIFO
       replica, while caches have room, its running request at what it has
       left: ``fifo_work_left``, :class:`WorkLeft`). Both token
       prices are what the replicas' engines measure (their summaries'
       ``decode_token_cost`` / ``queue_token_cost``, the median over the
       fleet; :class:`ReportedTokenPrices`), the configured ones only until
       a replica reports (``learn_token_costs``). The expected output is
       what the replicas observe, never the request's real length:
       the mean output length ``r`` reports in its summaries (its prefixes'
       applications), else the fleet's, capped by the request's
       ``max_tokens`` (``num_output_tokens``); ``prior_output_tokens`` until
       anyone reports. With ``w = 1`` the cost is the request's own time to first token; a deep match weighs up
       to ``affinity_weight`` times more, because keeping a conversation where
       its cache is saves that prefill for every later turn too, while a
       near-cold match (a few shared blocks) is placed by load. A part that
       ``h`` replicas hold earns ``1/h`` of that premium at each: its later
       requests spread over the ``h``, and it stays cached whichever of them
       (or another replica) takes this one; a prefix that drew more than
       ``hot_affinity_share`` of a replica's recent work per holder spreads
       anyway, so where a fetch pays its request weighs at
       ``hot_affinity_weight`` (5.5, not 16; :meth:`_affinity_weight`). With ``premium_needs_completion``
       (the default) blocks an in-flight request there has yet to compute
       earn no premium while a burst of this router's requests in flight
       (``premium_pending_min_users``, and more than one replica's share)
       waits on them and the caches have room (:class:`PendingBlocks`, weighed by
       :class:`FleetCacheFill`): a burst sharing a prefix nobody has computed
       yet spreads instead of following the first request. The balance
       term (recent work in busy-time units, ``decode_token_cost`` per output
       token; ``balance_output_price`` "queue": at ``queue_decode_token_cost``,
       scaled to busy-time units) pulls cold and lightly cached requests
       towards replicas whose share of recent work is below the mean: a
       replica whose prefixes are unpopular would otherwise idle (with output
       lengths only estimated, a replica serving short-output applications
       got 40 % less work on the Mooncake trace). ``balance_busy_share``
       (0.6) of that measure is the replica's recent busy time as this
       router saw it, the union of its requests' spans from routed to
       completed (:class:`router.busy_spans.BusySpans`), scaled to work
       units: under batching overlapping requests share their steps, so the
       work a replica took says little about how long it was busy, and its
       spans do. Where a cache is full and its replica serves one request
       at a time, each uncached token it would write costs
       ``turnover_weight x pressure x (written / mean - 1)`` (a credit
       below the mean only for a cold request): a cache written faster
       than the fleet's mean evicts what was used more recently
       (:class:`CacheTurnover`, :meth:`_turnover_price`); at a batching
       replica only that credit counts (``batching_turnover_credit``). At a
       replica serving one at a time a
       cold request's queue weighs ``1 + cold_queue_weight``: it gains no
       cache anywhere, and waits for all of the queue.
       Ties (idle replicas for a cold prompt) go in ring order from ``k`` (a
       pure function of the replica set: every router homes a cold prefix on
       the same replica, and cold prefixes spread by hash), then by a
       rendezvous hash of (k, replica); ``tie_by_recent_work``: this router's
       recent work first (the old rule; routers' histories disagree).
       ``within(r)``: block ``m``'s tokens shared with the previous prompt's
       partial last block at its replica (:mod:`router.candidates`).
    4. **Bounded load.** A replica whose recent work (routed work decayed over
       ``load_window_s``) exceeds ``load_factor`` × the mean, plus one
       request's work, plus ``load_slack_sd × cached(r) / T`` standard
       deviations of chance imbalance, is not eligible. The chance term is
       how far from the mean a replica's recent work lands if the same
       requests had been spread uniformly at random
       (``sqrt(Σ d_i² w_i² (N-1)) / N``, :meth:`LoadTracker.chance_sd`):
       an imbalance that small is no evidence that the replica's prefixes
       are hotter than its share, and spilling a cached prefix costs its
       re-prefill and a second copy. It shrinks relative to the mean as
       work accumulates (∝ 1/√requests), so a persistent imbalance still
       spills; a cold request (nothing cached there) gets no chance slack,
       since placing it elsewhere costs nothing. If no candidate is
       eligible, the ring walk from ``k`` continues to the first eligible
       node — the spill target, which then warms and joins the holders, so
       a hot prefix replicates in proportion to its load.
    5. **Fetch** (``fetch_enabled``, :mod:`router.fetch`). A first choice
       that is not the deepest holder (the owner) and lacks more than
       ``fetch_min_tokens`` of its prefix is hinted to fetch (the receiver
       decides if that pays). By default (``fetch_credit_scope`` "never")
       steps 1–4 are unchanged: the hint rides on the no-fetch decision (an
       owner over the bound or far more queued), booked as without fetch.
       "over_bound" (while the owner is over the bound) or "always": a
       candidate lacking those tokens counts them saved at ``1 -
       fetch_token_cost`` (a share ``fetch_affinity_share`` weighed like
       cached ones, ``w``), booked at that cost. Owners are in-tenant (salt).
       **Hot prefixes** (``replicate_hot_prefixes``, the default): where the
       request's known prefix (its first ``m`` blocks) drew, per replica
       holding it, more than ``hot_prefix_share`` of a replica's mean recent
       work (:class:`PrefixDemand`: the work routed to requests reusing it,
       decayed over ``load_window_s``), a candidate whose cache had room at
       its last report for ``replica_room_factor`` x the copy weighs the
       fetchable tokens as if cached, less what the fetch costs
       (:class:`ReportedFetchCost`: the replicas' measured bandwidth, fixed
       cost and prefill rate, ``fetch_token_cost`` until they report), if a
       fetch costs at most ``max_replica_fetch_cost`` of a recompute
       (whatever the scope; booked as without fetch): the lighter of the
       holders and would-be holders takes it, and a hot prefix gains fetched holders while its
       holders' queues are within the bound, instead of queueing at its
       home until the bound spills it (re-prefilled). A copy that would
       evict (no room) is not offered: it may take a prefix's only copy.
       **Backup hints** (``backup_fetch_hints``): a first choice among the
       deepest holders (or short of them by at most ``fetch_min_tokens``)
       is hinted to the deepest other holder, so a copy evicted since its last report is fetched back,
       not recomputed (a receiver that still holds it ignores the hint); the within-block replica knowing
       more than either is hinted instead (:func:`router.fetch.within_block_hint`). Every other hint names
       up to ``fetch_alternates`` more holders, asked in turn when the owner has
       evicted the prefix. **Queued copies** (``queue_copy_requests``, 1):
       where every holder candidate has more than that many typical
       requests' work queued, and ``queue_copy_size_factor`` x the copy's
       tokens, a candidate at least ``queue_copy_gap_requests`` lighter with
       room for ``queue_copy_room_factor`` x the copy is credited as a hot
       prefix's would-be holder (gated: :meth:`_holders_queued`).
    6. **Answer.** Up to ``num_ranked`` replicas, best first; the caller
       falls back to the next when the first is full. Given a
       ``request_id``, the first choice is *reserved* at once (its work
       counted, its blocks learned): Ray Serve reports a request routed only
       after the replica accepted it, and a burst of decisions made before
       that (a closed-loop client's next wave) would otherwise all see the
       same loads and send every cold prefix to its ring home.
       :meth:`on_routed` confirms the reservation or moves it; one never
       confirmed within ``reservation_timeout_s`` is forgotten.

    7. **Several routers.** Each ingress router sees only its own decisions
       and completions, plus every summary. :class:`RouterShare` reads how
       many routers share the traffic from the replicas' output counters
       (1 below a ratio of 1.5, so a lone router is untouched); with K of
       them this router's recent-work deviations are ~1/K of the real ones,
       so the balance term is scaled by K (``balance_fleet_scale``). With
       K > 1 its busy part is each replica's busy-time counter (its summaries'
       ``busy_s_total``, once every replica's has moved) plus this router's
       spans since (``busy_from_reports``, :class:`ReportedBusy`), at
       ``reported_busy_share`` (0.8): a router's own spans cover ~1/K of a
       replica's busy time, the counter all of it, alike for every router.
       Another router's shared decision is queued work at its replica until
       that replica reports (``peer_queue_until_report``). Off, measured
       (BENCHMARKS.md "Several ingress routers"): ``load_peer_estimate``,
       ``drain_foreign_load``, ``bound_fleet_scale`` and ``cold_home``.

    Defaults and why, measured: BENCHMARKS.md, "Router policy defaults".
    What it avoids (shared system prompts, cold misses piling up, herding
    routers): router/README.md, "What the policy avoids".

    Bad input never raises: a request without usable routing attributes, an
    empty candidate list, a replica that vanished, malformed or missing
    stats all end in the least loaded candidate (or no answer for no
    candidates) and a log line.

    Invariants (checked by :meth:`check_invariants`): the ring and the load
    tracker know exactly the same replicas; the index and the summary
    versions know no replica off the ring.
    """

    def __init__(self, config: PolicyConfig | None = None, clock: Callable[[], float] | None = None) -> None:
        if clock is None:
            raise ValueError("PrefixAffinityPolicy needs a clock (inject time.monotonic or a fake)")
        self.config = config if config is not None else PolicyConfig()
        self._clock = clock
        self._ring = HashRing(virtual_nodes=self.config.virtual_nodes)
        self._index = PrefixIndex(self.config.max_blocks_per_replica, self.config.learned_grace_s)
        self._loads = LoadTracker(self.config.in_flight_timeout_s, self.config.load_window_s,
                                  self.config.reservation_timeout_s, track_busy=self.config.balance_busy_share > 0,
                                  num_parts=2 if QueuePricedWork.keeps(self.config) else 0)
        grain = self.config.within_block_tokens
        self._partial = (PartialBlockIndex(self.config.block_size, grain, self.config.max_partial_entries)
                         if grain else None)
        self._intake = SummaryIntake()
        self._outputs = OutputEstimate(self.config.prior_output_tokens)
        self._reported = ReportedWork(self.config.load_window_s, self.config.decode_token_cost,
                                      self.config.queue_token_cost)
        self._busy_reports = ReportedBusy(self.config.load_window_s)
        self._turnover = CacheTurnover(self.config.load_window_s)  # tokens written into each cache lately
        self._typical_work = float(self.config.block_size)  # work of a request, moving average
        self._typical_queued = float(self.config.block_size)  # its queued work (the load's units), likewise
        self._share = RouterShare(self.config.load_window_s)
        self._pending = PendingBlocks(self.config.in_flight_timeout_s)  # premium_needs_completion
        self._fill = FleetCacheFill()  # premium on pending blocks withheld; a new holder's room (kept for those)
        self._queueing = ReplicaQueueing()  # whether a holder queues what it has in flight (queued copies)
        self._demand = PrefixDemand(self.config.load_window_s, self.config.max_demand_entries)  # hot prefixes
        self._fetch_cost = ReportedFetchCost(self.config.fetch_token_cost, history=self.config.price_history)
        self._queue_priced = QueuePricedWork(self.config, self._loads)  # the balance term's measure under "queue"
        self._prices = ReportedTokenPrices(self.config.decode_token_cost, self.config.queue_token_cost,
                                           history=self.config.price_history)
        self._work_left = WorkLeft()  # fifo_work_left: what a FIFO replica's running request has left

    # ------------------------------------------------------------------ replicas
    @property
    def replica_ids(self) -> frozenset[str]:
        return self._ring.nodes

    @property
    def ring(self) -> HashRing:
        return self._ring

    @property
    def index(self) -> PrefixIndex:
        return self._index

    @property
    def loads(self) -> LoadTracker:
        return self._loads

    def set_replicas(self, replica_ids: Iterable[str]) -> None:
        """Make the replica set exactly ``replica_ids`` (joins and leaves at once)."""
        wanted = set(replica_ids)
        for replica_id in self._ring.nodes - wanted:
            self.remove_replica(replica_id)
        for replica_id in sorted(wanted - self._ring.nodes):
            self.add_replica(replica_id)

    def add_replica(self, replica_id: str) -> None:
        self._ring.add(replica_id)
        self._loads.add_replica(replica_id)

    def remove_replica(self, replica_id: str) -> None:
        """Forget ``replica_id``: off the ring, out of the index, its load dropped."""
        self._ring.remove(replica_id)
        self._index.remove_replica(replica_id)
        self._loads.remove_replica(replica_id)
        self._pending.remove_replica(replica_id)
        self._fill.remove(replica_id)
        self._queueing.remove(replica_id)
        self._fetch_cost.remove(replica_id)
        self._intake.remove(replica_id)
        self._outputs.remove(replica_id)
        self._reported.remove(replica_id)
        self._turnover.remove(replica_id)
        self._busy_reports.remove(replica_id)
        self._share.remove(replica_id)
        self._work_left.remove(replica_id)
        if self._prices.remove(replica_id):
            self._reprice()

    # ------------------------------------------------------------------ routing
    def rank(self, request: object, candidate_ids: Collection[str] | None = None,
             request_id: str | None = None) -> list[str]:
        """Replicas to try for ``request``, best first (at most ``num_ranked``):
        ``decide(...).ranked``. Never raises."""
        return list(self.decide(request, candidate_ids, request_id).ranked)

    def decide(self, request: object, candidate_ids: Collection[str] | None = None,
               request_id: str | None = None) -> RoutingDecision:
        """Replicas to try for ``request``, best first (at most ``num_ranked``),
        and the fetch hint for the first choice (step 5).

        ``request``: a :class:`RoutingRequest` or any object with its
        attributes. ``candidate_ids``: replicas the caller can reach now
        (default: all known). ``request_id``: when given, the first choice is
        reserved at once (its work counted — less what the hint saves where
        the fetch credit chose it, step 5 — and its blocks learned), so the
        next decision sees it even if :meth:`on_routed` comes later. Never raises.
        """
        ranked, fetch, num_booked, found = self._decide_any(request, candidate_ids)
        if request_id is not None and ranked:
            self._count(request, ranked[0], request_id, reserve=True, num_fetched_tokens=num_booked, found=found)
        return RoutingDecision(tuple(ranked), fetch)

    def _decide_any(self, request: object, candidate_ids: Collection[str] | None
                    ) -> tuple[list[str], FetchHint | None, int, Candidates | None]:
        live: Collection[str] = self._ring.nodes if candidate_ids is None else (
            candidate_ids if isinstance(candidate_ids, (set, frozenset, dict)) else set(candidate_ids))
        if not live:
            logger.warning("no candidate replicas to route to")
            return [], None, 0, None
        try:
            routing = RoutingRequest.from_object(request)
        except ValueError as error:
            logger.warning("request without usable routing attributes (%s); least loaded fallback", error)
            return self._least_loaded(live), None, 0, None
        ranked, fetch, num_booked, found = self._rank(routing, live)
        if not ranked:
            logger.warning("no candidate among %d replicas is on the ring; least loaded fallback", len(live))
            return self._least_loaded(live), None, 0, None
        return ranked, fetch, num_booked, found

    # ----------------------------------------------------------------- private
    def _rank(self, request: RoutingRequest, live: Collection[str]
              ) -> tuple[list[str], FetchHint | None, int, Candidates]:
        config, loads, room = self.config, self._loads, self._placement_evicts_nothing(request)
        found = gather(request, live, self._index, self._ring, loads, self._partial, config.block_size,
                       config.max_affinity_candidates, config.num_ring_candidates, config.split_affinity_by_holders,
                       config.num_cold_candidates if room else None)
        now = self._clock()
        scoring = self._scoring(request, now, room)
        if found.holder_levels:
            scoring.premium = holder_premium(found.holder_levels, config.block_size)
        if len(self._pending) and self._fill.pressure < 1.0:
            scoring.computed = self._computed_view(request, found)
        plan = self._fetch_plan(request, found, scoring)
        draw = self._prefix_draw(request, found, now) if plan is not None else None  # its demand, its holders
        scoring.affinity_weight = self._affinity_weight(draw, scoring.mean_recent, plan)
        credit = plan.credit if plan is not None and plan.credit_open else None  # saved by a fetch
        may_hold = None  # who may gain a holder of the prefix: a hot prefix, or one queued at every holder
        if credit is None and plan is not None:
            if self._is_hot(draw, scoring.mean_recent):
                may_hold = self._has_room
            elif (holders_load := self._holders_queued(request, found, scoring)) is not None:
                may_hold = self._queue_copy_target(holders_load, scoring)
        if may_hold is not None and (cost := self._paying_fetch_cost(plan)) is not None:
            credit = plan.replica_credit(may_hold, cost)  # it may gain a holder
            scoring.fetch_share = 1.0 / (1.0 - cost)  # saved = every fetched token, its cost charged once
        scored, cached_at = scoring.order(found, config.block_size, credit)  # steps 3-4
        ranked = [entry[-1] for entry in scored if not entry[0]]
        if not ranked:  # every candidate is over the bound: spill along the ring
            bound = scoring.bound(None, 0)
            for replica_id in found.ring_walk:
                if (replica_id in live and replica_id not in found.depths
                        and loads.recent_work(replica_id, now) <= bound):
                    ranked.append(replica_id)
                    break
            ranked.extend(entry[-1] for entry in scored)  # then the rest, by cost
        if config.cold_home != "cost" and ranked:
            ranked = self._home_first(request, found, live, cached_at, ranked, now)
        ranked = ranked[: config.num_ranked]
        hint, num_booked = self._first_hint(request, plan, ranked, cached_at, found)
        return ranked, hint, num_booked, found

    def _cached_tokens(self, request: RoutingRequest, depth: int, within: int = 0) -> int:
        return max(0, min(depth * self.config.block_size + within, request.num_prompt_tokens - 1))

    def _work_tokens(self, request: RoutingRequest, cached: int, replica_id: str | None = None,
                     decode_token_cost: float | None = None) -> float:
        """Prefill-token equivalents of ``request`` on ``replica_id``: its
        uncached prompt plus its expected output at ``decode_token_cost``
        (default the config's: busy time; the queue's price for load)."""
        if decode_token_cost is None:
            decode_token_cost = self.config.decode_token_cost
        expected = self._outputs.expected(request.num_output_tokens, replica_id)
        return request.num_prompt_tokens - cached + decode_token_cost * expected

    def _within_block(self, request: RoutingRequest, depth: int) -> tuple[str, int] | None:
        return within_block(self._partial, self._index, self._ring, request, depth, self.config.block_size)

    def check_invariants(self) -> None:
        self._ring.check_invariants()
        self._index.check_invariants()
        self._loads.check_invariants()
        if self._partial is not None:
            self._partial.check_invariants()
        nodes = self._ring.nodes
        assert set(self._loads.replica_ids) == nodes, (set(self._loads.replica_ids), nodes)
        self._queue_priced.check_invariants()
        self._pending.check_invariants()
        self._fill.check_invariants()
        self._queueing.check_invariants()
        self._demand.check_invariants()
        self._busy_reports.check_invariants()
        self._turnover.check_invariants()
        self._fetch_cost.check_invariants(nodes)
        self._work_left.check_invariants(nodes)
        self._prices.check_invariants(nodes)
        assert (self.config.decode_token_cost, self.config.queue_token_cost) == (
            self._prices.decode_token_cost, self._prices.queue_token_cost) or not self.config.learn_token_costs, \
            "the prices in force differ from the learned ones"
        assert set(self._index.replica_ids) <= nodes, "index knows a replica off the ring"
        assert self._intake.replica_ids <= nodes, "summary version of a replica off the ring"
        self._intake.check_invariants()

