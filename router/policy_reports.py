"""How :class:`router.policy.PrefixAffinityPolicy` takes in the replicas'
reports: summaries (snapshots, deltas, restarts), Ray Serve routing stats, a
delta's base fetched out of band, and the token prices they measure."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable

from cache.summary import CacheSummary

# the policy's own log: its records keep the name they had inside router/policy.py
logger = logging.getLogger("router.policy")


class ReplicaReportsMixin:
    """The report half of :class:`router.policy.PrefixAffinityPolicy` (mixed
    into it, never used alone): reads and updates the components the policy
    creates (``_intake``, ``_index``, ``_outputs``, ``_fill``, ``_queueing``, ``_fetch_cost``,
    ``_prices``, ``_loads``, ``_queue_priced``, ``_demand``, ``_reported``, ``_turnover``,
    ``_share``), and puts measured token prices in force in ``config``."""

    def on_summary(self, summary: CacheSummary) -> bool:
        """Apply a replica's report; False if stale, unknown, at another block
        size, or a delta against a snapshot this router does not hold (it
        waits for the next snapshot, or fetches the base; its own decisions
        keep routing). A new epoch (the replica restarted) is applied whatever
        its version, and drops even the entries this router learned within
        the grace period; a delta of a new epoch whose base this router does
        not hold drops them too, before anything new is known."""
        replica_id = summary.replica_id
        if replica_id not in self._ring:
            return False
        if summary.block_size != self.config.block_size:
            logger.warning("summary from %s at block size %d, router uses %d; ignored",
                           replica_id, summary.block_size, self.config.block_size)
            return False
        accepted = self._intake.accept(summary)
        capacity = summary.budget_tokens // summary.block_size or None
        if accepted is None:
            if self._intake.is_restart(summary):
                # a restarted replica's delta whose base this router lacks: what it held before is gone
                self._index.apply_summary(replica_id, frozenset(), self._clock(), capacity, keep_learned=False)
            return False
        if accepted.changes is not None:  # a chained delta: apply what changed
            self._index.apply_delta(replica_id, *accepted.changes, accepted.hashes, self._clock(), capacity)
        else:
            self._index.apply_summary(replica_id, accepted.hashes, self._clock(), capacity,
                                      keep_learned=accepted.keep_learned)
        self._outputs.report(replica_id, summary.mean_output_tokens)
        self._work_left.report(summary, self.config.decode_token_cost)
        if (self.config.premium_needs_completion or self.config.replicate_hot_prefixes or self.config.fifo_work_left
                or self.config.queue_copy_requests or self.config.turnover_weight):  # the fill's readers
            self._fill.report(replica_id, summary.num_cached_tokens, summary.budget_tokens)
        if (self.config.queue_copy_requests or self.config.turnover_weight or self.config.cold_queue_weight
                or self.config.peer_queue_until_done):  # its readers
            self._queueing.report(replica_id, summary.num_running, summary.num_waiting)
        if (self.config.replicate_hot_prefixes or self.config.queue_copy_requests
                or self.config.hot_affinity_weight is not None) and self.config.learn_token_costs:  # its readers
            self._fetch_cost.report(replica_id, summary.fetch_token_cost, summary.fetch_overhead_tokens)
        if self.config.learn_token_costs:
            was_measured = self._prices.is_measured
            if self._prices.report(replica_id, summary.decode_token_cost, summary.queue_token_cost):
                self._reprice()
            if not was_measured and self._prices.is_measured:
                self._loads.forget_recent()  # booked at the priors (its parts too): see _reprice
                self._demand.clear()  # compared with recent work: the same window
        reported_work = self._reported_work(summary)
        self._reported.report(replica_id, summary.epoch, summary.num_prefill_tokens_total,
                              summary.num_output_tokens_total, self._clock(), reported_work)
        peer_work = self._queueing.peer_work(replica_id, summary.num_running + summary.num_waiting,
                                             self._loads.num_in_flight_at)
        self._loads.on_report(replica_id, reported_work, peer_work)
        if self.config.turnover_weight:
            self._turnover.report(replica_id, summary.epoch, summary.num_prefill_tokens_total,
                                  summary.num_output_tokens_total, self._clock())
        self._share.on_report(replica_id, summary.epoch, summary.num_output_tokens_total, self._clock())
        now = self._clock()
        if self.config.busy_from_reports and (view := self._loads.busy_view(now)) is not None:
            self._busy_reports.report(replica_id, summary.epoch, summary.busy_s_total, now, view[0](replica_id))
        return True

    def _reprice(self) -> None:
        """Put the replicas' measured token prices in force (``learn_token_costs``):
        decisions from now on and the reported-work counters use them; the
        balance term's queue-priced work re-prices what it booked before
        (:class:`QueuePricedWork`). Recent work at the busy price keeps the
        price each request was booked at, except that the first measurement
        any replica reports clears the recent-work windows (both trackers'
        :meth:`LoadTracker.forget_recent`): what was booked at the priors,
        off by up to 3x live (40 against 60-180 busy on the CPU engine),
        would skew the bound and the balance for the whole window, and it is
        a few seconds of history."""
        prices = self._prices
        self.config = dataclasses.replace(self.config, decode_token_cost=prices.decode_token_cost,
                                          queue_decode_token_cost=prices.queue_token_cost)
        self._reported.decode_token_cost = prices.decode_token_cost
        self._reported.queue_token_cost = prices.queue_token_cost
        self._queue_priced.reprice(self.config)
        logger.info("token prices in force: %.1f busy, %.1f queued, prefill-token equivalents per output token",
                    prices.decode_token_cost, prices.queue_token_cost)

    def _reported_work(self, summary: CacheSummary) -> float:
        """A report in the units of the load: the queued prompt tokens, plus
        the expected decode of every waiting request and half of every running
        one's (on average it is half done); while other routers' decisions
        reach this one (``peer_prefill_from_reports``), also the prompt tokens
        a running prefill has left. This router books its own requests until
        they complete, a prefill in progress included; another router's long
        prefill it books only until this report, which without that field
        prices it at nothing (simulated Mooncake 1.25M, 4 routers, FIFO:
        TTFT p99 3.25 -> 3.07 s; BENCHMARKS.md "The prefill in progress,
        and admission learned online"). With one router it would only
        count its own requests twice (hit -0.001 there)."""
        expected = self._outputs.expected(None, summary.replica_id)
        decode = self.config.queue_token_cost * expected * (summary.num_waiting + 0.5 * summary.num_running)
        queued = summary.num_queued_tokens
        if self.config.peer_prefill_from_reports and self._share.sees_peers(self._clock()):
            queued += summary.num_prefilling_tokens
        return queued + decode

    def on_routing_stats(self, replica_id: str, stats: object) -> bool:
        """Apply Ray Serve routing stats (a ``CacheSummary.to_dict()``); never raises."""
        if not stats:
            return False  # the replica has not reported yet
        if isinstance(stats, dict) and self._intake.has_seen(replica_id, stats.get("version"), stats.get("epoch")):
            return False  # seen already: Ray re-sends every replica's stats when any one changes
        try:
            summary = CacheSummary.from_dict(stats)
        except ValueError as error:
            logger.warning("ignoring malformed routing stats from %s: %s", replica_id, error)
            return False
        if summary.replica_id != replica_id:  # Ray says whose stats these are
            summary = dataclasses.replace(summary, replica_id=replica_id)
        return self.on_summary(summary)

    def missing_base(self, replica_id: str, stats: object) -> tuple[str, int] | None:
        """``(epoch, base_version)`` when :meth:`on_routing_stats` refused
        ``stats`` only because it is a delta against a state this router
        does not hold; the caller may fetch that state (the stream sent it by
        reference) and hand it to :meth:`on_base`. Never raises."""
        if replica_id not in self._ring or not isinstance(stats, dict) or not stats:
            return None
        if self._intake.has_seen(replica_id, stats.get("version"), stats.get("epoch")):
            return None  # applied already: Ray re-sends every replica's stats when any one changes
        try:
            summary = dataclasses.replace(CacheSummary.from_dict(stats), replica_id=replica_id)
        except ValueError:
            return None
        if summary.block_size != self.config.block_size or not self._intake.missing_base(summary):
            return None
        return summary.epoch, summary.base_version

    def on_base(self, replica_id: str, epoch: str, version: int, hashes: Iterable[int]) -> bool:
        """Hold a replica's full block set at ``version`` of ``epoch``, fetched
        out of band, for the deltas taken against it (then re-apply the
        replica's latest stats). False if the replica is not on the ring."""
        if replica_id not in self._ring:
            return False
        self._intake.install_base(replica_id, epoch, version, frozenset(hashes))
        return True
