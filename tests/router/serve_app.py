"""A small live Ray Serve app behind our request router, for the router's live tests.

Each replica keeps a ``cache.RadixCache`` (no model), preloaded with a prefix
only it holds, and reports it through ``record_routing_stats``: whole, or as a
Worker streams it (``cache.summary_sender.SummarySender``, bases put with
``ray.put``). Imported as ``tests.router.serve_app`` (pyproject's
``pythonpath = ["."]``; not named ``test_*`` so pytest does not collect it).
"""

from __future__ import annotations

import tempfile
import time
from contextlib import contextmanager

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig

from cache import block_hashes
from harness.serving import free_port
from router import RoutingRequest

BLOCK = 4


@contextmanager
def serve_running(namespace: str):
    """Ray (unless already up) and Serve on a free local port; shut down after."""
    started_ray = not ray.is_initialized()
    if started_ray:
        ray.init(num_cpus=2, namespace=f"{namespace}-{time.time_ns()}", include_dashboard=False,
                 _temp_dir=tempfile.mkdtemp(prefix="kvr"), logging_level="ERROR")
    serve.start(http_options={"host": "127.0.0.1", "port": free_port()})
    try:
        yield
    finally:
        if started_ray:
            serve.shutdown()
            ray.shutdown()


def cache_worker():
    """The deployment class, built inside a function so Ray pickles it by value."""
    from ray import serve as _serve

    @_serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=64)
    class CacheWorker:
        def __init__(self, preload: int, summary_mode: str = "full"):
            import random

            import ray as _ray

            from cache import RadixCache
            from cache.summary_sender import SummarySender

            self.replica_id = _serve.get_replica_context().replica_id.to_full_id_str()
            self.cache = RadixCache(10_000, BLOCK)
            rng = random.Random(self.replica_id)
            # A prefix only this replica holds, which no router has ever routed.
            self.preloaded = [rng.randrange(1000, 2000) for _ in range(preload)]
            self.cache.insert(self.preloaded)
            self.version = 0
            self.sender = SummarySender(self.replica_id, summary_mode, put=_ray.put)  # a Worker's defaults
            self.named_bases = []  # per summary sent: whether it named its base

        def info(self, request=None):
            return self.replica_id, self.preloaded

        def sender_stats(self, request=None):
            return self.replica_id, self.sender.stats(), self.named_bases

        def __call__(self, request, tokens):
            hit = self.cache.match(tokens).num_tokens
            self.cache.insert(tokens)
            return self.replica_id, hit

        def record_routing_stats(self):
            from cache.summary import BASE_REF_KEY, CacheSummary

            self.version += 1
            wire = self.sender.encode(CacheSummary.from_radix(
                self.cache, BLOCK, replica_id=self.replica_id, version=self.version, timestamp_s=time.time()))
            self.named_bases.append(BASE_REF_KEY in wire)
            return wire

    return CacheWorker


def routed_app(num_replicas: int, summary_mode: str = "full", preload: int = 64):
    """The cache worker behind our router, as the app's config wires it."""
    return cache_worker().options(
        num_replicas=num_replicas,
        request_router_config=RequestRouterConfig(
            request_router_class="router.serve:KVRouteRouter",
            request_router_kwargs={"block_size": BLOCK},
            request_routing_stats_period_s=0.2,
        ),
    ).bind(preload, summary_mode)


def routing_request(tokens):
    return RoutingRequest(tuple(block_hashes(tokens, BLOCK)), len(tokens), None, ""), tokens


def request_router(handle):
    """The KVRouteRouter inside ``handle`` (a handle's router runs in this
    process), or None before its first request created it."""
    return handle._router._asyncio_router._request_router


def all_replicas(handle, expected, seed=0):
    """``{replica_id: preloaded tokens}``, reached with cold routed requests
    (each adds real work, so the choice rotates over the replicas)."""
    found = {}
    deadline = time.monotonic() + 60
    while len(found) < expected and time.monotonic() < deadline:
        seed += 1
        request, _ = routing_request([70_000 + 64 * seed + j for j in range(64)])
        replica_id, tokens = handle.info.remote(request).result(timeout_s=30)
        found[replica_id] = tokens
    return found


def wait_until(condition, timeout_s=30.0):
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
