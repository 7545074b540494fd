"""router.serve.KVRouteRouter in a live local Ray Serve app.

A small real deployment keeps a simulated-mode RadixCache per replica and
reports it through ``record_routing_stats``; requests go through a handle
whose request router is ours.
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
APP = "kvroute-router-test"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cache_worker():
    """The deployment class, built inside a function so Ray pickles it by value."""
    from ray import serve as _serve

    @_serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=64)
    class CacheWorker:
        def __init__(self, preload: int):
            import random

            from cache import RadixCache

            self.replica_id = _serve.get_replica_context().replica_id.to_full_id_str()
            self.cache = RadixCache(10_000, BLOCK)
            rng = random.Random(self.replica_id)
            # A prefix only this replica holds, which no router has ever routed.
            self.preloaded = [rng.randrange(1000, 2000) for _ in range(preload)]
            self.cache.insert(self.preloaded)
            self.version = 0

        def info(self, request=None):
            return self.replica_id, self.preloaded

        def __call__(self, request, tokens):
            hit = self.cache.match(tokens).num_tokens
            self.cache.insert(tokens)
            return self.replica_id, hit

        def record_routing_stats(self):
            from cache.summary import CacheSummary

            self.version += 1
            return CacheSummary.from_radix(
                self.cache, BLOCK, replica_id=self.replica_id, version=self.version, timestamp_s=time.time()
            ).to_dict()

    return CacheWorker


def _routed_app(num_replicas: int):
    """The cache worker behind our router, as the app's config wires it."""
    return _cache_worker().options(
        num_replicas=num_replicas,
        request_router_config=RequestRouterConfig(
            request_router_class="router.serve:KVRouteRouter",
            request_router_kwargs={"block_size": BLOCK},
            request_routing_stats_period_s=0.2,
        ),
    ).bind(64)


def _request(tokens):
    return RoutingRequest(tuple(block_hashes(tokens, BLOCK)), len(tokens), None, ""), tokens


@pytest.fixture(scope="module")
def handle():
    started_ray = not ray.is_initialized()
    if started_ray:
        ray.init(
            num_cpus=2,
            namespace=f"kvroute-router-test-{time.time_ns()}",
            include_dashboard=False,
            _temp_dir=tempfile.mkdtemp(prefix="kvr"),
            logging_level="ERROR",
        )
    serve.start(http_options={"host": "127.0.0.1", "port": _free_port()})
    yield serve.run(_routed_app(num_replicas=3), name=APP, route_prefix=None)
    serve.delete(APP)
    if started_ray:
        serve.shutdown()
        ray.shutdown()


def _call(handle, tokens):
    request, tokens = _request(tokens)
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
            request, tokens = _request(prefix + [question, number, 9, 9])
            responses.append((number, handle.remote(request, tokens)))
    landed: dict[int, set[str]] = {}
    for number, response in responses:
        replica_id, _ = response.result(timeout_s=30)
        landed.setdefault(number, set()).add(replica_id)
    assert all(len(replicas) == 1 for replicas in landed.values()), landed


def test_cold_prefixes_spread_over_replicas(handle):
    seen = {_call(handle, [5000 + 100 * i + j for j in range(32)])[0] for i in range(24)}
    assert len(seen) >= 2


def _all_replicas(handle, expected, seed=0):
    """``{replica_id: preloaded tokens}``, reached with cold routed requests
    (each adds real work, so the choice rotates over the replicas)."""
    found = {}
    deadline = time.monotonic() + 60
    while len(found) < expected and time.monotonic() < deadline:
        seed += 1
        request, _ = _request([70_000 + 64 * seed + j for j in range(64)])
        replica_id, tokens = handle.info.remote(request).result(timeout_s=30)
        found[replica_id] = tokens
    return found


def test_requests_without_routing_attributes_still_get_served(handle, caplog):
    replicas = set(_all_replicas(handle, 3))
    with caplog.at_level("WARNING", logger="router.policy"):
        for _ in range(6):
            replica_id, preloaded = handle.info.remote().result(timeout_s=30)
            assert len(preloaded) == 64 and replica_id in replicas
    assert "least loaded fallback" in caplog.text


def _policy_of(handle):
    """The policy inside ``handle``'s KVRouteRouter (a handle's router runs in
    this process), or None before its first request created it."""
    request_router = handle._router._asyncio_router._request_router
    return request_router._policy if request_router is not None else None


def _wait_until(condition, timeout_s=30.0):
    """Poll ``condition`` until true or ``timeout_s`` passes (then the test's
    own assertions report what is wrong)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if condition():
                return
        except RuntimeError:  # a dict the router's thread is changing; look again
            pass
        time.sleep(0.05)


def test_replica_summaries_steer_requests_to_what_a_replica_reports(handle):
    preloaded = _all_replicas(handle, 3, seed=1000)
    assert len(preloaded) == 3
    policy = _policy_of(handle)  # wait until each replica's summary says what it holds
    _wait_until(lambda: all(policy.index.depth(r, tuple(block_hashes(t, BLOCK))) >= len(t) // BLOCK
                            for r, t in preloaded.items()))
    for replica_id, tokens in preloaded.items():
        landed, hit = _call(handle, tokens + [7, 7, 7, 7])
        assert landed == replica_id  # only its summary could have said so
        assert hit == len(tokens)


def test_scaled_down_replica_is_never_chosen(handle):
    small = serve.run(_routed_app(num_replicas=2), name=APP, route_prefix=None)
    live = set(_all_replicas(small, 2, seed=2000))
    _wait_until(lambda: 0 < len(_policy_of(small).replica_ids) and _policy_of(small).replica_ids <= live)
    for i in range(20):
        replica_id, _ = _call(small, [9000 + 50 * i + j for j in range(16)])
        assert replica_id in live
