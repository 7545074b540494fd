"""The balance term's measure under ``balance_output_price`` "queue": each
replica's recent work with output tokens at their queue price."""

from __future__ import annotations

from collections.abc import Callable

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
    the replicas' measurements replace the configured ones, :meth:`reprice`)
    (:meth:`keeps`). The two counters are the policy's load tracker's
    :attr:`LoadTracker.parts`, booked with each request's own in-flight
    entry (:meth:`parts`), so a reservation never confirmed is forgotten
    with it, and a decision books one tracker, not three (two trackers of
    its own mirrored every booking: a reservation and a completion cost a
    tracker ~6 µs in a warm loop).
    :meth:`view` is None while the two prices in force are equal (the
    balance term reads the load tracker's recent work), so the policy
    calls it unconditionally.

    Invariant (checked by :meth:`check_invariants`, refused at
    construction): the load tracker keeps two parts iff the measure is kept.
    """

    def __init__(self, config: PolicyConfig, loads: LoadTracker) -> None:
        self._loads, self._is_kept = loads, self.keeps(config)
        if self._is_kept != (loads.parts is not None and loads.parts.num_parts == 2):
            raise ValueError("the load tracker must keep two recent-work parts exactly when this measure is kept")
        self._is_priced = False
        self._queue_price = 0.0
        self.reprice(config)

    @staticmethod
    def keeps(config: PolicyConfig) -> bool:
        """Whether a policy with ``config`` keeps the measure (its load tracker then keeps two parts)."""
        return config.balance_output_price == "queue" and (
            config.queue_token_cost != config.decode_token_cost or config.learn_token_costs)

    @property
    def is_active(self) -> bool:
        """Whether :meth:`view` may answer (kept, and the two prices differ now)."""
        return self._is_kept and self._is_priced

    def reprice(self, config: PolicyConfig) -> None:
        """The prices in force changed (``config`` holds them); every booking,
        earlier ones included, is read at the new queue price."""
        self._is_priced = config.queue_token_cost != config.decode_token_cost
        self._queue_price = config.queue_token_cost

    def parts(self, computed_tokens: float, output_tokens: float) -> tuple[float, ...]:
        """A booking's parts for the load tracker: ``computed_tokens`` of its
        prompt to compute there and ``output_tokens`` expected (none while
        the measure is not kept)."""
        return (computed_tokens, output_tokens) if self._is_kept else ()

    def view(self, now: float, mean_recent: float, num_replicas: int) -> Callable[[str], float] | None:
        """Each replica's recent queue-priced work scaled so its mean is
        ``mean_recent`` (the mean of recent work at the busy price): its
        deviations are in work units and ``balance_weight`` keeps its
        strength (unscaled, multi-turn batching imbalance went 1.15 -> 1.42).
        None when inactive or before any booking."""
        if not self.is_active:
            return None
        price, parts, decay = self._queue_price, self._loads.parts, self._loads.decay(now)
        total = parts.total(0, decay) + price * parts.total(1, decay)
        mean_priced = total / max(num_replicas, 1)
        if not mean_priced > 0:
            return None
        computed, outputs = parts.view(0, decay), parts.view(1, decay)
        scale = mean_recent / mean_priced
        return lambda replica_id: (computed(replica_id) + price * outputs(replica_id)) * scale

    def check_invariants(self) -> None:
        kept = self._loads.parts is not None and self._loads.parts.num_parts == 2
        assert kept == self._is_kept, "the load tracker's parts disagree with the measure's being kept"
