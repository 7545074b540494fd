"""router/serve.py's two riders on the request object, without a cluster: the
fetch hint attached to the args Ray sends, and the pin of an ExportRequest
to its target replica. The last two tests pin the Ray 2.60 behaviour the
hint relies on (Ray reads ``pending_request.args`` when it sends, after
``choose_replicas`` returned); when one fails, Ray changed: re-read the
module docstring of router/serve.py."""

from __future__ import annotations

import asyncio
import inspect

import pytest

pytest.importorskip("ray")
from ray.serve._private.common import RequestMetadata  # noqa: E402
from ray.serve._private.request_router.common import PendingRequest  # noqa: E402
from ray.serve._private.request_router.replica_wrapper import ActorReplicaWrapper  # noqa: E402
from ray.serve._private.request_router.request_router import RequestRouter  # noqa: E402
from ray.serve._private.router import AsyncioRouter  # noqa: E402

from router.fetch import FetchHint, RoutingDecision  # noqa: E402
from router.serve import KVRouteRouter  # noqa: E402
from worker import SamplingParams  # noqa: E402
from worker.messages import ExportRequest, WorkerRequest  # noqa: E402


class _Id:
    def __init__(self, key: str) -> None:
        self.key = key

    def to_full_id_str(self) -> str:
        return self.key


class _Replica:
    def __init__(self, key: str) -> None:
        self.replica_id = _Id(key)


class _Policy:
    """Answers a fixed decision and records what it was asked (the adapter is under test)."""

    def __init__(self, decision: RoutingDecision) -> None:
        self.decision = decision
        self.decided, self.routed = [], []

    def decide(self, request, candidate_ids, request_id):
        self.decided.append(request)
        return self.decision

    def on_routed(self, request, replica_id, request_id):
        self.routed.append((request, replica_id))


def _router(decision: RoutingDecision) -> KVRouteRouter:
    router = KVRouteRouter.__new__(KVRouteRouter)  # Ray's constructor needs a controller; the policy is what we set
    router._policy = _Policy(decision)
    return router


def _pending(request) -> PendingRequest:
    metadata = RequestMetadata(request_id="r", internal_request_id="i")
    return PendingRequest(args=[request], kwargs={}, metadata=metadata, future=None)  # no loop here


def _request() -> WorkerRequest:
    return WorkerRequest("req-1", tuple(range(3, 203)), SamplingParams(max_new_tokens=4), "tenant", (11, 12, 13))


REPLICAS = [_Replica("a"), _Replica("b"), _Replica("c")]


def choose(router, replicas, pending):
    return asyncio.run(router.choose_replicas(replicas, pending))


def test_a_hint_rides_on_the_request_ray_sends_and_a_retry_without_one_clears_it():
    router = _router(RoutingDecision(("b", "a"), FetchHint("a", 128)))
    pending = _pending(_request())
    chosen = choose(router, REPLICAS, pending)
    assert [[r.replica_id.key for r in group] for group in chosen] == [["b"], ["a"], ["c"]]
    assert pending.args[0].fetch == FetchHint("a", 128)
    assert pending.args[0].prompt_token_ids == _request().prompt_token_ids
    router._policy.decision = RoutingDecision(("c", "b"))  # Ray asks again (the first choice refused)
    choose(router, REPLICAS, pending)
    assert pending.args[0].fetch is None


def test_requests_without_a_fetch_field_travel_unchanged():
    router = _router(RoutingDecision(("b",), FetchHint("a", 128)))
    request = object()
    pending = _pending(request)
    choose(router, REPLICAS, pending)
    assert pending.args[0] is request


def test_an_export_goes_to_its_target_only_or_anywhere_when_it_is_gone():
    router = _router(RoutingDecision(("a",)))
    export = ExportRequest("b", (1, 2, 3), None, 3)
    chosen = choose(router, REPLICAS, _pending(export))
    assert [[r.replica_id.key for r in group] for group in chosen] == [["b"]]
    gone = ExportRequest("z", (1, 2, 3), None, 3)
    chosen = choose(router, REPLICAS, _pending(gone))
    assert [[r.replica_id.key for r in group] for group in chosen] == [["a", "b", "c"]]
    router.on_request_routed(_pending(export), _Id("b"), None)
    assert router._policy.decided == [] and router._policy.routed == []  # never through the policy


class _Method:
    def __init__(self) -> None:
        self.args = []

    def remote(self, metadata, *args, **kwargs):
        self.args.append(args)

    def options(self, **kwargs):
        return self


class _Actor:
    def __init__(self) -> None:
        self.handle_request = self.handle_request_with_rejection = self.handle_request_streaming = _Method()


def test_ray_sends_the_args_as_they_are_when_it_sends():
    actor = _Actor()
    pending = _pending("as routed")
    pending.args[0] = "with its hint"  # what choose_replicas does
    ActorReplicaWrapper(actor).send_request_python(pending, with_rejection=False)
    assert actor.handle_request.args == [("with its hint",)]


def test_ray_chooses_with_the_pending_request_before_sending_it():
    backoff = inspect.getsource(RequestRouter._choose_replicas_with_backoff)
    assert "pending_request=pending_request" in backoff  # choose_replicas sees the very object Ray sends
    send = inspect.getsource(AsyncioRouter._route_and_send_request_once)
    assert send.index("_choose_replica_for_request(") < send.index("try_send_request(pr")
