"""A :class:`~deploy.worker_client.WorkerClient` over an ``AsyncEngine`` in
this process: one replica, no Ray. The route tests serve the real app over
it (``tests/deploy/test_routes.py``); it answers as a Worker replica does.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from collections.abc import AsyncIterator

from deploy.worker_client import engine_error
from worker import AsyncEngine
from worker.messages import WorkerBatch, WorkerRequest
from worker.results import GenerationResult, ItemError, ReplicaStats, TokenEvent


class EngineClient:
    """``stream_interval_s``: as the app's ``stream_interval_ms`` (seconds)."""

    def __init__(self, engine: AsyncEngine, replica_id: str = "local", retry_after_s: int = 1,
                 stream_interval_s: float = 0.0) -> None:
        self.engine = engine
        self.replica_id = replica_id
        self.retry_after_s = retry_after_s
        self.stream_interval_s = stream_interval_s

    async def generate(self, request: WorkerRequest) -> GenerationResult:
        try:
            return await self._run(request)
        except Exception as error:  # noqa: BLE001 - mapped as the Ray client maps it
            raise engine_error(error, self.retry_after_s) from None

    async def stream_chunks(self, request: WorkerRequest) -> AsyncIterator[list[TokenEvent | GenerationResult]]:
        items = self.engine.stream_chunks(request.prompt_token_ids, request.params, salt=request.salt,
                                          request_id=request.request_id, interval_s=self.stream_interval_s)
        try:
            async for chunk in items:
                yield [dataclasses.replace(item, replica_id=self.replica_id) for item in chunk]
        except Exception as error:  # noqa: BLE001
            raise engine_error(error, self.retry_after_s) from None
        finally:
            await items.aclose()

    async def generate_batch(self, batch: WorkerBatch) -> list[GenerationResult | ItemError]:
        results = await asyncio.gather(*(self._run(r) for r in batch.requests), return_exceptions=True)
        return [r if isinstance(r, GenerationResult) else ItemError.from_exception(r) for r in results]

    async def stats(self) -> dict[str, ReplicaStats]:
        return {self.replica_id: ReplicaStats(self.replica_id, os.getpid(), self.engine.stats)}

    async def _run(self, request: WorkerRequest) -> GenerationResult:
        result = await self.engine.generate(request.prompt_token_ids, request.params, salt=request.salt, request_id=request.request_id)
        return dataclasses.replace(result, replica_id=self.replica_id)
