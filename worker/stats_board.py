"""A tiny Ray actor where every Worker replica posts its stats, so the
ingress can show per-replica stats whatever request router is in use.

Workers push every ``period_s`` (``worker.stats_publisher``); readers drop
entries older than ``max_age_s`` (a replica that died or was scaled away).
Created on first use (``get_if_exists``), owned by the replica that created
it: if that replica dies the board dies with it and the next push recreates it.
"""

from __future__ import annotations

import dataclasses
import time

import ray

from worker.results import ReplicaStats

NAMESPACE = "kvroute"


@ray.remote(num_cpus=0, max_restarts=0)
class StatsBoard:
    def __init__(self) -> None:
        self._replica_to_entry: dict[str, tuple[float, ReplicaStats]] = {}

    def put(self, replica_id: str, stats: ReplicaStats) -> None:
        self._replica_to_entry[replica_id] = (time.time(), stats)

    def remove(self, replica_id: str) -> None:
        self._replica_to_entry.pop(replica_id, None)

    def get_all(self, max_age_s: float) -> dict[str, ReplicaStats]:
        now = time.time()
        return {
            replica_id: dataclasses.replace(stats, age_s=round(now - posted, 3))
            for replica_id, (posted, stats) in self._replica_to_entry.items()
            if now - posted <= max_age_s
        }


def board_name(app_name: str) -> str:
    return f"kvroute-stats::{app_name}"


def get_board(app_name: str, create: bool) -> ray.actor.ActorHandle | None:
    """The app's board; created if missing and ``create``, else None when absent."""
    if create:
        return StatsBoard.options(name=board_name(app_name), namespace=NAMESPACE, get_if_exists=True).remote()
    try:
        return ray.get_actor(board_name(app_name), namespace=NAMESPACE)
    except ValueError:
        return None


class RayBoard:
    """The app's board (created if missing) as ``StatsPublisher`` posts to it."""

    def __init__(self, app_name: str) -> None:
        self._handle = get_board(app_name, create=True)

    async def put(self, replica_id: str, stats: ReplicaStats) -> None:
        await self._handle.put.remote(replica_id, stats)

    def remove(self, replica_id: str) -> None:
        self._handle.remove.remote(replica_id)
