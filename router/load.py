"""How loaded each replica is, as one router estimates it."""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable
from typing import NamedTuple

from router.busy_spans import BusySpans
from router.keyed_min import KeyedMin
from router.recent_parts import RecentParts

_REBASE_WINDOWS = 50.0  # rescale the recent-work counters before exp() overflows


class _InFlight(NamedTuple):  # immutable; built once per decision (a frozen dataclass costs 3x as much)
    replica_id: str
    num_tokens: float  # its queued work (load)
    routed_at: float
    recent_tokens: float  # its share of recent work
    parts: tuple[float, ...] = ()  # its recent work's parts (RecentParts), where the tracker keeps them


class LoadTracker:
    """Two views of each replica's load, in tokens of work.

    **Queued work** ``load(r) = local(r) + foreign(r)``: ``local`` sums the
    work of this router's requests on ``r`` that have not completed (exact,
    updated at once); ``foreign = max(0, reported - local at report time)``
    is what other routers put there, as of the replica's last report, plus
    what their shared decisions added since (:meth:`add_foreign`). With
    one router ``foreign`` stays ~0; with several, each still sees its own
    pending work at once, which keeps routers from herding between reports.

    **Recent work** ``recent_work(r, now)``: the work this router sent to
    ``r``, each request decayed by ``exp(-age / window_s)``: the long-run
    share of work, which the queue (often 0–2 requests) cannot tell.
    :meth:`chance_sd` is the standard deviation of a replica's recent work
    had the same requests been spread uniformly at random, ``sqrt(sum(d_i²
    w_i²) (N - 1)) / N`` (``d_i``: request ``i``'s decay): chance's share.

    **Recent busy time** (``track_busy``, :meth:`busy_view`): how long each
    replica had at least one of this router's requests in flight, decayed
    alike (:class:`BusySpans`): its work's cost in time when requests overlap.
    In-flight entries that never hear a completion are dropped after
    ``in_flight_timeout_s``: a lost callback must not leak load.

    **Reservations** (:meth:`reserve`): a decision counted when made, before
    the caller says the request was sent (Ray Serve reports a request routed
    only once the replica accepted it: a burst of decisions would all see
    the same loads). :meth:`confirm` makes it an ordinary in-flight entry,
    :meth:`on_routed` with the same id replaces it (it went elsewhere), and
    one unconfirmed for ``reservation_timeout_s`` (cancelled before it was
    sent) is forgotten, queued and recent work alike.

    Invariants (checked by :meth:`check_invariants`):

    1. ``_local[r] == sum of in-flight work on r`` and ``_total == sum(load)``;
       every reservation is an in-flight entry; ``_in_flight_at[r]`` holds
       the in-flight ids at ``r``, in ``_in_flight``'s order.
    2. Recent counters (and :attr:`parts`', booked with each request:
       :class:`RecentParts`) are stored multiplied by ``exp((t - _base_s) /
       window_s)`` (squares by its square) so that decay needs no updates;
       ``_recent_total == sum(_recent)``, ``_recent_sq_total == sum(_recent_sq)``.
    3. With ``track_busy``, the busy spans track exactly these replicas, each
       with as many requests in flight as it has entries here.
    4. Once :meth:`least_loaded_replica` was asked (before: None), ``_least`` holds each replica's
       current ``(load, scaled recent work, version, replica)`` (:class:`KeyedMin`): the least
       loaded is the least entry, the least recent work first among equal loads. Versions count
       every change (the last tie-break before the id, as when a heap kept them).

    Cost: updates O(1) (O(√N) once the least loaded replica was asked); the first
    :meth:`least_loaded_replica` O(N), later ones O(√N); a rebase every ``50 × window_s`` O(N).
    """

    def __init__(self, in_flight_timeout_s: float = 600.0, window_s: float = 120.0,
                 reservation_timeout_s: float = 5.0, track_busy: bool = False, num_parts: int = 0) -> None:
        for name, value in (("in_flight_timeout_s", in_flight_timeout_s), ("window_s", window_s),
                            ("reservation_timeout_s", reservation_timeout_s)):
            if not value > 0:
                raise ValueError(f"{name} must be > 0, got {value!r}")
        self.in_flight_timeout_s = float(in_flight_timeout_s)
        self.window_s = float(window_s)
        self.reservation_timeout_s = float(reservation_timeout_s)
        self._local: dict[str, float] = {}
        self._foreign: dict[str, float] = {}
        self._total = 0.0
        self._in_flight: OrderedDict[str, _InFlight] = OrderedDict()  # oldest first
        self._in_flight_at: dict[str, dict[str, None]] = {}  # replica -> its in-flight ids, oldest first
        self._reserved: OrderedDict[str, float] = OrderedDict()  # unconfirmed ids -> reserved at, oldest first
        self._recent: dict[str, float] = {}
        self._recent_total = 0.0
        self._recent_sq: dict[str, float] = {}  # sum of squared works, decayed twice as fast
        self._recent_sq_total = 0.0
        self._base_s: float | None = None
        self._versions: dict[str, int] = {}
        self._least: KeyedMin | None = None  # invariant 4: from the first least_loaded_replica on
        self._busy = BusySpans(self.window_s) if track_busy else None
        self.parts = RecentParts(num_parts) if num_parts else None  # recent work split, booked with each request
        self._last_s = 0.0  # the latest time an update was given: completions may come without one

    # ------------------------------------------------------------------ queries
    @property
    def replica_ids(self) -> list[str]:
        return list(self._local)

    @property
    def total(self) -> float:
        return max(self._total, 0.0)

    def __contains__(self, replica_id: object) -> bool:
        return replica_id in self._local

    def __len__(self) -> int:
        return len(self._local)

    def load(self, replica_id: str) -> float:
        return self._local.get(replica_id, 0.0) + self._foreign.get(replica_id, 0.0)

    def foreign(self, replica_id: str) -> float:
        """The part of ``load`` other routers put there, as of the last report."""
        return self._foreign.get(replica_id, 0.0)

    def recent_work(self, replica_id: str, now: float) -> float:
        return self._recent.get(replica_id, 0.0) * self.decay(now)

    def recent_view(self, now: float) -> Callable[[str], float]:
        """``recent_work(·, now)`` with the decay computed once, for many
        replicas at one moment; valid until the next update."""
        recent, scale = self._recent, self.decay(now)
        return lambda replica_id: recent.get(replica_id, 0.0) * scale

    def decay(self, now: float) -> float:
        """A stored recent counter (:attr:`parts`' too) times this reads it at ``now``; 0 before any booking."""
        return 0.0 if self._base_s is None else math.exp((self._base_s - now) / self.window_s)

    def recent_total(self, now: float) -> float:
        return self._recent_total * self.decay(now)

    def chance_sd(self, now: float) -> float:
        """Standard deviation of a replica's recent work under a uniformly
        random spread of the same requests (0 for fewer than 2 replicas)."""
        num_replicas = len(self._local)
        if self._base_s is None or num_replicas < 2:
            return 0.0
        sq_total = self._recent_sq_total * math.exp(2 * (self._base_s - now) / self.window_s)
        return math.sqrt(max(sq_total, 0.0) * (num_replicas - 1)) / num_replicas

    def busy_view(self, now: float) -> tuple[Callable[[str], float], float] | None:
        """``(busy_s(r), mean)``: each replica's recent busy seconds as of ``now`` and their
        mean (:class:`BusySpans`); None without ``track_busy``. Valid until the next update."""
        return None if self._busy is None else self._busy.view(now)

    def num_in_flight(self) -> int:
        return len(self._in_flight)

    def num_reserved(self) -> int:
        return len(self._reserved)

    def num_in_flight_at(self, replica_id: str) -> int:
        """This router's requests in flight at ``replica_id``; O(1)."""
        return len(self._in_flight_at.get(replica_id, ()))

    def first_in_flight(self, replica_id: str) -> _InFlight | None:
        """This router's request in flight at ``replica_id`` it sent (moved) there first; O(1) amortised."""
        ids = self._in_flight_at.get(replica_id)
        return self._in_flight[next(iter(ids))] if ids else None

    def least_loaded_replica(self) -> str | None:
        """The least loaded replica (least recent work among equals); None if none."""
        if self._least is None:
            self._least = KeyedMin()
            for replica_id in self._local:
                self._least.set(replica_id, (self.load(replica_id), self._recent[replica_id],
                                             self._versions[replica_id], replica_id))
        least = self._least.least()
        return None if least is None else least[3]

    # ------------------------------------------------------------------ updates
    def add_replica(self, replica_id: str) -> None:
        """Track a joining replica. Its recent work starts at the others' mean: at 0 it would look like the least-used
        replica for a whole window and draw every cold prefix, instead of its share, while it catches up."""
        if replica_id not in self._local:
            num_others = len(self._local)
            self._track(replica_id, self._recent_total / num_others if num_others else 0.0, num_others)

    def _track(self, replica_id: str, scaled_recent: float, num_others: int = 0) -> None:
        if self.parts is not None:
            self.parts.track(replica_id, num_others)
        self._local[replica_id] = 0.0
        self._foreign[replica_id] = 0.0
        self._recent[replica_id] = scaled_recent
        self._recent_sq[replica_id] = 0.0  # the chance spread counts real requests only
        self._recent_total += scaled_recent
        if self._busy is not None:
            self._busy.add_replica(replica_id, self._last_s)
        self._changed(replica_id)

    def remove_replica(self, replica_id: str) -> None:
        if replica_id not in self._local:
            return
        self._total -= self.load(replica_id)
        del self._local[replica_id], self._foreign[replica_id], self._versions[replica_id]
        self._recent_total = max(0.0, self._recent_total - self._recent.pop(replica_id))
        self._recent_sq_total = max(0.0, self._recent_sq_total - self._recent_sq.pop(replica_id))
        if self.parts is not None:
            self.parts.remove(replica_id)
        if self._busy is not None:
            self._busy.remove_replica(replica_id)
        for request_id in self._in_flight_at.pop(replica_id, ()):
            del self._in_flight[request_id]
            self._reserved.pop(request_id, None)
        if self._least is not None:
            self._least.remove(replica_id)

    def on_routed(self, request_id: str, replica_id: str, num_tokens: float, now: float,
                  recent_tokens: float | None = None, parts: tuple[float, ...] = ()) -> None:
        """This router sent ``num_tokens`` of queued work to ``replica_id`` (``recent_tokens`` of
        recent work, default the same; ``parts``: one value per part :attr:`parts` keeps, or none: 0).
        A reused id replaces its old entry (queued and recent work)."""
        self._add(request_id, replica_id, num_tokens, now, recent_tokens, parts)

    def reserve(self, request_id: str, replica_id: str, num_tokens: float, now: float,
                recent_tokens: float | None = None, parts: tuple[float, ...] = ()) -> None:
        """This router chose ``replica_id`` for the request and has not sent it yet."""
        self._add(request_id, replica_id, num_tokens, now, recent_tokens, parts)
        self._reserved[request_id] = now

    def refresh(self, request_id: str, replica_id: str, now: float) -> bool:
        """Restart the timeout of the request's reservation on ``replica_id``;
        False (and nothing changes) unless it is reserved there."""
        entry = self._in_flight.get(request_id)
        if request_id not in self._reserved or entry is None or entry.replica_id != replica_id:
            return False
        self._reserved[request_id] = now
        self._reserved.move_to_end(request_id)
        return True

    def confirm(self, request_id: str, replica_id: str) -> bool:
        """The reserved request was sent to ``replica_id``; False (and nothing
        changes) unless it was reserved there and not yet confirmed."""
        entry = self._in_flight.get(request_id)
        if request_id not in self._reserved or entry is None or entry.replica_id != replica_id:
            return False
        del self._reserved[request_id]
        return True

    def _add(self, request_id: str, replica_id: str, num_tokens: float, now: float,
             recent_tokens: float | None = None, parts: tuple[float, ...] = ()) -> None:
        if not num_tokens >= 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens!r}")
        recent_tokens = num_tokens if recent_tokens is None else recent_tokens
        if not recent_tokens >= 0:
            raise ValueError(f"recent_tokens must be >= 0, got {recent_tokens!r}")
        self._last_s = max(self._last_s, now)
        self.expire(now)
        if request_id in self._in_flight:  # counted before: moved, or asked again
            self._forget(request_id, now)
        if replica_id not in self._local:  # routed to before set_replicas named it
            self._track(replica_id, 0.0)
        if parts and (self.parts is None or len(parts) != self.parts.num_parts):  # none: all 0
            raise ValueError(f"parts must have one value per part kept, got {parts!r}")
        self._in_flight[request_id] = _InFlight(replica_id, float(num_tokens), now, float(recent_tokens), parts)
        self._in_flight_at.setdefault(replica_id, {})[request_id] = None
        if self._busy is not None:
            self._busy.start(replica_id, now)
        self._local[replica_id] += num_tokens
        self._total += num_tokens
        if self._base_s is None:
            self._base_s = now
        elif now - self._base_s > _REBASE_WINDOWS * self.window_s:
            self._rebase(now)
        scale = math.exp((now - self._base_s) / self.window_s)
        scaled = recent_tokens * scale
        if parts:
            self.parts.add(replica_id, parts, scale)
        self._recent[replica_id] += scaled
        self._recent_total += scaled
        self._recent_sq[replica_id] += scaled * scaled
        self._recent_sq_total += scaled * scaled
        self._changed(replica_id)

    def on_completed(self, request_id: str, now: float | None = None) -> str | None:
        """The request finished (or failed) at ``now`` (default: the latest time given to any update; it ends the
        replica's busy span); returns the replica it was at, None if it was unknown."""
        self._reserved.pop(request_id, None)
        entry = self._in_flight.pop(request_id, None)
        if entry is None:
            return None
        del self._in_flight_at[entry.replica_id][request_id]
        if now is not None:
            self._last_s = max(self._last_s, now)
        if self._busy is not None:
            self._busy.stop(entry.replica_id, self._last_s if now is None else now)
        if entry.replica_id in self._local:
            self._local[entry.replica_id] = max(0.0, self._local[entry.replica_id] - entry.num_tokens)
            self._total -= entry.num_tokens
            self._changed(entry.replica_id)
        return entry.replica_id

    def on_report(self, replica_id: str, load_tokens: float, peer_tokens: float = 0.0) -> None:
        """The replica says it holds ``load_tokens`` of work (all routers'); ``foreign`` is
        at least ``peer_tokens`` (what it may undercount: ``ReplicaQueueing.peer_work``)."""
        if not load_tokens >= 0:
            raise ValueError(f"load_tokens must be >= 0, got {load_tokens!r}")
        self.add_replica(replica_id)
        foreign = max(0.0, load_tokens - self._local[replica_id], peer_tokens)
        self._total += foreign - self._foreign[replica_id]
        self._foreign[replica_id] = foreign
        self._changed(replica_id)

    def add_foreign(self, replica_id: str, num_tokens: float) -> None:
        """Another router sent ``num_tokens`` of queued work to ``replica_id`` (its shared
        decision): it counts in ``foreign`` until the replica's next report carries it."""
        if not num_tokens >= 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens!r}")
        if replica_id not in self._local:
            return
        self._foreign[replica_id] += num_tokens
        self._total += num_tokens
        self._changed(replica_id)

    def expire(self, now: float) -> None:
        """Drop in-flight entries older than ``in_flight_timeout_s``."""
        deadline = now - self.reservation_timeout_s
        while self._reserved:
            request_id, reserved_at = next(iter(self._reserved.items()))
            if reserved_at > deadline:
                break
            self._forget(request_id, reserved_at + self.reservation_timeout_s)  # when it lapsed
        deadline = now - self.in_flight_timeout_s
        while self._in_flight:
            request_id, entry = next(iter(self._in_flight.items()))
            if entry.routed_at > deadline:
                break
            self.on_completed(request_id, entry.routed_at + self.in_flight_timeout_s)

    def forget_recent(self) -> None:
        """Start the recent-work window afresh: every replica's recent work (its chance spread, its
        parts) 0, each in-flight request's share of it too, so forgetting one later subtracts nothing.
        Queued work stays. For work booked at prices since found wrong (the configured priors)."""
        self._recent = dict.fromkeys(self._recent, 0.0)
        self._recent_sq = dict.fromkeys(self._recent_sq, 0.0)
        self._recent_total = self._recent_sq_total = 0.0
        for request_id, entry in self._in_flight.items():
            self._in_flight[request_id] = entry._replace(recent_tokens=0.0, parts=(0.0,) * len(entry.parts))
        if self.parts is not None:
            self.parts.clear()
        for replica_id in self._local:
            self._changed(replica_id)

    # ----------------------------------------------------------------- private
    def _forget(self, request_id: str, now: float) -> None:
        """Undo a request as if never routed: its queued and its recent work
        (its busy span ends now: the replica may have started it)."""
        entry = self._in_flight.get(request_id)
        self.on_completed(request_id, now)
        if entry is None or entry.replica_id not in self._recent or self._base_s is None:
            return
        replica_id = entry.replica_id
        scale = math.exp((entry.routed_at - self._base_s) / self.window_s)
        scaled = entry.recent_tokens * scale
        if entry.parts:
            self.parts.forget(replica_id, entry.parts, scale)
        kept = max(0.0, self._recent[replica_id] - scaled)
        self._recent_total = max(0.0, self._recent_total - (self._recent[replica_id] - kept))
        self._recent[replica_id] = kept
        kept_sq = max(0.0, self._recent_sq[replica_id] - scaled * scaled)
        self._recent_sq_total = max(0.0, self._recent_sq_total - (self._recent_sq[replica_id] - kept_sq))
        self._recent_sq[replica_id] = kept_sq
        self._changed(replica_id)

    def _changed(self, replica_id: str) -> None:
        version = self._versions.get(replica_id, 0) + 1
        self._versions[replica_id] = version
        if self._least is not None:
            self._least.set(replica_id, (self.load(replica_id), self._recent[replica_id], version, replica_id))

    def _rebase(self, now: float) -> None:
        scale = math.exp((self._base_s - now) / self.window_s)
        self._recent = {r: v * scale for r, v in self._recent.items()}
        self._recent_total *= scale
        self._recent_sq = {r: v * scale * scale for r, v in self._recent_sq.items()}
        self._recent_sq_total *= scale * scale
        if self.parts is not None:
            self.parts.rescale(scale)
        self._base_s = now
        for replica_id in self._local:
            self._changed(replica_id)

    def check_invariants(self) -> None:
        assert all(request_id in self._in_flight for request_id in self._reserved), "reservation not in flight"
        local, order = {r: 0.0 for r in self._local}, {}
        for request_id, entry in self._in_flight.items():
            local[entry.replica_id] += entry.num_tokens
            order.setdefault(entry.replica_id, []).append(request_id)
        assert order == {r: list(ids) for r, ids in self._in_flight_at.items() if ids}, "in-flight order per replica"
        for replica_id, value in self._local.items():
            assert value >= 0 and self._foreign[replica_id] >= 0, replica_id
            assert math.isclose(value, local[replica_id], rel_tol=1e-6, abs_tol=1e-6), (replica_id, value)
        assert math.isclose(sum(self.load(r) for r in self._local), self._total, rel_tol=1e-6, abs_tol=1e-3)
        assert set(self._recent) == set(self._recent_sq) == set(self._local) == set(self._versions)
        assert math.isclose(sum(self._recent.values()), self._recent_total, rel_tol=1e-6, abs_tol=1e-3)
        assert math.isclose(sum(self._recent_sq.values()), self._recent_sq_total, rel_tol=1e-6, abs_tol=1e-3)
        if self.parts is not None:
            self.parts.check_invariants(set(self._local))
        if self._busy is not None:
            self._busy.check_invariants()
            counts = {r: len(order.get(r, ())) for r in self._local}
            assert set(self._busy.replica_ids) == set(counts), "busy spans of another replica set"
            assert counts == {r: self._busy.num_in_flight(r) for r in counts}, "busy spans disagree"
        if self._least is not None:
            self._least.check_invariants()
            assert len(self._least) == len(self._versions), "a replica without its least-loaded entry"
            for replica_id, version in self._versions.items():
                load, recent, entry_version, _ = self._least.entry(replica_id)
                assert entry_version == version and recent == self._recent[replica_id], replica_id
                assert math.isclose(load, self.load(replica_id), rel_tol=1e-6, abs_tol=1e-6), replica_id
