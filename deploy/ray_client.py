"""The Ray implementation of :class:`~deploy.worker_client.WorkerClient`:
calls on the Worker deployment's handle, each its own Serve request, and
Ray's exceptions turned into HTTP statuses by type.

Serve stamps every handle call made while serving an HTTP request with that
request's internal id, so the calls one request fans out (batch groups,
OpenAI choices and prompts) would all share one id. A request router that
hands each replica to the request it chose it for (ours: no ``FIFOMixin``)
matches by that id and would fulfil only one of them; the rest would wait
forever. Ray 2.60 offers no public way to give a call its own id
(``handle.options`` has no such field; ``RequestMetadata.internal_request_id``
is read from the private request context only), so :func:`own_call` sets a
fresh one in a copy of that context. tests/deploy/test_ray_client.py fails
when Ray changes either fact.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import logging
import uuid
from collections.abc import AsyncIterator

from ray.exceptions import RayActorError, WorkerCrashedError
from ray.serve import context as serve_context
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

from deploy.errors import APIError
from deploy.worker_client import Busy, ReplicaFailed, await_call, engine_error, relay_stream
from worker.messages import WorkerBatch, WorkerRequest
from worker.results import EngineOverloaded, GenerationResult, ItemError, ReplicaStats, TokenEvent
from worker.stats_board import get_board

logger = logging.getLogger("kvroute.ingress")
# ActorDiedError and ActorUnavailableError are RayActorErrors
REPLICA_FAILURES = (RayActorError, WorkerCrashedError)
SERVE_OVERLOAD = (BackPressureError, DeploymentUnavailableError)


def own_call(method, *args):
    """``method.remote(*args)`` as a Serve request of its own (see the module docstring)."""

    def remote():
        current = serve_context._get_serve_request_context()  # noqa: SLF001 - no public way, see above
        serve_context._serve_request_context.set(  # noqa: SLF001
            dataclasses.replace(current, _internal_request_id=uuid.uuid4().hex))
        return method.remote(*args)

    return contextvars.copy_context().run(remote)


def as_api_error(error: BaseException, retry_after_s: int) -> APIError:
    """The HTTP status for a failed handle call, by the exception's type."""
    if isinstance(error, (APIError, EngineOverloaded, ValueError)):  # raised by the engine, re-raised by Ray
        return engine_error(error, retry_after_s)
    if isinstance(error, SERVE_OVERLOAD):
        return Busy("serve_queue_full", str(error), retry_after_s)
    if isinstance(error, REPLICA_FAILURES):
        logger.warning("worker replica failed mid-request: %s", error)
        return ReplicaFailed(retry_after_s)
    return engine_error(error, retry_after_s)


class RayWorkerClient:
    """``handle``: the Worker deployment; ``app_name``: whose stats board to read."""

    def __init__(self, handle, app_name: str, retry_after_s: int, stats_max_age_s: float,
                 stream_interval_s: float = 0.0) -> None:
        self._handle = handle
        self._stream_interval_s = stream_interval_s
        self._app_name = app_name
        self._stats_max_age_s = stats_max_age_s
        self._to_api_error = functools.partial(as_api_error, retry_after_s=retry_after_s)

    async def generate(self, request: WorkerRequest) -> GenerationResult:
        return await await_call(own_call(self._handle.generate, request), self._to_api_error)

    async def generate_batch(self, batch: WorkerBatch) -> list[GenerationResult | ItemError]:
        return await await_call(own_call(self._handle.generate_batch, batch), self._to_api_error)

    def stream_chunks(self, request: WorkerRequest) -> AsyncIterator[list[TokenEvent | GenerationResult]]:
        method = self._handle.options(stream=True).generate_stream_chunks
        return relay_stream(lambda: own_call(method, request, self._stream_interval_s), self._to_api_error)

    async def stats(self) -> dict[str, ReplicaStats]:
        board = get_board(self._app_name, create=False)
        return {} if board is None else await board.get_all.remote(self._stats_max_age_s)
