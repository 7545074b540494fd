"""Step 5's new holders for :class:`router.policy.PrefixAffinityPolicy`:
whether a request's prefix may gain a holder that fetches it (a hot prefix,
or one queued at every holder) and which replica has room for the copy;
step 3's lighter affinity weight for a prefix in demand beyond its holders;
and whether a hint's owner still computes the prefix it names."""

from __future__ import annotations

from collections.abc import Callable

from router.candidates import Candidates
from router.decision_memo import PerReplica
from router.fetch import FetchHint, FetchPlan, within_block_hint
from router.request import RoutingRequest
from router.scoring import Scoring


class NewHoldersMixin:
    """The new-holder part of :class:`router.policy.PrefixAffinityPolicy`
    (mixed into it, never used alone): reads the components the policy
    creates (``_index``, ``_demand``, ``_fill``, ``_fetch_cost``,
    ``_pending``, ``_queueing``, ``_share``) and its moving average of a request's
    queued work (``_typical_queued``); changes nothing."""

    def _prefix_draw(self, request: RoutingRequest, found: Candidates, now: float) -> tuple[float, int]:
        """``(demand, holders)`` of the request's known prefix (its first
        ``m`` blocks): the recent work it drew, and the replicas known to
        hold it (at least 1); ``(0.0, 1)`` when no block of it is known,
        neither rule that reads it is on, it drew nothing, or every holder
        still computes it (:meth:`_computed_somewhere`; only with
        ``fetch_awaits_prefill`` off). Looked up once per
        decision, for :meth:`_is_hot` and :meth:`_affinity_weight`."""
        config = self.config
        if found.num_known <= 0 or not (config.replicate_hot_prefixes or config.hot_affinity_weight is not None):
            return 0.0, 1
        key = request.block_hashes[found.num_known - 1]
        demand = self._demand.value(key, now)
        if not demand > 0:
            return 0.0, 1
        if not config.fetch_awaits_prefill and not self._computed_somewhere(request, found):  # only where it matters
            return 0.0, 1
        return demand, max(self._index.num_holders(key), 1)

    def _computed_somewhere(self, request: RoutingRequest, found: Candidates) -> bool:
        """Whether some replica known to hold the request's known prefix has
        computed all of it: no request this router sent there still
        computes one of its blocks (:class:`PendingBlocks`). A replica
        exports only what its prefill has computed, so a prefix still in
        the works at every holder would be recomputed by a new one, unless
        the Workers' fetch waits for it (``fetch_awaits_prefill``, the
        default: ``ExportRequest.wait_s``), when this gate is off."""
        pending, hashes, known = self._pending, request.block_hashes, found.num_known
        return any(not pending.computes(r, hashes, known) for r, depth in found.depths.items() if depth >= known)

    def _first_hint(self, request: RoutingRequest, plan: FetchPlan | None, ranked: list[str],
                    cached_at: dict[str, int], found: Candidates) -> tuple[FetchHint | None, int]:
        """The first choice's hint (step 5; None with fetch off or no choice)
        and the tokens its reservation books fetched (:meth:`FetchPlan.booked_tokens`).
        Where the replica holding the prompt's partial block knows more, the
        hint names it instead (:func:`within_block_hint`), which books and
        ranks nothing differently: it only adds a hint. Marked when its owner
        still computes the prefix (:meth:`_marked_computing`)."""
        if plan is None or not ranked:
            return None, 0
        first, within = ranked[0], found.within_replica
        cached = cached_at.get(first, 0)
        hint = plan.hint(first, cached, self.config.backup_fetch_hints)
        better = hint if within is None or within == first else within_block_hint(
            hint, plan.held(first, cached), within, cached_at.get(within, 0), self.config.fetch_min_tokens)
        return self._marked_computing(request, better), plan.booked_tokens(hint)

    def _marked_computing(self, request: RoutingRequest, hint: FetchHint | None) -> FetchHint | None:
        """``hint`` with ``owner_computing`` set when a request this router sent
        to the owner still computes one of the hinted blocks there
        (:class:`PendingBlocks`; tracked with ``premium_needs_completion``)."""
        if hint is None or not self._pending.computes(hint.owner, request.block_hashes,
                                                      hint.num_tokens // self.config.block_size):
            return hint
        return FetchHint(hint.owner, hint.num_tokens, hint.alternates, True)  # not replace(): 1.7 x the cost

    def _is_hot(self, draw: tuple[float, int], mean_recent: float) -> bool:
        """Whether the known prefix (``draw``: :meth:`_prefix_draw`) drew, per
        replica known to hold it, more than ``hot_prefix_share`` of a
        replica's mean recent work (``replicate_hot_prefixes``; step 5)."""
        demand, holders = draw
        return self.config.replicate_hot_prefixes and demand > self.config.hot_prefix_share * mean_recent * holders

    def _affinity_weight(self, draw: tuple[float, int] | None, mean_recent: float, plan: FetchPlan | None) -> float:
        """The affinity weight for this request (step 3's ``w``):
        ``hot_affinity_weight`` (at most ``affinity_weight``) when its known
        prefix (``draw``: :meth:`_prefix_draw`) drew, per replica known to
        hold it, more than ``hot_affinity_share`` of a replica's mean recent
        work, and the replicas report that fetching it pays
        (:meth:`_paying_fetch_cost`); else ``affinity_weight``. Such a prefix
        is in demand beyond what its holders serve, so its later requests
        spread whatever this one does: a holder's claim on them, which the
        premium stands for, is weak, and a lighter replica that takes this
        one fetches the prefix with the hint. Where fetching does not pay,
        the lighter replica would recompute it and cache a second copy:
        shared-prefix FIFO with fetch off lost 0.15 of hit to the lighter
        weight (BENCHMARKS.md)."""
        config = self.config
        if config.hot_affinity_weight is None or draw is None or plan is None:
            return config.affinity_weight
        demand, holders = draw
        if not demand > config.hot_affinity_share * mean_recent * holders or self._paying_fetch_cost(plan) is None:
            return config.affinity_weight
        return min(config.hot_affinity_weight, config.affinity_weight)

    def _paying_fetch_cost(self, plan: FetchPlan) -> float | None:
        """What fetching the plan's fetchable prefix costs a replica, in
        shares of recomputing it (what the replicas report,
        :class:`router.fetch_cost.ReportedFetchCost`), when that is at most
        ``max_replica_fetch_cost`` (and under 1: a margin); else None, and
        None when nothing is fetchable."""
        fetchable = plan.fetchable
        cost = self._fetch_cost.cost(fetchable[1]) if fetchable is not None else 1.0
        return cost if cost <= min(self.config.max_replica_fetch_cost, 0.999) else None

    def _holders_queued(self, request: RoutingRequest, found: Candidates, scoring: Scoring) -> float | None:
        """The least queued work among the candidates holding part of the
        request's prefix, when every one of them has more than
        ``queue_copy_requests`` typical requests' work queued (this router's
        in flight there, in the load's units), and the known prefix is one
        a copy serves: prompts branch at its last block
        (:meth:`PrefixIndex.is_branch_point`: a shared system prompt, not a
        chat's own history), one candidate holds all of it, that holder has
        computed it (:meth:`_computed_somewhere`: a copy's fetch would wait
        for its prefill) and a request sent there waits behind the ones in
        flight (:meth:`ReplicaQueueing.queues`: a batching holder runs them
        together); and no other router shares the traffic (with several,
        their requests at the holder are unseen here, so whether it is the
        only holder and has computed the prefix is a guess); a holder not
        seen batching has a queue worth the copy's footprint in a second cache
        (:meth:`_copy_floor`). Else None (and always with the rule off, at 0). The request would wait there
        whatever it saves, and a lighter replica that fetches the prefix
        need not (step 5, queued copies). Why each gate: BENCHMARKS.md
        "Queued copies of a branching prefix"."""
        requests, known = self.config.queue_copy_requests, found.num_known
        if not requests or not found.depths or known <= 0:
            return None
        least = min(map(scoring.load, found.depths))
        if not least > requests * self._typical_queued:
            return None
        holders = [replica_id for replica_id, depth in found.depths.items() if depth >= known]
        if (len(holders) != 1 or self._shares_traffic() or not self._queueing.queues(holders[0])
                or not (self._index.is_branch_point(request.block_hashes[known - 1])
                        or self._copies_any_prefix(holders[0]))
                or not self._computed_somewhere(request, found) or least < self._copy_floor(known, holders[0])):
            return None
        return least

    def _copies_any_prefix(self, holder: str) -> bool:
        """A queued copy need not be of a branching prefix (``queue_copy_any_prefix``)
        where ``holder`` serves one request at a time and every cache has
        room: the copy evicts nothing, and the request would wait for the
        holder's whole queue whatever the prefix. (At a batching holder a
        queued request joins the running batch: measured, the relaxation
        cost Mooncake 1.25M batching hit there.)"""
        return (self.config.queue_copy_any_prefix and self._fill.pressure == 0.0
                and self._queueing.serves_one_at_a_time(holder))

    def _copy_floor(self, num_blocks: int, holder: str) -> float:
        """The least queued work ``holder`` must have for a queued copy of a
        ``num_blocks``-block prefix: ``queue_copy_size_factor`` x the copy's
        tokens (a copy stays cached at both replicas while both serve it);
        0 for a holder seen batching (:meth:`ReplicaQueueing.batches`: one
        reporting requests waiting has its batch or its KV cache full, and
        there the floor cost hit: BENCHMARKS.md "Cache turnover under FIFO")."""
        if self._queueing.batches(holder):
            return 0.0
        return self.config.queue_copy_size_factor * num_blocks * self.config.block_size

    def _shares_traffic(self) -> bool:
        """Whether other routers share the traffic: their decisions are booked
        here (``router.serve_decisions``), or the replicas' output counters
        grow past this router's own completions (:class:`RouterShare`)."""
        now = self._clock()
        return self._share.sees_peers(now) or self._routers_seen(now) > 1.0

    def _fetch_plan(self, request: RoutingRequest, found: Candidates, scoring: Scoring) -> FetchPlan | None:
        """Step 5's :class:`FetchPlan` for the decision (None with fetch off):
        a holder still computing its copy of the prefix (:class:`PendingBlocks`)
        is named in a hint after those that have computed it."""
        config, hashes, pending, depths = self.config, request.block_hashes, self._pending, found.depths
        if not config.fetch_enabled:
            return None
        return FetchPlan(depths, lambda r: self._index.depth(r, hashes), config.block_size, request.num_prompt_tokens,
                         scoring.load, config.fetch_min_tokens, config.fetch_token_cost, config.fetch_credit_scope,
                         scoring.is_over, config.fetch_alternates,
                         PerReplica(lambda r: pending.computes(r, hashes, depths.get(r, 0))).__getitem__)

    def _queue_copy_target(self, holders_load: float, scoring: Scoring) -> Callable[[str, int], bool]:
        """Who may take a queued copy: a replica with at least
        ``queue_copy_gap_requests`` typical requests less work queued than
        every holder (``holders_load``: the least of theirs) whose cache had
        room for ``queue_copy_room_factor`` x the copy at its last report."""
        below = holders_load - self.config.queue_copy_gap_requests * self._typical_queued
        factor, load = self.config.queue_copy_room_factor, scoring.load
        return lambda replica_id, num_tokens: load(replica_id) <= below and self._has_room(replica_id, num_tokens,
                                                                                           factor)

    def _has_room(self, replica_id: str, num_tokens: int, factor: float | None = None) -> bool:
        """Whether ``replica_id``'s cache had room, at its last report, for
        ``factor`` (default ``replica_room_factor``) x ``num_tokens`` (True
        before any report): a copy that evicts may take a prefix's only copy
        with it."""
        free = self._fill.free_tokens(replica_id)
        if factor is None:
            factor = self.config.replica_room_factor
        return free is None or free >= factor * num_tokens
