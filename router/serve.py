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
"""

from __future__ import annotations

import dataclasses
import time

from ray.serve.request_router import LocalityMixin, MultiplexMixin, RequestRouter

from router.base_fetch import BaseFetcher
from router.policy import PolicyConfig, PrefixAffinityPolicy


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

    def initialize_state(self, **kwargs) -> None:
        self._policy = PrefixAffinityPolicy(PolicyConfig(**kwargs), clock=time.monotonic)
        self._fetches: set = set()  # tasks in flight, referenced until done (the loop keeps only weak ones)
        self._summaries = BaseFetcher(self._policy, self._spawn)

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

    def on_request_completed(self, replica_id, internal_request_id: str) -> None:
        self._policy.on_completed(internal_request_id)
