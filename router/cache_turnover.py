"""How fast each replica's cache turns over: the tokens written into it lately."""

from __future__ import annotations

import math
from collections.abc import Callable

from router.decay_base import DecayBase


class CacheTurnover:
    """Per replica, the tokens written into its cache lately: the prompt
    tokens it prefilled and the tokens it generated, from the counters its
    reports carry (``CacheSummary.num_prefill_tokens_total`` and
    ``num_output_tokens_total``), decayed by ``exp(-age / window_s)``, plus
    what this router sent it since its last report (the uncached prompt and
    the expected output it booked: :meth:`on_routed`).

    Why it matters: once an LRU cache is full it evicts a token for every
    token written, so a replica written faster keeps each prefix for less
    time, and what it evicts to make room was used more recently — it is
    likelier to be asked for again than what a slower replica evicts. A
    FIFO replica (one request at a time) balanced on busy time shows it
    most: the one that drew long answers spends its time decoding and
    prefills half as much as the others (simulated Mooncake 1.25M, eight
    replicas: 1.9M against 3.2-3.7M prompt tokens computed), so the others
    churn. :meth:`relative` gives the policy each replica's rate against
    the fleet's mean (``PolicyConfig.turnover_weight``).

    Every router reads the same counters, so routers agree within a report
    period (their own unreported sends differ). A replica that restarts (a
    new epoch, or counters that went back) starts at the others' mean.

    The values are stored on a :class:`DecayBase`, so the fleet's sum
    decays as one number: :meth:`relative` costs one ``exp`` per decision
    and a dict read per replica asked, whatever the number of replicas.

    Invariants (checked by :meth:`check_invariants`): values and pending
    counts are >= 0; the stored sums match the values (to rounding).
    """

    def __init__(self, window_s: float) -> None:
        self._base = DecayBase(window_s)  # raises for window_s <= 0
        self.window_s = self._base.window_s
        self._scaled: dict[str, float] = {}  # replica -> written tokens at its last report, on the base
        self._scaled_total = 0.0
        self._counters: dict[str, tuple[str, int, int]] = {}  # replica -> (epoch, prefill, output) last reported
        self._pending: dict[str, float] = {}  # replica -> tokens this router sent it since its last report
        self._pending_total = 0.0

    def __len__(self) -> int:
        """Replicas that have reported (and not been removed)."""
        return len(self._scaled)

    def report(self, replica_id: str, epoch: str, num_prefill_total: int, num_output_total: int,
               now: float) -> None:
        """A replica's counters at ``now``; O(1) (O(replicas) when the base
        moves, and at a restart)."""
        growth = self._growth(now)
        last = self._counters.get(replica_id)
        self._counters[replica_id] = (epoch, num_prefill_total, num_output_total)
        if last is None or last[0] != epoch or num_prefill_total < last[1] or num_output_total < last[2]:
            others = [scaled for r, scaled in self._scaled.items() if r != replica_id]
            scaled = sum(others) / len(others) if others else 0.0
        else:
            written = (num_prefill_total - last[1]) + (num_output_total - last[2])
            scaled = self._scaled.get(replica_id, 0.0) + written * growth
        self._set(replica_id, scaled)
        self._pending_total -= self._pending.pop(replica_id, 0.0)

    def on_routed(self, replica_id: str, num_tokens: float) -> None:
        """This router sent ``replica_id`` a request that writes ``num_tokens``
        into its cache (what no report shows yet)."""
        if num_tokens > 0:
            self._pending[replica_id] = self._pending.get(replica_id, 0.0) + num_tokens
            self._pending_total += num_tokens

    def relative(self, num_replicas: int, now: float) -> Callable[[str], float] | None:
        """``replica -> its written tokens / the mean over the fleet - 1``
        (0 for a replica that has not reported), valid until the next report
        or send; None until ``num_replicas`` replicas have reported or while
        nothing has been written."""
        if len(self._scaled) < num_replicas or self._base.base_s is None:
            return None
        decay = self._base.decay(now)
        mean = (self._scaled_total * decay + self._pending_total) / max(len(self._scaled), 1)
        if not mean > 0:
            return None
        scaled, pending = self._scaled, self._pending

        def relative(replica_id: str) -> float:
            if replica_id not in scaled:
                return 0.0
            return (scaled[replica_id] * decay + pending.get(replica_id, 0.0)) / mean - 1.0
        return relative

    def remove(self, replica_id: str) -> None:
        self._scaled_total -= self._scaled.pop(replica_id, 0.0)
        self._pending_total -= self._pending.pop(replica_id, 0.0)
        self._counters.pop(replica_id, None)

    def check_invariants(self) -> None:
        assert all(v >= 0 for v in self._scaled.values()), "a negative value"
        assert all(v >= 0 for v in self._pending.values()), "a negative pending count"
        for total, values in ((self._scaled_total, self._scaled), (self._pending_total, self._pending)):
            assert math.isclose(total, sum(values.values()), rel_tol=1e-9, abs_tol=1e-6), "a sum out of date"
        assert set(self._counters) == set(self._scaled), "counters and values disagree on the replicas"

    def _growth(self, now: float) -> float:
        """``1 / decay(now)``, after moving the base to ``now`` when due."""
        scale = self._base.rebase_if_due(now)
        if scale is not None:
            self._scaled = {r: v * scale for r, v in self._scaled.items()}
            self._scaled_total = sum(self._scaled.values())
        return 1.0 / self._base.decay(now)

    def _set(self, replica_id: str, scaled: float) -> None:
        self._scaled_total += scaled - self._scaled.get(replica_id, 0.0)
        self._scaled[replica_id] = scaled
