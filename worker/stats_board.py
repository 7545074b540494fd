"""A tiny Ray actor where every Worker replica posts its stats, so the
ingress can show per-replica stats whatever request router is in use.

Workers push every ``period_s``; readers drop entries older than
``max_age_s`` (a replica that died or was scaled away). The board is created
on first use (``get_if_exists``) and owned by the replica that created it; if
that replica dies the board dies with it and the next push recreates it.
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


class StatsPublisher:
    """Posts one replica's stats to its app's board every ``period_s``.

    ``collect`` is an async callable returning the stats dict. The board
    handle is kept (a board nobody references is collected) and re-fetched
    after a failure (the board's owner died; ``get_if_exists`` recreates it).
    """

    def __init__(self, app_name: str, replica_id: str, period_s: float, collect) -> None:
        self._app_name = app_name
        self._replica_id = replica_id
        self._period_s = period_s
        self._collect = collect
        self._board = None
        self._task = None

    def start(self) -> None:
        import asyncio

        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        import asyncio

        while True:
            try:
                stats = await self._collect()
                self._board = self._board or get_board(self._app_name, create=True)
                await self._board.put.remote(self._replica_id, stats)
            except Exception:  # noqa: BLE001 - the next round retries with a fresh board
                self._board = None
            await asyncio.sleep(self._period_s)

    def stop(self) -> None:
        """Stop posting and take this replica off the board."""
        if self._task is not None:
            self._task.cancel()
        if self._board is not None:
            self._board.remove.remote(self._replica_id)
