"""The ingress's view of the Worker replicas: a small client interface.

The routes and the dispatcher depend only on :class:`WorkerClient`; the Ray
implementation is ``deploy/ray_client.py``, an in-process one over an
``AsyncEngine`` is ``harness/engine_client.py`` (the route tests use it).
Records crossing the boundary are the worker's frozen dataclasses
(``worker.messages``, ``worker.results``).

Every failure a client raises is an :class:`~deploy.errors.APIError` with a
definite status: :class:`ReplicaFailed` (503; the dispatcher may send the
request again, another replica will take it), :class:`Busy` (429 or 503 with
``Retry-After``; ``reason`` labels the shed-request metric) or a plain
``APIError`` (400 for input the engine rejected, 500 otherwise).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Protocol

from deploy.errors import APIError, internal_error
from worker.messages import WorkerBatch, WorkerRequest
from worker.results import EngineOverloaded, GenerationResult, ItemError, ReplicaStats, TokenEvent

logger = logging.getLogger("kvroute.ingress")


class WorkerClient(Protocol):
    async def generate(self, request: WorkerRequest) -> GenerationResult: ...

    def stream_chunks(self, request: WorkerRequest) -> AsyncIterator[list[TokenEvent | GenerationResult]]:
        """Token events, then the result, in non-empty lists as they arrive
        together (``AsyncEngine.stream_chunks``); closing it early cancels
        the request."""
        ...

    async def generate_batch(self, batch: WorkerBatch) -> list[GenerationResult | ItemError]: ...

    async def stats(self) -> dict[str, ReplicaStats]:
        """Each live replica's last posted figures, by replica id."""
        ...


class ReplicaFailed(APIError):
    """The replica serving the request died; nothing was answered."""

    def __init__(self, retry_after_s: int) -> None:
        super().__init__(503, "a worker replica failed; retry the request", code="replica_failed", retry_after_s=retry_after_s)


class Busy(APIError):
    """Shed under overload. ``reason``: ``engine_queue_full`` (429) or ``serve_queue_full`` (503)."""

    def __init__(self, reason: str, detail: str, retry_after_s: int) -> None:
        status, code = (429, "engine_overloaded") if reason == "engine_queue_full" else (503, "overloaded")
        super().__init__(status, f"server busy: {detail}", code=code, retry_after_s=retry_after_s)
        self.reason = reason


def engine_error(error: BaseException, retry_after_s: int) -> APIError:
    """The status for an exception the engine raised (any client's transport
    hands these on: Ray re-raises them with their type)."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, EngineOverloaded):
        return Busy("engine_queue_full", str(error), retry_after_s)
    if isinstance(error, ValueError):
        return APIError(400, str(error))
    return internal_error(error)  # the traceback goes to the log, the body names its id


def item_error(error: ItemError) -> APIError:
    """The status for one failed item of a batch (reported in place, in its body)."""
    return APIError({"invalid": 400, "overloaded": 429}.get(error.kind, 500), error.message)


async def await_call(response, to_api_error: Callable[[BaseException], APIError]):
    """A cancellable call's result (any transport whose call has ``cancel()``):
    a caller that goes away cancels the work too; a failure is raised as
    ``to_api_error(error)``."""
    try:
        return await response
    except asyncio.CancelledError:
        response.cancel()
        raise
    except Exception as error:  # noqa: BLE001 - every failure gets a definite status
        raise to_api_error(error) from None


async def relay_stream(open_stream: Callable[[], AsyncIterator], to_api_error: Callable[[BaseException], APIError],
                       ) -> AsyncIterator[list[TokenEvent | GenerationResult]]:
    """The lists of items of ``open_stream()`` (a cancellable stream, opened
    on the first read) up to the one ending with the result; closed before
    that, the stream is cancelled; a failure is raised as ``to_api_error(error)``."""
    generator = open_stream()
    finished = False
    try:
        async for chunk in generator:
            finished = isinstance(chunk[-1], GenerationResult)
            yield chunk
    except Exception as error:  # noqa: BLE001 - every failure gets a definite status
        raise to_api_error(error) from None
    finally:
        if not finished:
            generator.cancel()
