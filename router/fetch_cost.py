"""What fetching a prefix costs, in prefill-token equivalents, as the replicas
estimate it (``CacheSummary.fetch_token_cost`` / ``fetch_overhead_tokens``)."""

from __future__ import annotations

import math

from router.pooled_reports import PooledReports


class ReportedFetchCost:
    """The cost of fetching ``n`` cached tokens instead of recomputing them,
    per token of prefill: ``token_cost + overhead_tokens / n``, from what the
    replicas' fetchers measured (bandwidth, fixed cost, their prefill rate,
    their required speed-up). A value of 1 or more means a replica would
    recompute rather than fetch, so a decision that relies on a fetch
    (``replicate_hot_prefixes``) should not be made.

    Before any replica reports a measurement, ``token_cost`` is the
    configured ``fetch_token_cost`` and ``overhead_tokens`` 0. Then both are
    the medians of the last ``history`` measured reports of every replica,
    pooled (a report of 0 for both means "not measured" and leaves earlier
    ones standing). Why learned: on the CPU demo (tiny-llama, 1 KiB of KV
    per token) a 1,024-token prefix recomputes in ~10 ms against a fetch
    whose fixed cost is ~50 ms, and every hinted request there recomputed;
    a ~125M model (24 KiB per token) fetches the same prefix in a fraction
    of its ~1 s prefill.

    Invariants (:meth:`check_invariants`): both terms finite and >= 0; each
    replica holds at most ``history`` reports, all measured.
    """

    def __init__(self, prior_token_cost: float, history: int = 16) -> None:
        self._reports = PooledReports(history)
        if not (math.isfinite(prior_token_cost) and prior_token_cost >= 0):
            raise ValueError(f"prior_token_cost must be a finite number >= 0, got {prior_token_cost!r}")
        self.token_cost = float(prior_token_cost)
        self.overhead_tokens = 0.0

    def cost(self, num_tokens: int) -> float:
        """Prefill-token equivalents per token of a fetch of ``num_tokens`` (> 0)."""
        return self.token_cost + self.overhead_tokens / max(num_tokens, 1)

    def report(self, replica_id: str, token_cost: float, overhead_tokens: float) -> None:
        if not (token_cost > 0 or overhead_tokens > 0):
            return  # not measured
        self._reports.add(replica_id, token_cost, overhead_tokens)
        self._refresh()

    def remove(self, replica_id: str) -> None:
        if self._reports.remove(replica_id):
            self._refresh()

    def _refresh(self) -> None:
        medians = self._reports.medians()
        if medians is not None:  # with no reporter left, the last measured cost stays: the links did not change
            self.token_cost, self.overhead_tokens = medians

    def check_invariants(self, replica_ids) -> None:
        """The docstring's invariants; ``replica_ids``: the replicas the policy knows."""
        for term in (self.token_cost, self.overhead_tokens):
            assert math.isfinite(term) and term >= 0, f"fetch cost term {term!r}"
        self._reports.check_invariants(replica_ids, lambda t, o: t >= 0 and o >= 0 and (t > 0 or o > 0),
                                       "fetch costs")
