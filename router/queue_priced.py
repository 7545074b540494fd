"""The balance term's measure under ``balance_output_price`` "queue": each
replica's recent work with output tokens at their queue price."""

from __future__ import annotations

from collections.abc import Callable, Collection

from router.load import LoadTracker
from router.policy_config import PolicyConfig


class QueuePricedWork:
    """Each replica's recent work as this router booked it, with every
    expected output token at ``queue_decode_token_cost`` (what it takes from
    the other requests on its replica) instead of ``decode_token_cost`` (the
    busy time it costs). Under batching that is about the prompt tokens the
    replica computed, i.e. how fast its cache turns over (issue 14, item 4;
    BENCHMARKS.md "Cache turnover under batching").

    Kept only with ``balance_output_price`` "queue" and two different
    prices, or prices that may become different (``learn_token_costs``:
    the replicas' measurements replace the configured ones, :meth:`reprice`);
    otherwise every method does nothing. :meth:`view` is None while the two
    prices in force are equal (the balance term reads the load tracker's
    recent work), so the policy calls it unconditionally. It mirrors the policy's bookings (reserve,
    refresh, confirm, complete) in a :class:`LoadTracker` of its own, so a
    reservation never confirmed is forgotten here too; only its recent work
    is read.

    Invariants (checked by :meth:`check_invariants`): the tracker's own,
    and it tracks exactly the replicas it is given.
    """

    def __init__(self, config: PolicyConfig) -> None:
        is_kept = config.balance_output_price == "queue" and (
            config.queue_token_cost != config.decode_token_cost or config.learn_token_costs)
        self._tracker = LoadTracker(config.in_flight_timeout_s, config.load_window_s,
                                    config.reservation_timeout_s) if is_kept else None
        self._is_priced = False
        self.reprice(config)

    @property
    def is_active(self) -> bool:
        """Whether :meth:`view` may answer (kept, and the two prices differ now)."""
        return self._tracker is not None and self._is_priced

    def reprice(self, config: PolicyConfig) -> None:
        """The prices in force changed (``config`` holds them). Bookings made
        before keep the queue price they were made at."""
        self._is_priced = config.queue_token_cost != config.decode_token_cost

    def add_replica(self, replica_id: str) -> None:
        if self._tracker is not None:
            self._tracker.add_replica(replica_id)

    def remove_replica(self, replica_id: str) -> None:
        if self._tracker is not None:
            self._tracker.remove_replica(replica_id)

    def book(self, request_id: str, replica_id: str, num_tokens: float, now: float, reserve: bool) -> None:
        """The policy counted the request on ``replica_id`` (reserved or
        routed); ``num_tokens``: its work at the queue price."""
        if self._tracker is not None:
            (self._tracker.reserve if reserve else self._tracker.on_routed)(request_id, replica_id, num_tokens, now)

    def refresh(self, request_id: str, replica_id: str, now: float) -> None:
        if self._tracker is not None:
            self._tracker.refresh(request_id, replica_id, now)

    def confirm(self, request_id: str, replica_id: str) -> None:
        if self._tracker is not None:
            self._tracker.confirm(request_id, replica_id)

    def on_completed(self, request_id: str) -> None:
        """Drops its in-flight entry; its recent work stays."""
        if self._tracker is not None:
            self._tracker.on_completed(request_id)

    def view(self, now: float, mean_recent: float, num_replicas: int) -> Callable[[str], float] | None:
        """Each replica's recent queue-priced work scaled so its mean is
        ``mean_recent`` (the mean of recent work at the busy price): its
        deviations are in work units and ``balance_weight`` keeps its
        strength (unscaled, multi-turn batching imbalance went 1.15 -> 1.42).
        None when inactive or before any booking."""
        if self._tracker is None or not self._is_priced:
            return None
        mean_priced = self._tracker.recent_total(now) / max(num_replicas, 1)
        if not mean_priced > 0:
            return None
        recent, scale = self._tracker.recent_view(now), mean_recent / mean_priced
        return lambda replica_id: recent(replica_id) * scale

    def check_invariants(self, replica_ids: Collection[str]) -> None:
        if self._tracker is not None:
            self._tracker.check_invariants()
            assert set(self._tracker.replica_ids) == set(replica_ids), "queue-priced work of another replica set"
