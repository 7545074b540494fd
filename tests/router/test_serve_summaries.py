"""Summaries streamed by reference through a live Ray Serve app (issue 14, item 5).

Each replica of a small deployment (tests/router/serve_app.py) caches a
prefix of its own and reports it as a Worker does (``summary_mode``
"stream"): one inline snapshot, then only deltas, every 4th naming its base
in Ray's object store. A router created after the snapshots went out (a
handle whose first request comes seconds later) sees only deltas on Serve's
latest-value channel: it must fetch each replica's base through the
``ObjectRef`` to know what the replica holds.
"""

import time

import pytest

ray = pytest.importorskip("ray")
from ray import serve  # noqa: E402

from cache import block_hashes  # noqa: E402
from tests.router.serve_app import (BLOCK, all_replicas, request_router, routed_app, routing_request,  # noqa: E402
                                    serve_running, wait_until)

pytestmark = pytest.mark.ray

APP = "kvroute-summary-stream-test"
NUM_REPLICAS = 4


@pytest.fixture(scope="module")
def app():
    with serve_running("kvroute-summary-test"):
        serve.run(routed_app(NUM_REPLICAS, summary_mode="stream"), name=APP, route_prefix=None)
        yield APP
        serve.delete(APP)


def test_a_router_started_after_the_snapshots_learns_each_replica_from_its_fetched_base(app):
    time.sleep(3.0)  # ~15 periods: every replica is past its snapshot and its first bases
    handle = serve.get_app_handle(app)  # a new router: it has seen no summary yet
    found = all_replicas(handle, NUM_REPLICAS)  # each replica's own prefix
    assert len(found) == NUM_REPLICAS
    router = request_router(handle)
    wait_until(lambda: all(router._policy.index.depth(r, tuple(block_hashes(t, BLOCK))) >= len(t) // BLOCK
                           for r, t in found.items()))
    assert router._summaries.num_fetched >= 1  # the preloaded prefixes were in no delta it saw
    for replica_id, tokens in found.items():
        request, tokens = routing_request(tokens + [7, 7, 7, 7])
        landed, hit = handle.remote(request, tokens).result(timeout_s=30)
        assert landed == replica_id  # only the fetched base could have said so
        assert hit == len(tokens) - 4


def test_replicas_send_one_snapshot_then_deltas_naming_their_base(app):
    handle = serve.get_app_handle(app)
    seen = {}
    deadline = time.monotonic() + 30
    while len(seen) < NUM_REPLICAS and time.monotonic() < deadline:
        replica_id, stats, named = handle.sender_stats.remote().result(timeout_s=30)
        seen[replica_id] = (stats, named)
    for stats, named in seen.values():
        assert stats["summary_snapshots"] == 1 and len(named) >= 10
        assert named == [False] + [i % 4 == 0 for i in range(len(named) - 1)]  # every 4th delta names its base
        assert stats["summary_bases_put"] == sum(named)
