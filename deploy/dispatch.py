"""Sending worker requests through a :class:`~deploy.worker_client.WorkerClient`:
re-dispatch after a replica failure, batch grouping, ingress metrics.

Dispatch raises nothing but :class:`~deploy.errors.APIError`. A replica that
dies under a request is retried on another (the router drops the dead one at
once), up to ``MAX_REPLICA_RETRIES`` times; a stream only before its first
event. Overload is 429 (the engine's queue is full) or 503 (Serve's queue is
full, or no replica could take the request), both with ``Retry-After``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

from deploy.errors import APIError
from deploy.metrics import IngressMetrics
from deploy.worker_client import Busy, ReplicaFailed, WorkerClient, engine_error, item_error
from worker.messages import WorkerBatch, WorkerRequest
from worker.results import GenerationResult, ItemError, TokenEvent

logger = logging.getLogger("kvroute.ingress")

MAX_BATCH_GROUP = 16  # prompts per worker call in /generate_batch
MAX_REPLICA_RETRIES = 2  # re-dispatches after the serving replica died


class Dispatcher:
    def __init__(self, client: WorkerClient, metrics: IngressMetrics, router_block_size: int, retry_after_s: int) -> None:
        self.client = client
        self.metrics = metrics
        self.router_block_size = router_block_size
        self.retry_after_s = retry_after_s

    async def run(self, request: WorkerRequest) -> GenerationResult:
        start = time.monotonic()
        for attempt in range(MAX_REPLICA_RETRIES + 1):
            try:
                result = await self.client.generate(request)
                break
            except ReplicaFailed:
                if attempt == MAX_REPLICA_RETRIES:
                    raise
                self._retrying(request)
            except APIError as error:
                raise self._counted(error) from None
        self.metrics.observe_result(result, time.monotonic() - start)
        return result

    async def stream_lists(self, request: WorkerRequest) -> AsyncIterator[list[TokenEvent | GenerationResult]]:
        """Token events as the worker produces them, then the result, in the
        non-empty lists they arrived in (the worker gathers tokens for up to
        ``stream_interval_ms``), so a route can answer each list with one
        message. Closing the iterator early (client gone, stop string)
        cancels the request.

        Tokens that arrive together share the gap since the ones before: each
        is observed at that gap over their number, so the inter-token latency
        histogram shows the generation's pace, not the transport's bursts."""
        start = last = time.monotonic()
        num_events = 0
        for attempt in range(MAX_REPLICA_RETRIES + 1):
            stream = self.client.stream_chunks(request)
            try:
                async for chunk in stream:
                    now = time.monotonic()
                    tokens = sum(isinstance(item, TokenEvent) for item in chunk)
                    gap = now - last
                    if num_events == 0:
                        self.metrics.observe_ttft(chunk[0].replica_id or "unknown", now - start)
                        tokens -= isinstance(chunk[0], TokenEvent)  # the first token is the TTFT
                        gap = 0.0  # the rest came with it
                    for _ in range(tokens):
                        self.metrics.observe_itl(gap / tokens)
                    last, num_events = now, num_events + len(chunk)
                    if isinstance(chunk[-1], GenerationResult):
                        self.metrics.observe_result(chunk[-1], now - start, ttft_seen=True)
                    yield chunk
                return
            except ReplicaFailed:
                if num_events > 0 or attempt == MAX_REPLICA_RETRIES:
                    raise
                self._retrying(request)
            except APIError as error:
                raise self._counted(error) from None
            finally:
                await stream.aclose()

    async def run_batch(self, items: list[WorkerRequest | APIError]) -> list[GenerationResult | APIError]:
        """Results in input order. Prompts sharing their first routing block go
        to one replica together (it computes the shared prefix once); bad items
        and failed groups stay in place as their errors."""
        outputs: list[GenerationResult | APIError | None] = [None] * len(items)
        groups: dict[tuple, list[int]] = {}
        for index, item in enumerate(items):
            if isinstance(item, APIError):
                outputs[index] = item
                continue
            key = (item.salt, item.block_hashes[0]) if item.block_hashes else ("solo", index)
            groups.setdefault(key, []).append(index)
        chunks = [members[i : i + MAX_BATCH_GROUP] for members in groups.values() for i in range(0, len(members), MAX_BATCH_GROUP)]
        results = await asyncio.gather(*(self._run_group([items[i] for i in c]) for c in chunks), return_exceptions=True)
        for chunk, result in zip(chunks, results):
            for position, index in enumerate(chunk):
                if isinstance(result, BaseException):
                    outputs[index] = result if isinstance(result, APIError) else engine_error(result, self.retry_after_s)
                elif isinstance(result[position], ItemError):
                    outputs[index] = item_error(result[position])
                else:
                    outputs[index] = result[position]
        return outputs

    async def _run_group(self, requests: list[WorkerRequest]) -> list[GenerationResult | ItemError]:
        shared = _common_prefix([r.prompt_token_ids for r in requests])
        num_shared_blocks = len(shared) // self.router_block_size
        batch = WorkerBatch(tuple(requests), requests[0].block_hashes[:num_shared_blocks], shared, requests[0].salt)
        start = time.monotonic()
        try:
            results = await self.client.generate_batch(batch)
        except APIError as error:
            raise self._counted(error) from None
        for result in results:
            if isinstance(result, GenerationResult):
                self.metrics.observe_result(result, time.monotonic() - start)
        return results

    def _retrying(self, request: WorkerRequest) -> None:
        self.metrics.retries.inc()
        logger.warning("retrying %s after a replica failure", request.request_id)

    def _counted(self, error: APIError) -> APIError:
        if isinstance(error, Busy):
            self.metrics.rejected.labels(reason=error.reason).inc()
        return error


def _common_prefix(prompts: list[tuple[int, ...]]) -> tuple[int, ...]:
    first = prompts[0]
    length = len(first)
    for prompt in prompts[1:]:
        length = min(length, len(prompt))
        for i in range(length):
            if prompt[i] != first[i]:
                length = i
                break
    return first[:length]
