"""The Ray adapter without a cluster: Ray's exceptions map to statuses by
type, and each call gets its own Serve request id. The last two tests pin
the Ray facts ``deploy/ray_client.py`` works around; when one fails, Ray
changed: re-read its docstring (a public way may exist now)."""

from __future__ import annotations

import inspect

import pytest
from ray import exceptions as ray_errors
from ray.serve import context as serve_context
from ray.serve._private import default_impl
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle

from deploy.errors import APIError
from deploy.ray_client import as_api_error, own_call
from deploy.worker_client import Busy, ReplicaFailed
from worker.results import EngineOverloaded


def remote_error(cause: BaseException) -> BaseException:
    """What awaiting a handle call raises when the replica raised ``cause``."""
    return ray_errors.RayTaskError("generate", "traceback", cause).as_instanceof_cause()


@pytest.mark.parametrize("error,kind,status", [
    (remote_error(EngineOverloaded("full")), Busy, 429),
    (remote_error(ValueError("bad prompt")), APIError, 400),
    (remote_error(KeyError("bug")), APIError, 500),
    (BackPressureError(num_queued_requests=9, max_queued_requests=8), Busy, 503),
    (ray_errors.ActorDiedError(), ReplicaFailed, 503),
    (ray_errors.ActorUnavailableError("gone", b"\0" * 16), ReplicaFailed, 503),
    (ray_errors.WorkerCrashedError(), ReplicaFailed, 503),
    (RuntimeError("??"), APIError, 500),
])
def test_ray_failures_map_to_statuses_by_type(error, kind, status):
    mapped = as_api_error(error, retry_after_s=4)
    assert type(mapped) is kind and mapped.status_code == status
    if status in (429, 503):
        assert mapped.headers() == {"Retry-After": "4"}
    if isinstance(mapped, Busy):
        assert mapped.reason == ("engine_queue_full" if status == 429 else "serve_queue_full")


class _Method:
    """Records the Serve request context each ``.remote`` call sees."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    def remote(self, *args):
        self.seen.append(serve_context._get_serve_request_context()._internal_request_id)  # noqa: SLF001
        return args


def test_each_call_gets_its_own_internal_request_id_and_the_callers_context_is_untouched():
    token = serve_context._serve_request_context.set(serve_context._RequestContext(_internal_request_id="http-1"))  # noqa: SLF001
    try:
        method = _Method()
        assert own_call(method, 1, 2) == (1, 2)
        own_call(method)
        assert len(set(method.seen)) == 2 and "http-1" not in method.seen
        assert serve_context._get_serve_request_context()._internal_request_id == "http-1"  # noqa: SLF001
    finally:
        serve_context._serve_request_context.reset(token)  # noqa: SLF001


def test_ray_still_stamps_every_call_with_the_contexts_internal_id():
    """Why own_call exists: Serve takes a call's routing identity from the
    private request context, so calls fanned out from one HTTP request share it."""
    token = serve_context._serve_request_context.set(serve_context._RequestContext(_internal_request_id="http-1"))  # noqa: SLF001
    try:
        init, options = default_impl.create_init_handle_options(), default_impl.create_dynamic_handle_options()
        assert default_impl.get_request_metadata(init, options).internal_request_id == "http-1"
    finally:
        serve_context._serve_request_context.reset(token)  # noqa: SLF001


def test_handle_options_still_offer_no_per_call_request_id():
    parameters = set(inspect.signature(DeploymentHandle.options).parameters)
    assert not {p for p in parameters if "request_id" in p or p == "request_context"}, parameters


class _Stream:
    """A cancellable stream of prepared messages, as a Ray streaming call is."""

    def __init__(self, messages) -> None:
        self._messages = list(messages)
        self.cancelled = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self._messages:
            raise StopAsyncIteration
        message = self._messages.pop(0)
        if isinstance(message, BaseException):
            raise message
        return message

    def cancel(self) -> None:
        self.cancelled = True


def test_a_worker_stream_is_relayed_in_its_lists_and_cancelled_if_left_before_the_result():
    import asyncio

    from deploy.worker_client import relay_stream
    from worker.results import GenerationResult, TokenEvent

    events = [TokenEvent("r", token_id, None, index) for index, token_id in enumerate((7, 8, 9))]
    result = GenerationResult((7, 8, 9), None, 5, 0, "length", 0.01, request_id="r")
    to_error = lambda error: as_api_error(error, retry_after_s=1)  # noqa: E731

    async def main():
        whole = _Stream([[events[0]], [events[1], events[2], result]])
        assert [chunk async for chunk in relay_stream(lambda: whole, to_error)] == [[events[0]], [*events[1:], result]]
        assert not whole.cancelled
        left = _Stream([[events[0]], [events[1]], [events[2], result]])
        relay = relay_stream(lambda: left, to_error)
        assert await relay.__anext__() == [events[0]] and await relay.__anext__() == [events[1]]
        await relay.aclose()  # gone before the result: the worker's stream is cancelled
        assert left.cancelled
        failing = _Stream([[events[0]], remote_error(EngineOverloaded("full"))])
        seen = []
        with pytest.raises(Busy):
            async for chunk in relay_stream(lambda: failing, to_error):
                seen.append(chunk)
        assert seen == [[events[0]]] and failing.cancelled

    asyncio.run(main())
