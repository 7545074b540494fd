"""The Worker deployment: one engine per replica, exposed to Ray Serve.

A thin adapter over ``worker.AsyncEngine``, ``worker.replica_core`` (stats,
cache summaries, drain), ``worker.stats_publisher`` and ``worker.kv_fetch``
(a hinted request first fetches its prefix from the owner; ``export_prefix``
is the owner's side, reached through ``worker.kv_transport``) and
``cache.summary_sender`` (the routing stats, bases put with ``ray.put``):
it names them for Serve.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import time
from collections.abc import AsyncIterator

import ray
from ray import serve

from cache.summary_sender import SummarySender
from worker import AsyncEngine, EngineConfig
from worker.config import FetchConfig
from worker.kv_fetch import PrefixFetcher
from worker.kv_transport import ServePeerTransport, probe_bandwidth
from worker.messages import ExportReply, ExportRequest, WorkerBatch, WorkerRequest
from worker.results import GenerationResult, ItemError, ReplicaStats, TokenEvent
from worker.stats_board import RayBoard
from worker.replica_core import ReplicaReporter, drain_and_shutdown
from worker.stats_publisher import StatsPublisher

DRAIN_TIMEOUT_S = 20.0  # __del__ waits this long for work Serve's drain left behind


@serve.deployment(name="Worker")
class Worker:
    def __init__(self, engine_config: EngineConfig, router_block_size: int, stats_period_s: float,
                 fetch_config: FetchConfig | None = None, summary_mode: str = "stream") -> None:
        context = serve.get_replica_context()
        self.replica_id = context.replica_id.to_full_id_str()
        self.engine = AsyncEngine(engine_config)
        fetch_config = fetch_config or FetchConfig()
        transport = ServePeerTransport(context.app_name, context.deployment)
        bandwidth = probe_bandwidth(fetch_config.probe_bytes) if fetch_config.enabled else None
        self._fetcher = PrefixFetcher(self.engine, self.replica_id, fetch_config, transport, bandwidth_bytes_per_s=bandwidth)
        self._summaries = SummarySender(self.replica_id, summary_mode, put=ray.put)
        self._reporter = ReplicaReporter(self.engine, self.replica_id, router_block_size, clock=time.time, pid=os.getpid(),
                                         extra_stats=lambda: {**self._fetcher.stats(), **self._summaries.stats()})
        self._publisher = StatsPublisher(self.replica_id, stats_period_s, self._reporter.stats_with_audit, lambda: RayBoard(context.app_name))
        self._publisher.start()

    async def generate(self, request: WorkerRequest) -> GenerationResult:
        await self._fetcher.prepare(request.prompt_token_ids, request.salt, request.fetch)
        result = await self.engine.generate(request.prompt_token_ids, request.params, salt=request.salt, request_id=request.request_id)
        return dataclasses.replace(result, replica_id=self.replica_id)

    async def generate_stream_chunks(self, request: WorkerRequest, interval_s: float = 0.0,
                                     ) -> AsyncIterator[list[TokenEvent | GenerationResult]]:
        """Each token as it is produced, then the result, in lists
        (``AsyncEngine.stream_chunks``): one Ray message per list, at most one
        per ``interval_s`` after the first token, the result at once."""
        await self._fetcher.prepare(request.prompt_token_ids, request.salt, request.fetch)
        chunks = self.engine.stream_chunks(request.prompt_token_ids, request.params, salt=request.salt,
                                           request_id=request.request_id, interval_s=interval_s)
        async with contextlib.aclosing(chunks):
            async for chunk in chunks:
                yield [dataclasses.replace(item, replica_id=self.replica_id) for item in chunk]

    async def generate_batch(self, batch: WorkerBatch) -> list[GenerationResult | ItemError]:
        """Results in batch order; a failed item becomes an :class:`ItemError`."""
        await self._fetcher.prepare(batch.shared_token_ids, batch.salt, batch.fetch)
        results = await asyncio.gather(*(self.generate(r) for r in batch.requests), return_exceptions=True)
        return [r if isinstance(r, GenerationResult) else ItemError.from_exception(r) for r in results]

    async def export_prefix(self, request: ExportRequest) -> ExportReply:
        """Another replica's fetch: the KV of a prefix this one caches, as the call's return (object store)."""
        return await self._fetcher.export(request)

    def stats(self) -> ReplicaStats:
        return self._reporter.stats()

    async def record_routing_stats(self) -> dict:
        """The cache summary for Serve's routing stats (with what a fetch costs here): whole, or a
        stream's delta (``cache.summary_sender``)."""
        summary = dataclasses.replace(await self._reporter.routing_summary(), **self._fetcher.fetch_prices())
        return self._summaries.encode(summary)

    def check_health(self) -> None:
        self.engine.check_health()

    async def __del__(self) -> None:
        """Serve calls this after draining its ongoing requests (scale-down,
        redeploy, shutdown): finish what the engine still holds, then stop."""
        self._publisher.stop()
        await drain_and_shutdown(self.engine, DRAIN_TIMEOUT_S, self.replica_id)
