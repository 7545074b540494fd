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
