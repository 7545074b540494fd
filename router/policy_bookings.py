"""What :class:`router.policy.PrefixAffinityPolicy` books for a routed
request: its work counted (reserved at decision time, or on the routed
report), its blocks learned, its pending blocks and its prefix's demand; and
what its completion releases."""

from __future__ import annotations

from cache.hashing import salt_seed
from router.candidates import Candidates
from router.request import RoutingRequest


class RequestBookingMixin:
    """The booking half of :class:`router.policy.PrefixAffinityPolicy` (mixed
    into it, never used alone): updates the components the policy creates
    (``_loads``, ``_queue_priced``, ``_reported``, ``_turnover``, ``_pending``, ``_demand``,
    ``_index``, ``_partial``, ``_share``) and its moving averages of a
    request's work (``_typical_work``, ``_typical_queued``)."""

    def on_routed(self, request: object, replica_id: str, request_id: str) -> None:
        """The request went to ``replica_id``: learn its blocks there, count its
        work (nothing to do if :meth:`rank` reserved it there)."""
        if replica_id not in self._ring:
            return  # it left while we decided
        if not self._loads.confirm(request_id, replica_id):
            self._count(request, replica_id, request_id, reserve=False)

    def on_peer_routed(self, request: RoutingRequest, replica_id: str, tail_token_ids: tuple[int, ...] = ()) -> None:
        """Another router sent ``request`` to ``replica_id`` (the routers share
        their decisions: ``router.serve_decisions``). Its blocks are learned
        there and its work counts as this router's recent work, as if this
        router had routed it and seen it done at once: no in-flight entry
        (its completion is the other router's to see), and no completion for
        :class:`RouterShare`. Its queued work counts as the replica's
        ``foreign`` load until the replica's next report, whose queue carries
        it if it still waits (``peer_queue_until_report``; the report may
        already carry it for up to one period: counted twice until the next);
        from then on the report prices what its prefill has left
        (``num_prefilling_tokens``, ``peer_prefill_from_reports``). The floor
        that kept it counted at a FIFO replica until its reports' request
        count said it left (``peer_queue_until_done``:
        :meth:`ReplicaQueueing.peer_work`) is off by default since.
        ``request`` comes without token ids (a prompt's worth per decision
        would be most of what the routers exchange); ``tail_token_ids``, the
        tokens past its last full block, are learned as its partial last
        block (:class:`PartialBlockIndex`), as the router that sent it did."""
        if replica_id not in self._ring:
            return
        now = self._clock()
        request_id = f"peer:{self._share.on_peer_decision(now)}"
        queued = self._count(request, replica_id, request_id, reserve=False)
        if self.config.peer_queue_until_report:
            self._loads.add_foreign(replica_id, queued)
            if self.config.peer_queue_until_done:  # and after the report, while it may still wait there
                self._queueing.add_peer(replica_id, queued)
        self._pending.done(request_id)
        self._loads.on_completed(request_id, now)
        if self._partial is not None and tail_token_ids:
            hashes = request.block_hashes
            self._partial.learn(replica_id, hashes[-1] if hashes else salt_seed(request.salt), tail_token_ids)

    def _count(self, request: object, replica_id: str, request_id: str, reserve: bool,
               num_fetched_tokens: int = 0, found: Candidates | None = None) -> float:
        """``found``: the candidates of the decision just made for ``request``
        (nothing changed since), whose within-block match is reused."""
        now = self._clock()
        if reserve and self._loads.refresh(request_id, replica_id, now):
            return 0.0  # asked again (Ray retries): keep the work counted the first time
        add = self._loads.reserve if reserve else self._loads.on_routed
        try:
            routing = RoutingRequest.from_object(request)
        except ValueError:  # unknown size: count it as a typical request
            parts = self._queue_priced.parts(self._typical_work, 0.0)
            add(request_id, replica_id, self._typical_work, now, parts=parts)
            return self._typical_work
        hashes = routing.block_hashes
        depth = self._index.depth(replica_id, hashes)
        same_match = found is not None and depth == found.num_known  # the same query, the same answer
        within = found.within_at_known if same_match else self._within_block(routing, depth)
        within_tokens = within[1] if within is not None and within[0] == replica_id else 0
        cached = self._cached_tokens(routing, depth, within_tokens)
        if num_fetched_tokens > cached:  # a hinted fetch: those tokens cost fetch_token_cost each
            cached += (1.0 - self.config.fetch_token_cost) * (num_fetched_tokens - cached)
        expected = self._outputs.expected(routing.num_output_tokens, replica_id)
        work = routing.num_prompt_tokens - cached + self.config.decode_token_cost * expected  # = _work_tokens
        queued = routing.num_prompt_tokens - cached + self.config.queue_token_cost * expected
        self._typical_work += (work - self._typical_work) / 64  # moving average
        self._typical_queued += (queued - self._typical_queued) / 64
        add(request_id, replica_id, queued, now, work, self._queue_priced.parts(routing.num_prompt_tokens - cached,
                                                                                expected))
        self._reported.on_routed(replica_id, queued)
        if self.config.turnover_weight:
            self._turnover.on_routed(replica_id, routing.num_prompt_tokens - cached + expected)
        if self.config.premium_needs_completion:
            done = self._pending.computed_depth(replica_id, hashes, depth)
            anchor = hashes[done] if done < len(hashes) else None  # the first block it waits for there
            self._pending.add(request_id, replica_id, hashes[depth:], now, anchor)
        if self.config.replicate_hot_prefixes or self.config.hot_affinity_weight is not None:
            num_known = found.num_known if found is not None else self._index.deepest_holders(hashes, 1)[0]
            if num_known > 0:
                self._demand.add(hashes[num_known - 1], work, now)
        self._index.learn(replica_id, hashes, now)
        if self._partial is not None and routing.token_ids:
            parent = hashes[-1] if hashes else salt_seed(routing.salt)
            self._partial.learn(replica_id, parent, routing.token_ids[len(hashes) * self.config.block_size:])
        return queued

    def on_completed(self, request_id: str) -> None:
        now = self._clock()
        self._pending.done(request_id)
        replica_id = self._loads.on_completed(request_id, now)
        if replica_id is not None:
            self._share.on_completed(now)
            self._work_left.on_completed(replica_id, now)
