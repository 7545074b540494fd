"""Where a cold prefix goes: a rule every router computes alike.

A request is *cold* when no replica holds more of it than the shared part
(nothing, or a system prompt every candidate holds): placing it decides
where a new prefix's cache will live. A router that places it by its own
view (its own recent work, its own queue) disagrees with another router
that has seen other requests, and the two home the same new prefix on two
replicas. :func:`cold_home` uses only what every router holds alike: the
hash ring (a pure function of the replica set) and the replicas' summaries.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

from router.reported_work import ReportedWork
from router.ring import HashRing

COLD_HOME_MODES = ("cost", "ring", "bounded", "least_of_two")


def cold_home(mode: str, ring: HashRing, key: int, live: Collection[str],
              shared_load: Callable[[str], float], mean_load: float, load_factor: float,
              request_work: float) -> str | None:
    """The replica a cold request with ring key ``key`` goes to, or None
    (``mode`` "cost": the cost rule decides, as before this rule existed).

    ``shared_load``: a replica's load as every router sees it (from its
    summaries only), ``mean_load`` its mean over the fleet.

    - "ring": the first live node clockwise from ``key``.
    - "bounded": consistent hashing with bounded loads (Mirrokni et al.):
      the first live node from ``key`` whose shared load is at most
      ``load_factor`` × the mean plus one request (``request_work``), so a
      replica the summaries show over its share takes no new prefix.
    - "least_of_two": of the first two live nodes, the one with the lower
      shared load (the earlier on a tie): two choices, the same for every
      router that holds the same summaries.

    Routers holding the same summaries return the same replica; O(nodes
    walked) ring steps (the walk stops at the first eligible node)."""
    if mode == "cost":
        return None
    walk = (replica_id for replica_id in ring.walk(key) if replica_id in live)
    if mode == "ring":
        return next(walk, None)
    if mode == "least_of_two":
        first = next(walk, None)
        second = next(walk, None)
        if first is None or second is None:
            return first
        return second if shared_load(second) < shared_load(first) else first
    bound = load_factor * mean_load + request_work
    fallback = None
    for replica_id in walk:
        if shared_load(replica_id) <= bound:
            return replica_id
        if fallback is None:
            fallback = replica_id
    return fallback


def home_first(mode: str, ring: HashRing, key: int, live: Collection[str], reported: ReportedWork, now: float,
               load_factor: float, request_work: float, cached_at: dict[str, int],
               cached_there: Callable[[str], int], ranked: list[str]) -> list[str]:
    """``ranked`` (the cost rule's order) with the cold home first when the
    request is cold: the home holds as much of it as any candidate
    (``cached_at``, filled in for the home by ``cached_there`` if missing).
    A warm request is left to the cost rule. The shared load is what the
    summaries report (:meth:`ReportedWork.value`: decayed done work plus the
    reported queue) plus what this router sent since (its own, unreported:
    the one part routers do not share, so they disagree only near the bound
    or within a summary period)."""
    def shared_load(replica_id: str) -> float:
        return reported.value(replica_id, now) + reported.pending(replica_id)
    mean = sum(map(shared_load, ring.nodes)) / max(len(ring), 1) if mode == "bounded" else 0.0
    home = cold_home(mode, ring, key, live, shared_load, mean, load_factor, request_work)
    if home is None or home == ranked[0]:
        return ranked
    if home not in cached_at:
        cached_at[home] = cached_there(home)
    if cached_at[home] < max(cached_at.values()):
        return ranked  # warm somewhere else: the cost rule decides
    return [home] + [r for r in ranked if r != home]
