"""router.serve.KVRouteRouter in a live local Ray Serve app.

A small real deployment keeps a simulated-mode RadixCache per replica and
reports it through ``record_routing_stats``; requests go through a handle
whose request router is ours.
"""

import pytest

ray = pytest.importorskip("ray")
from ray import serve  # noqa: E402

from cache import block_hashes  # noqa: E402
from tests.router.serve_app import (BLOCK, all_replicas, request_router, routed_app, routing_request,  # noqa: E402
                                    serve_running, wait_until)

pytestmark = pytest.mark.ray

APP = "kvroute-router-test"


@pytest.fixture(scope="module")
def handle():
    with serve_running("kvroute-router-test"):
        yield serve.run(routed_app(num_replicas=3), name=APP, route_prefix=None)
        serve.delete(APP)


def _call(handle, tokens):
    request, tokens = routing_request(tokens)
    return handle.remote(request, tokens).result(timeout_s=30)


def test_a_shared_prefix_sticks_to_one_replica_and_hits(handle):
    prefix = list(range(100, 164))
    first_replica, first_hit = _call(handle, prefix + [1, 2, 3, 4])
    assert first_hit == 0
    for question in range(5):
        replica_id, hit = _call(handle, prefix + [question, 9, 9, 9, 9])
        assert replica_id == first_replica
        assert hit >= len(prefix)


def test_a_concurrent_burst_keeps_each_prefix_on_one_replica(handle):
    """Requests sent at once are all decided before Ray reports any of them
    routed: each decision must reach its own request (no FIFO hand-over) and
    count at once, so each prefix's requests meet on one replica."""
    prefixes = [[40_000 + 1000 * p + j for j in range(64)] for p in range(3)]
    responses = []
    for question in range(4):
        for number, prefix in enumerate(prefixes):
            request, tokens = routing_request(prefix + [question, number, 9, 9])
            responses.append((number, handle.remote(request, tokens)))
    landed: dict[int, set[str]] = {}
    for number, response in responses:
        replica_id, _ = response.result(timeout_s=30)
        landed.setdefault(number, set()).add(replica_id)
    assert all(len(replicas) == 1 for replicas in landed.values()), landed


def test_cold_prefixes_spread_over_replicas(handle):
    seen = {_call(handle, [5000 + 100 * i + j for j in range(32)])[0] for i in range(24)}
    assert len(seen) >= 2


def test_requests_without_routing_attributes_still_get_served(handle, caplog):
    replicas = set(all_replicas(handle, 3))
    with caplog.at_level("WARNING", logger="router.policy"):
        for _ in range(6):
            replica_id, preloaded = handle.info.remote().result(timeout_s=30)
            assert len(preloaded) == 64 and replica_id in replicas
    assert "least loaded fallback" in caplog.text


def _policy_of(handle):
    router = request_router(handle)
    return router._policy if router is not None else None


def test_replica_summaries_steer_requests_to_what_a_replica_reports(handle):
    preloaded = all_replicas(handle, 3, seed=1000)
    assert len(preloaded) == 3
    policy = _policy_of(handle)  # wait until each replica's summary says what it holds
    wait_until(lambda: all(policy.index.depth(r, tuple(block_hashes(t, BLOCK))) >= len(t) // BLOCK
                           for r, t in preloaded.items()))
    for replica_id, tokens in preloaded.items():
        landed, hit = _call(handle, tokens + [7, 7, 7, 7])
        assert landed == replica_id  # only its summary could have said so
        assert hit == len(tokens)


def test_scaled_down_replica_is_never_chosen(handle):
    small = serve.run(routed_app(num_replicas=2), name=APP, route_prefix=None)
    live = set(all_replicas(small, 2, seed=2000))
    wait_until(lambda: 0 < len(_policy_of(small).replica_ids) and _policy_of(small).replica_ids <= live)
    for i in range(20):
        replica_id, _ = _call(small, [9000 + 50 * i + j for j in range(16)])
        assert replica_id in live
