"""The Worker deployment: one engine per replica, exposed to Ray Serve.

A thin adapter: generation, stats and cache summaries all come from
``worker.AsyncEngine`` and ``cache.summary``; this file only names them for Serve.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import os
import time
from collections.abc import AsyncIterator

from ray import serve

from worker import AsyncEngine, EngineConfig
from worker.audit import audit
from worker.messages import WorkerBatch, WorkerRequest
from worker.results import GenerationResult, ItemError, ReplicaStats, TokenEvent
from worker.stats_board import StatsPublisher

logger = logging.getLogger("kvroute.worker")
DRAIN_TIMEOUT_S = 20.0  # __del__ waits this long for work Serve's drain left behind


@serve.deployment(name="Worker")
class Worker:
    def __init__(self, engine_config: EngineConfig, router_block_size: int, stats_period_s: float) -> None:
        context = serve.get_replica_context()
        self.replica_id = context.replica_id.to_full_id_str()
        self.engine = AsyncEngine(engine_config)
        self._router_block_size = router_block_size
        self._summary_versions = itertools.count(1)
        self._publisher = StatsPublisher(context.app_name, self.replica_id, stats_period_s, self._stats_with_audit)
        self._publisher.start()

    async def generate(self, request: WorkerRequest) -> GenerationResult:
        result = await self.engine.generate(request.prompt_token_ids, request.params, salt=request.salt, request_id=request.request_id)
        return dataclasses.replace(result, replica_id=self.replica_id)

    async def generate_stream(self, request: WorkerRequest) -> AsyncIterator[TokenEvent | GenerationResult]:
        """Each token as it is produced, then the result."""
        stream = self.engine.stream(request.prompt_token_ids, request.params, salt=request.salt, request_id=request.request_id)
        async for item in stream:
            yield dataclasses.replace(item, replica_id=self.replica_id)

    async def generate_batch(self, batch: WorkerBatch) -> list[GenerationResult | ItemError]:
        """Results in batch order; a failed item becomes an :class:`ItemError`."""
        results = await asyncio.gather(*(self.generate(r) for r in batch.requests), return_exceptions=True)
        return [r if isinstance(r, GenerationResult) else ItemError.from_exception(r) for r in results]

    def model_info(self) -> dict:
        return self.engine.model_info()

    def stats(self) -> ReplicaStats:
        return ReplicaStats(self.replica_id, os.getpid(), self.engine.stats)

    async def record_routing_stats(self) -> dict:
        summary = await asyncio.to_thread(
            self.engine.cache_summary, self._router_block_size, replica_id=self.replica_id,
            version=next(self._summary_versions), timestamp_s=time.time(),
        )
        return summary.to_dict()

    def check_health(self) -> None:
        self.engine.check_health()

    async def _stats_with_audit(self) -> ReplicaStats:
        """Stats, plus an audit (invariants, no leaked blocks) when idle."""
        stats = self.stats()
        if stats.engine["num_running"] == 0 and stats.engine["num_waiting"] == 0:
            stats = dataclasses.replace(stats, audit=(await asyncio.to_thread(audit, self.engine)).to_dict())
        return stats

    async def __del__(self) -> None:
        """Serve calls this after draining its ongoing requests (scale-down,
        redeploy, shutdown): finish what the engine still holds, then stop."""
        self._publisher.stop()
        try:
            await self.engine.wait_idle(DRAIN_TIMEOUT_S)
        except TimeoutError:
            logger.warning("%s: engine still busy after %.0f s; shutting down anyway", self.replica_id, DRAIN_TIMEOUT_S)
        await self.engine.shutdown()
