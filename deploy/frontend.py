"""The ingress's logic, independent of HTTP: validate, build worker requests
(with the routing block hashes), dispatch through the Worker handle, and turn
worker failures into definite HTTP errors.

Dispatch never raises anything but :class:`APIError`; the HTTP layer only
formats. Overload is 429 (the engine's queue is full) or 503 (Serve's queue
is full, or no replica could take the request), both with ``Retry-After``.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import itertools
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Sequence

from ray.serve import context as serve_context

from cache import block_hashes
from deploy.errors import APIError
from deploy.metrics import IngressMetrics
from deploy.settings import AppConfig
from worker import EngineOverloaded, SamplingParams
from worker.messages import WorkerBatch, WorkerRequest

logger = logging.getLogger("kvroute.ingress")

MAX_BATCH_GROUP = 16  # prompts per worker call in /generate_batch
MAX_REPLICA_RETRIES = 2  # re-dispatches after the serving replica died
_REPLICA_FAILURES = ("ActorDiedError", "RayActorError", "ActorUnavailableError", "WorkerCrashedError")


def _is_replica_failure(error: BaseException) -> bool:
    return any(cls.__name__ in _REPLICA_FAILURES for cls in type(error).__mro__)


def _call(method, *args):
    """``method.remote(*args)`` as a request of its own.

    Serve stamps every handle call made while serving an HTTP request with
    that request's internal id, so the calls one request fans out (batch
    groups, OpenAI choices and prompts) would all share one id. A request
    router that hands each replica to the request it chose it for (ours:
    no ``FIFOMixin``) matches by that id and would fulfil only one of them;
    the rest would wait forever. Each call here gets a fresh id, in a copy of
    the context, so nothing else sees the change."""

    def remote():
        current = serve_context._get_serve_request_context()  # noqa: SLF001 - see above
        own = dataclasses.replace(current, _internal_request_id=uuid.uuid4().hex)
        serve_context._serve_request_context.set(own)  # noqa: SLF001
        return method.remote(*args)

    return contextvars.copy_context().run(remote)


class Frontend:
    def __init__(self, config: AppConfig, worker_handle, tokenizer, model_info: dict) -> None:
        self.config = config
        self.worker = worker_handle
        self.tokenizer = tokenizer
        self.vocab_size: int = model_info["vocab_size"]
        self.max_model_len: int = model_info["max_model_len"]
        self.eos_token_id: int | None = model_info.get("eos_token_id")
        self.metrics = IngressMetrics()
        self._request_ids = itertools.count()
        self._id_prefix = f"{os.getpid():x}"

    # ------------------------------------------------------------- validation
    def check_prompt(self, token_ids: Sequence[int], max_new_tokens: int, param: str = "prompt") -> tuple[int, ...]:
        limits = self.config.limits
        if not token_ids:
            raise APIError(400, f"{param} is empty", param=param)
        if len(token_ids) > limits.max_prompt_tokens:
            raise APIError(
                400, f"{param} has {len(token_ids)} tokens, over the limit of {limits.max_prompt_tokens}", param=param
            )
        bad = next((t for t in token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} in {param} is outside the vocabulary [0, {self.vocab_size})", param=param)
        if max_new_tokens > limits.max_new_tokens:
            raise APIError(
                400, f"max new tokens {max_new_tokens} is over the limit of {limits.max_new_tokens}", param="max_tokens"
            )
        if len(token_ids) + max_new_tokens > self.max_model_len:
            raise APIError(
                400,
                f"{param} ({len(token_ids)} tokens) + {max_new_tokens} new tokens exceeds the model's context"
                f" length of {self.max_model_len}",
                param=param,
            )
        return tuple(token_ids)

    def check_stop_token_ids(self, stop_token_ids: Sequence[int] | None) -> tuple[int, ...]:
        stop = tuple(stop_token_ids or ())
        bad = next((t for t in stop if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"stop token id {bad} is outside the vocabulary", param="stop_token_ids")
        return stop

    def sampling(self, **fields) -> SamplingParams:
        try:
            return SamplingParams(**{k: v for k, v in fields.items() if v is not None})
        except ValueError as error:
            raise APIError(400, str(error)) from None

    def make_request(self, token_ids: tuple[int, ...], params: SamplingParams, salt: str | None) -> WorkerRequest:
        return WorkerRequest(
            request_id=f"req-{self._id_prefix}-{next(self._request_ids)}",
            prompt_token_ids=token_ids,
            params=params,
            salt=salt,
            block_hashes=tuple(block_hashes(token_ids, self.config.router_block_size, salt)),
        )

    # --------------------------------------------------------------- dispatch
    async def run(self, request: WorkerRequest) -> dict:
        """The worker's result. A replica that dies under the request is retried
        on another (the router drops the dead one at once), up to
        ``MAX_REPLICA_RETRIES`` times; then 503 with ``Retry-After``."""
        start = time.monotonic()
        for attempt in range(MAX_REPLICA_RETRIES + 1):
            response = _call(self.worker.generate, request)
            try:
                result = await response
                break
            except asyncio.CancelledError:  # the client went away: stop the work too
                response.cancel()
                raise
            except Exception as error:  # noqa: BLE001 - every failure gets a definite status
                if not (_is_replica_failure(error) and attempt < MAX_REPLICA_RETRIES):
                    raise self._as_api_error(error) from None
                self.metrics.retries.inc()
                logger.warning("retrying %s after replica failure: %s", request.request_id, type(error).__name__)
        self.metrics.observe_result(result, time.monotonic() - start)
        return result

    async def stream(self, request: WorkerRequest) -> AsyncIterator[dict]:
        """Token events as the worker produces them; the last carries ``done``.
        Closing the iterator early (client gone, stop string) cancels the
        request. A replica failure before the first event is retried elsewhere."""
        start = last = time.monotonic()
        num_events, finished = 0, False
        for attempt in range(MAX_REPLICA_RETRIES + 1):
            generator = _call(self.worker.options(stream=True).generate_stream, request)
            try:
                async for event in generator:
                    now = time.monotonic()
                    if num_events == 0:
                        self.metrics.ttft_s.labels(replica=str(event.get("replica_id", "unknown"))).observe(now - start)
                    elif "token_id" in event:
                        self.metrics.itl_s.observe(now - last)
                    last, num_events = now, num_events + 1
                    if event.get("done"):
                        finished = True
                        self.metrics.observe_result(event, now - start, ttft_seen=True)
                    yield event
                return
            except Exception as error:  # noqa: BLE001
                if not (_is_replica_failure(error) and num_events == 0 and attempt < MAX_REPLICA_RETRIES):
                    raise self._as_api_error(error) from None
                self.metrics.retries.inc()
                logger.warning("retrying stream %s after replica failure: %s", request.request_id, type(error).__name__)
            finally:
                if not finished:
                    generator.cancel()

    async def run_batch(self, items: list[WorkerRequest | APIError]) -> list[dict]:
        """Results in input order. Prompts sharing their first routing block go
        to one replica together (it computes the shared prefix once); bad items
        and failed groups become per-item ``{"error": ...}`` entries."""
        outputs: list[dict | None] = [None] * len(items)
        groups: dict[tuple, list[int]] = {}
        for index, item in enumerate(items):
            if isinstance(item, APIError):
                outputs[index] = item.body()
                continue
            key = (item.salt, item.block_hashes[0]) if item.block_hashes else ("solo", index)
            groups.setdefault(key, []).append(index)
        chunks = [members[i : i + MAX_BATCH_GROUP] for members in groups.values() for i in range(0, len(members), MAX_BATCH_GROUP)]
        results = await asyncio.gather(*(self._run_group([items[i] for i in c]) for c in chunks), return_exceptions=True)
        for chunk, result in zip(chunks, results):
            for position, index in enumerate(chunk):
                if isinstance(result, APIError):
                    outputs[index] = result.body()
                elif isinstance(result, BaseException):
                    outputs[index] = self._as_api_error(result).body()
                else:
                    outputs[index] = self._item_output(result[position])
        return outputs

    async def _run_group(self, requests: list[WorkerRequest]) -> list[dict]:
        shared = _common_prefix([r.prompt_token_ids for r in requests])
        num_shared_blocks = len(shared) // self.config.router_block_size
        batch = WorkerBatch(tuple(requests), requests[0].block_hashes[:num_shared_blocks], shared, requests[0].salt)
        start = time.monotonic()
        try:
            results = await _call(self.worker.generate_batch, batch)
        except Exception as error:  # noqa: BLE001
            raise self._as_api_error(error) from None
        for result in results:
            if "error" not in result:
                self.metrics.observe_result(result, time.monotonic() - start)
        return results

    def _item_output(self, result: dict) -> dict:
        if "error" in result:
            status = 429 if result.get("error_type") == "EngineOverloaded" else 400
            if result.get("error_type") not in ("ValueError", "EngineOverloaded"):
                status = 500
            return APIError(status, result["error"]).body()
        return result

    # ---------------------------------------------------------------- errors
    def _as_api_error(self, error: BaseException) -> APIError:
        if isinstance(error, APIError):
            return error
        retry = self.config.retry_after_s
        if isinstance(error, EngineOverloaded):
            self.metrics.rejected.labels(reason="engine_queue_full").inc()
            return APIError(429, f"server busy: {error}", code="engine_overloaded", retry_after_s=retry)
        if isinstance(error, ValueError):
            return APIError(400, str(error))
        name = type(error).__name__
        if name in ("BackPressureError", "DeploymentUnavailableError"):
            self.metrics.rejected.labels(reason="serve_queue_full").inc()
            return APIError(503, f"server busy: {error}", code="overloaded", retry_after_s=retry)
        if _is_replica_failure(error):
            logger.warning("worker replica failed mid-request: %s", error)
            return APIError(503, "a worker replica failed; retry the request", code="replica_failed", retry_after_s=retry)
        logger.exception("unexpected worker failure", exc_info=error)
        return APIError(500, f"internal error: {name}: {error}")


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
