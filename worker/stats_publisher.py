"""The loop that posts one Worker replica's stats to its app's board.

No Ray here: the board is handed in by the adapter (``worker/replica.py``
with ``worker.stats_board.RayBoard``), so the loop runs in a test.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Protocol

from worker.results import ReplicaStats


class Board(Protocol):
    """Where replicas post their stats (the Ray one: ``worker.stats_board.RayBoard``)."""

    async def put(self, replica_id: str, stats: ReplicaStats) -> None: ...

    def remove(self, replica_id: str) -> None: ...


class StatsPublisher:
    """Posts one replica's stats to its app's board every ``period_s``.

    ``collect`` is an async callable returning the stats. The board
    ``open_board()`` gives is kept (a board nobody references is collected)
    and opened afresh after a failure (the board's owner died; opening
    recreates it).
    """

    def __init__(self, replica_id: str, period_s: float, collect: Callable[[], Awaitable[ReplicaStats]],
                 open_board: Callable[[], Board], *, sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        self._replica_id = replica_id
        self._period_s = period_s
        self._collect = collect
        self._open_board = open_board
        self._sleep = sleep
        self._board: Board | None = None
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            try:
                stats = await self._collect()
                self._board = self._board or self._open_board()
                await self._board.put(self._replica_id, stats)
            except Exception:  # noqa: BLE001 - the next round retries with a fresh board
                self._board = None
            await self._sleep(self._period_s)

    def stop(self) -> None:
        """Stop posting and take this replica off the board."""
        if self._task is not None:
            self._task.cancel()
        if self._board is not None:
            self._board.remove(self._replica_id)
