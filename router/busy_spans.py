"""How long each replica was recently busy with this router's requests: the
union of their spans, routed to completed."""

from __future__ import annotations

import math
from collections.abc import Callable

from router.decay_base import DecayBase


class BusySpans:
    """Each replica's recent busy seconds as one router observes them.

    A replica counts as busy while at least one of this router's requests is
    in flight there (:meth:`start` to :meth:`stop`); each busy second counts
    ``exp(-age / window_s)``, as recent work does in :class:`LoadTracker`. So
    ``busy(r, now) = ∫ [active(r, t)] exp(-(now - t) / window_s) dt``, at
    most ``window_s``.

    Why: under continuous batching a replica's busy time is the union of its
    requests' spans, not the sum of their tokens. Two requests that overlap
    share their steps and cost little more than one; the same two one after
    the other cost twice. No per-token price predicts that (at a mean decode
    batch of ~1.2 most of a replica's busy time is decode spans), but a live
    router sees every span it opens and closes.

    Stored per replica as ``c[r] = (busy(r, t) - W·active(r)) · e^{(t - base)/W}``
    at its last change ``t``, which stays right until the next one:
    ``busy(r, now) = c[r] · e^{(base - now)/W} + W·active(r)``. So a read, the
    fleet's mean included, is O(1), and so is every update (a rebase every
    ``50 × window_s`` is O(N)).

    Invariants (checked by :meth:`check_invariants`): ``_total == sum(c)``;
    ``_num_active`` is the number of replicas with a request in flight; no
    replica has fewer than 0 in flight.
    """

    def __init__(self, window_s: float) -> None:
        self._base = DecayBase(window_s)  # raises for window_s <= 0
        self.window_s = self._base.window_s
        self._scaled: dict[str, float] = {}  # c[r]
        self._num_in_flight: dict[str, int] = {}
        self._total = 0.0  # sum of c
        self._num_active = 0  # replicas with a request in flight

    def __contains__(self, replica_id: object) -> bool:
        return replica_id in self._scaled

    @property
    def replica_ids(self) -> list[str]:
        return list(self._scaled)

    def num_in_flight(self, replica_id: str) -> int:
        return self._num_in_flight.get(replica_id, 0)

    def busy_s(self, replica_id: str, now: float) -> float:
        """Decayed busy seconds of ``replica_id`` as of ``now`` (0 if unknown)."""
        return self.view(now)[0](replica_id)

    def mean_busy_s(self, now: float) -> float:
        """The mean of :meth:`busy_s` over the tracked replicas (0 if none)."""
        return self.view(now)[1]

    def view(self, now: float) -> tuple[Callable[[str], float], float]:
        """``(busy_s(·, now), mean_busy_s(now))`` with the decay computed
        once; valid until the next update."""
        scaled, num_in_flight, decay, window_s = self._scaled, self._num_in_flight, self._decay(now), self.window_s
        mean = (self._total * decay + window_s * self._num_active) / len(scaled) if scaled else 0.0
        return (lambda replica_id: (scaled.get(replica_id, 0.0) * decay
                                    + (window_s if num_in_flight.get(replica_id, 0) else 0.0))), mean

    # ------------------------------------------------------------------ updates
    def add_replica(self, replica_id: str, now: float) -> None:
        """Track a joining replica, at the others' mean busy time: at 0 it
        would look idle for a whole window and draw every cold prefix."""
        if replica_id in self._scaled:
            return
        mean = self.mean_busy_s(now)
        self._rebase_if_due(now)
        self._scaled[replica_id] = mean / self._decay(now)
        self._num_in_flight[replica_id] = 0
        self._total += self._scaled[replica_id]

    def remove_replica(self, replica_id: str) -> None:
        if replica_id not in self._scaled:
            return
        self._total -= self._scaled.pop(replica_id)
        if self._num_in_flight.pop(replica_id):
            self._num_active -= 1

    def start(self, replica_id: str, now: float) -> None:
        """One more of this router's requests is in flight on ``replica_id``."""
        self.add_replica(replica_id, now)
        if self._num_in_flight[replica_id] == 0:
            self._switch(replica_id, now, active=True)
        self._num_in_flight[replica_id] += 1

    def stop(self, replica_id: str, now: float) -> None:
        """One of them completed (or was forgotten). An unknown replica, or
        one with nothing in flight, is ignored."""
        count = self._num_in_flight.get(replica_id, 0)
        if count == 0:
            return
        if count == 1:
            self._switch(replica_id, now, active=False)
        self._num_in_flight[replica_id] = count - 1

    # ----------------------------------------------------------------- private
    def _decay(self, now: float) -> float:
        return self._base.decay(now)

    def _switch(self, replica_id: str, now: float, active: bool) -> None:
        """Re-express ``c[r]`` for the new state, keeping ``busy_s``
        continuous: ``c`` moves by ``∓W · e^{(now - base)/W}``."""
        self._rebase_if_due(now)
        step = self.window_s / self._decay(now)
        if active:
            step = -step
        self._scaled[replica_id] += step
        self._total += step
        self._num_active += 1 if active else -1

    def _rebase_if_due(self, now: float) -> None:
        scale = self._base.rebase_if_due(now)
        if scale is not None:
            self._scaled = {r: c * scale for r, c in self._scaled.items()}
            self._total = sum(self._scaled.values())

    def check_invariants(self) -> None:
        assert set(self._scaled) == set(self._num_in_flight), "replicas tracked twice over"
        assert all(count >= 0 for count in self._num_in_flight.values()), "fewer than none in flight"
        assert self._num_active == sum(1 for count in self._num_in_flight.values() if count), "active count"
        assert math.isclose(sum(self._scaled.values()), self._total, rel_tol=1e-9, abs_tol=1e-6), "total"
