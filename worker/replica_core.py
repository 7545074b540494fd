"""What a Worker replica does that needs no Ray: its reports (stats with an
idle audit, numbered cache summaries) and its drain at shutdown. The adapter
(``worker/replica.py``) hands in the clock and the pid.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from worker.audit import audit
from worker.results import ReplicaStats

if TYPE_CHECKING:
    from cache.summary import CacheSummary
    from worker.async_engine import AsyncEngine

logger = logging.getLogger("kvroute.worker")


class ReplicaReporter:
    """One replica's figures: ``stats()`` (the engine's, with its measured token
    costs, then ``extra_stats()``'s keys such as the fetch counters, with the pid),
    ``stats_with_audit()`` (plus an :func:`~worker.audit.audit` when the engine
    is idle: invariants, no leaked blocks) and ``routing_summary()`` (the cache
    summary at the router's block size, numbered 1, 2, ... and stamped by
    ``clock``)."""

    def __init__(self, engine: AsyncEngine, replica_id: str, router_block_size: int, *,
                 clock: Callable[[], float], pid: int, extra_stats: Callable[[], dict] | None = None) -> None:
        self._engine = engine
        self._replica_id = replica_id
        self._router_block_size = router_block_size
        self._clock = clock
        self._pid = pid
        self._extra_stats = extra_stats
        self._summary_versions = itertools.count(1)

    def stats(self) -> ReplicaStats:
        engine = self._engine.stats
        if self._extra_stats is not None:
            engine.update(self._extra_stats())
        return ReplicaStats(self._replica_id, self._pid, engine)

    async def stats_with_audit(self) -> ReplicaStats:
        stats = self.stats()
        if stats.engine["num_running"] == 0 and stats.engine["num_waiting"] == 0:
            stats = dataclasses.replace(stats, audit=(await asyncio.to_thread(audit, self._engine)).to_dict())
        return stats

    async def routing_summary(self) -> CacheSummary:
        return await asyncio.to_thread(
            self._engine.cache_summary, self._router_block_size, replica_id=self._replica_id,
            version=next(self._summary_versions), timestamp_s=self._clock(),
        )


async def drain_and_shutdown(engine: AsyncEngine, timeout_s: float, replica_id: str) -> None:
    """Finish what the engine still holds (at most ``timeout_s``), then stop it."""
    try:
        await engine.wait_idle(timeout_s)
    except TimeoutError:
        logger.warning("%s: engine still busy after %.0f s; shutting down anyway", replica_id, timeout_s)
    await engine.shutdown()
