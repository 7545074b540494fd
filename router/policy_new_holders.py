"""Step 5's new holders for :class:`router.policy.PrefixAffinityPolicy`:
whether a request's prefix may gain a holder that fetches it (a hot prefix,
or one queued at every holder) and which replica has room for the copy;
step 3's lighter affinity weight for a prefix in demand beyond its holders;
and whether a hint's owner still computes the prefix it names."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from router.candidates import Candidates
from router.fetch import FetchHint, FetchPlan
from router.request import RoutingRequest
from router.scoring import Scoring


class NewHoldersMixin:
    """The new-holder part of :class:`router.policy.PrefixAffinityPolicy`
    (mixed into it, never used alone): reads the components the policy
    creates (``_index``, ``_demand``, ``_fill``, ``_fetch_cost``) and its moving average of a
    request's queued work (``_typical_queued``); changes nothing."""

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
        return any(not pending.has_pending(r) or pending.computed_depth(r, hashes, known) >= known
                   for r, depth in found.depths.items() if depth >= known)

    def _marked_computing(self, request: RoutingRequest, hint: FetchHint | None) -> FetchHint | None:
        """``hint`` with ``owner_computing`` set when a request this router sent
        to the owner still computes one of the hinted blocks there
        (:class:`PendingBlocks`; tracked with ``premium_needs_completion``)."""
        if hint is None or not self._pending.has_pending(hint.owner):
            return hint
        num_blocks = hint.num_tokens // self.config.block_size
        if self._pending.computed_depth(hint.owner, request.block_hashes, num_blocks) >= num_blocks:
            return hint
        return replace(hint, owner_computing=True)

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

    def _holders_queued(self, found: Candidates, scoring: Scoring) -> float | None:
        """The least queued work among the candidates holding part of the
        request's prefix, when every one of them has more than
        ``queue_copy_requests`` typical requests' work queued (this router's
        in flight there, in the load's units); else None (and always with
        the rule off, at 0). The request would wait there whatever it saves,
        and a lighter replica that fetches the prefix need not (step 5,
        queued copies)."""
        requests = self.config.queue_copy_requests
        if not requests or not found.depths:
            return None
        least = min(map(scoring.load, found.depths))
        return least if least > requests * self._typical_queued else None

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
