"""How loaded each replica is, as one router estimates it."""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from dataclasses import dataclass

_REBASE_WINDOWS = 50.0  # rescale the recent-work counters before exp() overflows


@dataclass(frozen=True, slots=True)
class _InFlight:
    replica_id: str
    num_tokens: float
    routed_at: float


class LoadTracker:
    """Two views of each replica's load, in tokens of work.

    **Queued work** ``load(r) = local(r) + foreign(r)``: ``local`` sums the
    work of this router's requests on ``r`` that have not completed (exact,
    updated at once); ``foreign = max(0, reported - local at report time)``
    is what other routers put there, as of the replica's last report. With
    one router ``foreign`` stays ~0; with several, each still sees its own
    pending work at once, which is what keeps routers from herding onto a
    replica between reports.

    **Recent work** ``recent_work(r, now)``: the work this router sent to
    ``r``, each request decayed by ``exp(-age / window_s)``. It measures the
    long-run share of work, which the instantaneous queue (often 0–2
    requests) cannot.

    In-flight entries that never hear a completion are dropped after
    ``in_flight_timeout_s``: a lost callback must not leak load forever.

    Invariants (checked by :meth:`check_invariants`):

    1. ``_local[r] == sum of in-flight work on r`` and ``_total == sum(load)``.
    2. Recent counters are stored multiplied by ``exp((t - _base_s) / window_s)``
       so that decay needs no updates; ``_recent_total == sum(_recent)``.
    3. The heap holds, for each tracked replica, exactly one entry with its
       current version: ``(load, scaled recent work, version, replica)``;
       others are stale and skipped. The least loaded replica is on top, the
       one with the least recent work first among equal loads.

    Cost: updates O(log N) amortised; :meth:`least_loaded_replica` O(log N)
    amortised; the rest O(1) (a rebase every ``50 × window_s`` is O(N)).
    """

    def __init__(self, in_flight_timeout_s: float = 600.0, window_s: float = 120.0) -> None:
        if not in_flight_timeout_s > 0:
            raise ValueError(f"in_flight_timeout_s must be > 0, got {in_flight_timeout_s!r}")
        if not window_s > 0:
            raise ValueError(f"window_s must be > 0, got {window_s!r}")
        self.in_flight_timeout_s = float(in_flight_timeout_s)
        self.window_s = float(window_s)
        self._local: dict[str, float] = {}
        self._foreign: dict[str, float] = {}
        self._total = 0.0
        self._in_flight: OrderedDict[str, _InFlight] = OrderedDict()  # oldest first
        self._recent: dict[str, float] = {}
        self._recent_total = 0.0
        self._base_s: float | None = None
        self._versions: dict[str, int] = {}
        self._heap: list[tuple[float, float, int, str]] = []

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

    def recent_work(self, replica_id: str, now: float) -> float:
        if self._base_s is None:
            return 0.0
        return self._recent.get(replica_id, 0.0) * math.exp((self._base_s - now) / self.window_s)

    def recent_total(self, now: float) -> float:
        if self._base_s is None:
            return 0.0
        return self._recent_total * math.exp((self._base_s - now) / self.window_s)

    def num_in_flight(self) -> int:
        return len(self._in_flight)

    def least_loaded_replica(self) -> str | None:
        """The least loaded replica (least recent work among equals); None if none."""
        heap, versions = self._heap, self._versions
        while heap:
            _, _, version, replica_id = heap[0]
            if versions.get(replica_id) == version:
                return replica_id
            heapq.heappop(heap)
        return None

    # ------------------------------------------------------------------ updates
    def add_replica(self, replica_id: str) -> None:
        if replica_id not in self._local:
            self._local[replica_id] = 0.0
            self._foreign[replica_id] = 0.0
            self._recent[replica_id] = 0.0
            self._changed(replica_id)

    def remove_replica(self, replica_id: str) -> None:
        if replica_id not in self._local:
            return
        self._total -= self.load(replica_id)
        del self._local[replica_id], self._foreign[replica_id], self._versions[replica_id]
        self._recent_total = max(0.0, self._recent_total - self._recent.pop(replica_id))
        for request_id in [k for k, v in self._in_flight.items() if v.replica_id == replica_id]:
            del self._in_flight[request_id]

    def on_routed(self, request_id: str, replica_id: str, num_tokens: float, now: float) -> None:
        """This router sent ``num_tokens`` of work to ``replica_id``."""
        if not num_tokens >= 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens!r}")
        self.expire(now)
        self.on_completed(request_id)  # a reused id replaces its old entry
        self.add_replica(replica_id)
        self._in_flight[request_id] = _InFlight(replica_id, float(num_tokens), now)
        self._local[replica_id] += num_tokens
        self._total += num_tokens
        if self._base_s is None:
            self._base_s = now
        elif now - self._base_s > _REBASE_WINDOWS * self.window_s:
            self._rebase(now)
        scaled = num_tokens * math.exp((now - self._base_s) / self.window_s)
        self._recent[replica_id] += scaled
        self._recent_total += scaled
        self._changed(replica_id)

    def on_completed(self, request_id: str) -> bool:
        """The request finished (or failed); returns False if it was unknown."""
        entry = self._in_flight.pop(request_id, None)
        if entry is None:
            return False
        if entry.replica_id in self._local:
            self._local[entry.replica_id] = max(0.0, self._local[entry.replica_id] - entry.num_tokens)
            self._total -= entry.num_tokens
            self._changed(entry.replica_id)
        return True

    def on_report(self, replica_id: str, load_tokens: float) -> None:
        """The replica says it holds ``load_tokens`` of work (all routers')."""
        if not load_tokens >= 0:
            raise ValueError(f"load_tokens must be >= 0, got {load_tokens!r}")
        self.add_replica(replica_id)
        foreign = max(0.0, load_tokens - self._local[replica_id])
        self._total += foreign - self._foreign[replica_id]
        self._foreign[replica_id] = foreign
        self._changed(replica_id)

    def expire(self, now: float) -> None:
        """Drop in-flight entries older than ``in_flight_timeout_s``."""
        deadline = now - self.in_flight_timeout_s
        while self._in_flight:
            request_id, entry = next(iter(self._in_flight.items()))
            if entry.routed_at > deadline:
                break
            self.on_completed(request_id)

    # ----------------------------------------------------------------- private
    def _changed(self, replica_id: str) -> None:
        version = self._versions.get(replica_id, 0) + 1
        self._versions[replica_id] = version
        heapq.heappush(self._heap, (self.load(replica_id), self._recent[replica_id], version, replica_id))
        if len(self._heap) > 4 * len(self._versions) + 64:  # drop stale entries
            self._heap = [e for e in self._heap if self._versions.get(e[3]) == e[2]]
            heapq.heapify(self._heap)

    def _rebase(self, now: float) -> None:
        scale = math.exp((self._base_s - now) / self.window_s)
        self._recent = {r: v * scale for r, v in self._recent.items()}
        self._recent_total *= scale
        self._base_s = now
        self._heap = []
        for replica_id in self._local:
            self._changed(replica_id)

    def check_invariants(self) -> None:
        local = {r: 0.0 for r in self._local}
        for entry in self._in_flight.values():
            local[entry.replica_id] += entry.num_tokens
        for replica_id, value in self._local.items():
            assert value >= 0 and self._foreign[replica_id] >= 0, replica_id
            assert math.isclose(value, local[replica_id], rel_tol=1e-6, abs_tol=1e-6), (replica_id, value)
        assert math.isclose(sum(self.load(r) for r in self._local), self._total, rel_tol=1e-6, abs_tol=1e-3)
        assert set(self._recent) == set(self._local) == set(self._versions)
        assert math.isclose(sum(self._recent.values()), self._recent_total, rel_tol=1e-6, abs_tol=1e-3)
        current = {(e[3], e[2]) for e in self._heap if self._versions.get(e[3]) == e[2]}
        assert current == set(self._versions.items()), "a replica without a current heap entry"
        for load, recent, version, replica_id in self._heap:
            if self._versions.get(replica_id) == version:
                assert math.isclose(load, self.load(replica_id), rel_tol=1e-6, abs_tol=1e-6), replica_id
                assert recent == self._recent[replica_id], replica_id
