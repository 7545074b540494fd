"""Ray Serve adapter: :class:`router.policy.PrefixAffinityPolicy` as a RequestRouter.

Configure the Worker deployment with ``RequestRouterConfig(request_router_class=
"router.serve:KVRouteRouter", request_router_kwargs={...PolicyConfig fields...},
request_routing_stats_period_s=...)``; each worker's ``record_routing_stats``
returns ``cache.summary.CacheSummary(...).to_dict()``, whole or as a stream
whose deltas name their base by an ``ObjectRef`` (``cache.summary_sender``);
``router.base_fetch`` fetches a base this router missed. No logic lives here.

Two things ride on the request object (``pending_request.args[0]``):

- A fetch hint (issue 13). When ``decide`` answers one, it is attached to the
  request as its ``fetch`` field (``dataclasses.replace``; requests without
  that field travel unchanged) and cleared when a retried decision has
  none. Ray reads ``pending_request.args`` when it sends the request to the
  replica it chose, after ``choose_replicas`` returns (ray 2.60:
  ``Router._route_and_send_request_once`` → ``try_send_request`` →
  ``send_request_python`` → ``method.remote(..., *pr.args)``);
  tests/router/test_serve_fetch.py fails if that changes. The hint is for the
  first choice; if Ray falls back to another replica, that one receives it
  too and may still fetch, and the owner itself ignores a hint naming it.
- A pin. A request with a ``target_replica`` attribute (a Worker's
  ``ExportRequest``) is routed to that replica only, never through the
  policy (no reservation, no load counted); when that replica is gone it
  goes to any replica, which answers at once that it is not the target.

:func:`routing_status` reports what each of this process's routers reads
(the policy's ``routing_status``); the Ingress puts it in ``/stats``, so
with several Ingress replicas each answer shows the router of the one
that served it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import weakref

from ray import serve
from ray.serve.exceptions import RayServeException
from ray.serve.request_router import LocalityMixin, MultiplexMixin, RequestRouter

from router.base_fetch import BaseFetcher
from router.policy import PolicyConfig, PrefixAffinityPolicy
from router.serve_decisions import DecisionExchange


_ROUTERS: weakref.WeakSet = weakref.WeakSet()  # this process's KVRouteRouters (an Ingress holds one)
STATUS_TIMEOUT_S = 2.0  # a router whose loop does not answer by then is reported as such


async def routing_status() -> list[dict]:
    """Each of this process's kvroute request routers, as it reads its
    replicas now (``PrefixAffinityPolicy.routing_status``, with the
    deployment it routes to and the replica it runs in); [] where none has
    routed yet (Ray creates a handle's router with its first request)."""
    return [await router.status() for router in list(_ROUTERS)]


def _key(replica_id) -> str:
    return replica_id.to_full_id_str()


def _request(pending_request):
    return pending_request.args[0] if pending_request is not None and pending_request.args else None


def _pinned_to(request) -> str | None:
    target = getattr(request, "target_replica", None)
    return target if isinstance(target, str) else None


def _attach_hint(pending_request, request, hint) -> None:
    """Set ``request.fetch = hint`` on the args Ray will send (see the module docstring)."""
    if not dataclasses.is_dataclass(request) or "fetch" not in {f.name for f in dataclasses.fields(request)}:
        return
    if request.fetch != hint:
        pending_request.args[0] = dataclasses.replace(request, fetch=hint)


class KVRouteRouter(MultiplexMixin, LocalityMixin, RequestRouter):
    """Ranks replicas with the pure policy; Ray tries them in order (a full
    replica falls back to the next rank; the last rank is everyone else).
    No ``FIFOMixin``: a replica chosen for one request's prefix must go to
    that request, not to whichever is oldest. Each ranking reserves its
    first choice under Ray's internal request id; ``on_request_routed``
    confirms or moves it."""

    def initialize_state(self, share_decisions_period_s: float = 0.0, **kwargs) -> None:
        """``kwargs``: :class:`PolicyConfig` fields. ``share_decisions_period_s``
        > 0: exchange decisions with the deployment's other routers that often
        (``router.serve_decisions``), from this router's first routed request."""
        self._policy = PrefixAffinityPolicy(PolicyConfig(**kwargs), clock=time.monotonic)
        self._share_period_s = float(share_decisions_period_s)
        self._exchange: DecisionExchange | None = None
        self._fetches: set = set()  # tasks in flight, referenced until done (the loop keeps only weak ones)
        self._summaries = BaseFetcher(self._policy, self._spawn)
        # Ray unpickles this class by value, with module globals of its own (checked live): register with
        # the module in sys.modules, whose routing_status the Ingress calls
        from router import serve as imported_module
        imported_module._ROUTERS.add(self)

    async def status(self) -> dict:
        """:func:`routing_status` for this router, read on its own loop (Ray
        runs routers on a thread of their own: the policy is never read
        while that loop changes it)."""
        try:
            ingress = serve.get_replica_context().replica_id.to_full_id_str()
        except RayServeException:  # not inside a Serve replica (a driver's handle)
            ingress = None
        head = {"deployment": self._deployment_id.name, "app": self._deployment_id.app_name, "in_replica": ingress}
        if self._exchange is not None:
            head["shared_decisions"] = {"sent": self._exchange.num_sent, "booked": self._exchange.num_booked}

        async def read() -> dict:
            return self._policy.routing_status()
        future = asyncio.run_coroutine_threadsafe(read(), self._event_loop)
        try:
            return {**head, **await asyncio.wait_for(asyncio.wrap_future(future), STATUS_TIMEOUT_S)}
        except asyncio.TimeoutError:
            future.cancel()
            return {**head, "error": f"the router's loop did not answer within {STATUS_TIMEOUT_S:.0f} s"}

    def _spawn(self, coroutine) -> None:
        task = self._event_loop.create_task(coroutine)
        self._fetches.add(task)
        task.add_done_callback(self._fetches.discard)

    def update_replicas(self, replicas) -> None:
        super().update_replicas(replicas)
        keys = {_key(r.replica_id) for r in replicas}
        self._policy.set_replicas(keys)
        self._summaries.retain(keys)
        for replica in replicas:
            self._summaries.on_routing_stats(_key(replica.replica_id), replica.routing_stats)

    def on_replica_actor_died(self, replica_id) -> None:
        super().on_replica_actor_died(replica_id)
        self._policy.remove_replica(_key(replica_id))
        self._summaries.forget(_key(replica_id))

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        request = _request(pending_request)
        target = _pinned_to(request)
        if target is not None:
            pinned = [r for r in candidate_replicas if _key(r.replica_id) == target]
            return [pinned or list(candidate_replicas)]
        by_key = {_key(r.replica_id): r for r in candidate_replicas}
        request_id = pending_request.metadata.internal_request_id if pending_request is not None else None
        decision = self._policy.decide(request, by_key, request_id)
        _attach_hint(pending_request, request, decision.fetch)
        ranked = [by_key[k] for k in decision.ranked if k in by_key]
        rest = [r for r in candidate_replicas if r not in ranked]
        return [[r] for r in ranked] + ([rest] if rest else [])

    def on_request_routed(self, pending_request, replica_id, result) -> None:
        request = _request(pending_request)
        if _pinned_to(request) is not None:
            return
        self._policy.on_routed(request, _key(replica_id), pending_request.metadata.internal_request_id)
        if self._share_period_s > 0:
            if self._exchange is None:  # a router that routes (not a Worker's pinned export handle) shares
                self._exchange = DecisionExchange(self._policy, self._deployment_id.app_name,
                                                  self._deployment_id.name, self._share_period_s,
                                                  self._policy.config.block_size)
                self._event_loop.call_soon_threadsafe(self._spawn, self._exchange.run())
            self._exchange.post(request, _key(replica_id))

    def on_request_completed(self, replica_id, internal_request_id: str) -> None:
        self._policy.on_completed(internal_request_id)
