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

    Priced when read, not when booked: a booking keeps its two parts — the
    prompt tokens the replica computes and the output tokens expected — in
    two recent-work counters, and :meth:`view` weighs the second at the
    queue price in force *now*. Booked at the price of the moment, the
    measure mixed prices: every live round began at the configured prior
    (40 prefill tokens per output token) until the Workers' first fits
    (~3), so the first seconds' requests each weighed ~8x a later one's
    for the whole 120-s window, and whichever replica had taken more of
    them looked loaded all round (live, 2 Workers, multi-turn 48 chats:
    hit 0.893-0.898 and imbalance 1.12-1.19 with learned prices, 0.908 and
    1.06 with fixed prices near the learned ones; BENCHMARKS.md "Token
    prices the Workers measure").

    Kept only with ``balance_output_price`` "queue" and two different
    prices, or prices that may become different (``learn_token_costs``:
    the replicas' measurements replace the configured ones, :meth:`reprice`);
    otherwise every method does nothing. :meth:`view` is None while the two
    prices in force are equal (the balance term reads the load tracker's
    recent work), so the policy calls it unconditionally. It mirrors the
    policy's bookings (reserve, refresh, confirm, complete) in two
    :class:`LoadTracker` of its own, so a reservation never confirmed is
    forgotten here too; only their recent work is read.

    Invariants (checked by :meth:`check_invariants`): each tracker's own,
    both track exactly the replicas they are given and the same requests.
    """

    def __init__(self, config: PolicyConfig) -> None:
        is_kept = config.balance_output_price == "queue" and (
            config.queue_token_cost != config.decode_token_cost or config.learn_token_costs)
        trackers = [LoadTracker(config.in_flight_timeout_s, config.load_window_s, config.reservation_timeout_s)
                    for _ in range(2)] if is_kept else [None, None]
        self._computed, self._outputs = trackers  # prompt tokens computed, output tokens expected
        self._is_priced = False
        self._queue_price = 0.0
        self.reprice(config)

    @property
    def is_active(self) -> bool:
        """Whether :meth:`view` may answer (kept, and the two prices differ now)."""
        return self._computed is not None and self._is_priced

    def reprice(self, config: PolicyConfig) -> None:
        """The prices in force changed (``config`` holds them); every booking,
        earlier ones included, is read at the new queue price."""
        self._is_priced = config.queue_token_cost != config.decode_token_cost
        self._queue_price = config.queue_token_cost

    def _trackers(self) -> tuple[LoadTracker, ...]:
        return () if self._computed is None else (self._computed, self._outputs)

    def add_replica(self, replica_id: str) -> None:
        for tracker in self._trackers():
            tracker.add_replica(replica_id)

    def remove_replica(self, replica_id: str) -> None:
        for tracker in self._trackers():
            tracker.remove_replica(replica_id)

    def book(self, request_id: str, replica_id: str, computed_tokens: float, output_tokens: float, now: float,
             reserve: bool) -> None:
        """The policy counted the request on ``replica_id`` (reserved or
        routed): ``computed_tokens`` of its prompt to compute there and
        ``output_tokens`` expected."""
        if self._computed is None:
            return
        for tracker, num_tokens in ((self._computed, computed_tokens), (self._outputs, output_tokens)):
            (tracker.reserve if reserve else tracker.on_routed)(request_id, replica_id, num_tokens, now)

    def refresh(self, request_id: str, replica_id: str, now: float) -> None:
        for tracker in self._trackers():
            tracker.refresh(request_id, replica_id, now)

    def confirm(self, request_id: str, replica_id: str) -> None:
        for tracker in self._trackers():
            tracker.confirm(request_id, replica_id)

    def on_completed(self, request_id: str) -> None:
        """Drops its in-flight entry; its recent work stays."""
        for tracker in self._trackers():
            tracker.on_completed(request_id)

    def forget_recent(self) -> None:
        """Start the recent-work window afresh (:meth:`LoadTracker.forget_recent`)."""
        for tracker in self._trackers():
            tracker.forget_recent()

    def view(self, now: float, mean_recent: float, num_replicas: int) -> Callable[[str], float] | None:
        """Each replica's recent queue-priced work scaled so its mean is
        ``mean_recent`` (the mean of recent work at the busy price): its
        deviations are in work units and ``balance_weight`` keeps its
        strength (unscaled, multi-turn batching imbalance went 1.15 -> 1.42).
        None when inactive or before any booking."""
        if self._computed is None or not self._is_priced:
            return None
        price = self._queue_price
        total = self._computed.recent_total(now) + price * self._outputs.recent_total(now)
        mean_priced = total / max(num_replicas, 1)
        if not mean_priced > 0:
            return None
        computed, outputs = self._computed.recent_view(now), self._outputs.recent_view(now)
        scale = mean_recent / mean_priced
        return lambda replica_id: (computed(replica_id) + price * outputs(replica_id)) * scale

    def check_invariants(self, replica_ids: Collection[str]) -> None:
        for tracker in self._trackers():
            tracker.check_invariants()
            assert set(tracker.replica_ids) == set(replica_ids), "queue-priced work of another replica set"
        if self._computed is not None:
            assert self._computed.num_in_flight() == self._outputs.num_in_flight(), "the two parts disagree"
