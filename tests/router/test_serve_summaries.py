"""Summaries streamed by reference through a live Ray Serve app (issue 14, item 5).

Each replica of a small deployment caches a prefix of its own and reports it
with ``cache.summary_sender.SummarySender``: one inline snapshot, then only
deltas, every 4th naming its base in Ray's object store. A router created after the
snapshots went out (a handle whose first request comes seconds later) sees
only deltas on Serve's latest-value channel: it must fetch each replica's
base through the ``ObjectRef`` to know what the replica holds.
"""

import socket
import tempfile
import time

import pytest

ray = pytest.importorskip("ray")
from ray import serve  # noqa: E402
from ray.serve.config import RequestRouterConfig  # noqa: E402

from cache import block_hashes  # noqa: E402
from router import RoutingRequest  # noqa: E402

pytestmark = pytest.mark.ray

BLOCK = 4
APP = "kvroute-summary-stream-test"
NUM_REPLICAS = 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _streaming_worker():
    """The deployment class, built inside a function so Ray pickles it by value."""
    from ray import serve as _serve

    @_serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=64)
    class StreamingCacheWorker:
        def __init__(self, preload: int):
            import random

            import ray as _ray

            from cache import RadixCache
            from cache.summary_sender import SummarySender

            self.replica_id = _serve.get_replica_context().replica_id.to_full_id_str()
            self.cache = RadixCache(10_000, BLOCK)
            rng = random.Random(self.replica_id)
            self.preloaded = [rng.randrange(1000, 2000) for _ in range(preload)]  # only this replica holds it
            self.cache.insert(self.preloaded)
            self.version = 0
            self.sender = SummarySender(self.replica_id, put=_ray.put)  # a Worker's defaults
            self.sent = []

        def info(self, request=None):
            return self.replica_id, self.preloaded

        def sender_stats(self, request=None):
            return self.replica_id, self.sender.stats(), self.sent

        def __call__(self, request, tokens):
            hit = self.cache.match(tokens).num_tokens
            self.cache.insert(tokens)
            return self.replica_id, hit

        def record_routing_stats(self):
            from cache.summary import CacheSummary

            self.version += 1
            wire = self.sender.encode(CacheSummary.from_radix(
                self.cache, BLOCK, replica_id=self.replica_id, version=self.version, timestamp_s=time.time()))
            self.sent.append("bref" in wire)
            return wire

    return StreamingCacheWorker


@pytest.fixture(scope="module")
def app():
    started_ray = not ray.is_initialized()
    if started_ray:
        ray.init(num_cpus=2, namespace=f"kvroute-summary-test-{time.time_ns()}", include_dashboard=False,
                 _temp_dir=tempfile.mkdtemp(prefix="kvr"), logging_level="ERROR")
    serve.start(http_options={"host": "127.0.0.1", "port": _free_port()})
    serve.run(_streaming_worker().options(
        num_replicas=NUM_REPLICAS,
        request_router_config=RequestRouterConfig(
            request_router_class="router.serve:KVRouteRouter",
            request_router_kwargs={"block_size": BLOCK},
            request_routing_stats_period_s=0.2,
        ),
    ).bind(64), name=APP, route_prefix=None)
    yield APP
    serve.delete(APP)
    if started_ray:
        serve.shutdown()
        ray.shutdown()


def _request(tokens):
    return RoutingRequest(tuple(block_hashes(tokens, BLOCK)), len(tokens), None, ""), tokens


def _request_router(handle):
    return handle._router._asyncio_router._request_router


def _wait_until(condition, timeout_s=30.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if condition():
                return
        except RuntimeError:  # a dict the router's thread is changing; look again
            pass
        time.sleep(0.05)


def test_a_router_started_after_the_snapshots_learns_each_replica_from_its_fetched_base(app):
    time.sleep(3.0)  # ~15 periods: every replica is past its snapshot and its first bases
    handle = serve.get_app_handle(app)  # a new router: it has seen no summary yet
    found = {}
    deadline = time.monotonic() + 60
    seed = 0
    while len(found) < NUM_REPLICAS and time.monotonic() < deadline:  # each replica's own prefix
        seed += 1
        request, _ = _request([70_000 + 64 * seed + j for j in range(64)])
        replica_id, tokens = handle.info.remote(request).result(timeout_s=30)
        found[replica_id] = tokens
    assert len(found) == NUM_REPLICAS
    router = _request_router(handle)
    policy = router._policy
    _wait_until(lambda: all(policy.index.depth(r, tuple(block_hashes(t, BLOCK))) >= len(t) // BLOCK
                            for r, t in found.items()))
    assert router._summaries.num_fetched >= 1  # the preloaded prefixes were in no delta it saw
    for replica_id, tokens in found.items():
        request, tokens = _request(tokens + [7, 7, 7, 7])
        landed, hit = handle.remote(request, tokens).result(timeout_s=30)
        assert landed == replica_id  # only the fetched base could have said so
        assert hit == len(tokens) - 4


def test_replicas_send_one_snapshot_then_deltas_naming_their_base(app):
    handle = serve.get_app_handle(app)
    seen = {}
    deadline = time.monotonic() + 30
    while len(seen) < NUM_REPLICAS and time.monotonic() < deadline:
        replica_id, stats, sent = handle.sender_stats.remote().result(timeout_s=30)
        seen[replica_id] = (stats, sent)
    for stats, sent in seen.values():
        assert stats["summary_snapshots"] == 1 and len(sent) >= 10
        assert sent == [False] + [i % 4 == 0 for i in range(len(sent) - 1)]  # every 4th delta names its base
        assert stats["summary_bases_put"] == sum(sent)
