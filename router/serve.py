"""Ray Serve adapter: :class:`router.policy.PrefixAffinityPolicy` as a RequestRouter.

Configure the Worker deployment with ``RequestRouterConfig(request_router_class=
"router.serve:KVRouteRouter", request_router_kwargs={...PolicyConfig fields...},
request_routing_stats_period_s=...)``; each worker's ``record_routing_stats``
returns ``cache.summary.CacheSummary(...).to_dict()``. No logic lives here.
"""

from __future__ import annotations

import time

from ray.serve.request_router import LocalityMixin, MultiplexMixin, RequestRouter

from router.policy import PolicyConfig, PrefixAffinityPolicy


def _key(replica_id) -> str:
    return replica_id.to_full_id_str()


def _request(pending_request):
    return pending_request.args[0] if pending_request is not None and pending_request.args else None


class KVRouteRouter(MultiplexMixin, LocalityMixin, RequestRouter):
    """Ranks replicas with the pure policy; Ray tries them in order (a full
    replica falls back to the next rank; the last rank is everyone else).
    No ``FIFOMixin``: a replica chosen for one request's prefix must go to
    that request, not to whichever is oldest. Each ranking reserves its
    first choice under Ray's internal request id; ``on_request_routed``
    confirms or moves it."""

    def initialize_state(self, **kwargs) -> None:
        self._policy = PrefixAffinityPolicy(PolicyConfig(**kwargs), clock=time.monotonic)

    def update_replicas(self, replicas) -> None:
        super().update_replicas(replicas)
        self._policy.set_replicas(_key(r.replica_id) for r in replicas)
        for replica in replicas:
            self._policy.on_routing_stats(_key(replica.replica_id), replica.routing_stats)

    def on_replica_actor_died(self, replica_id) -> None:
        super().on_replica_actor_died(replica_id)
        self._policy.remove_replica(_key(replica_id))

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        by_key = {_key(r.replica_id): r for r in candidate_replicas}
        request_id = pending_request.metadata.internal_request_id if pending_request is not None else None
        ranked = [by_key[k] for k in self._policy.rank(_request(pending_request), by_key, request_id) if k in by_key]
        rest = [r for r in candidate_replicas if r not in ranked]
        return [[r] for r in ranked] + ([rest] if rest else [])

    def on_request_routed(self, pending_request, replica_id, result) -> None:
        request_id = pending_request.metadata.internal_request_id
        self._policy.on_routed(_request(pending_request), _key(replica_id), request_id)

    def on_request_completed(self, replica_id, internal_request_id: str) -> None:
        self._policy.on_completed(internal_request_id)
