"""Summaries through a live Ray Serve app at fleet sizes this machine can hold
(issue 14, item 5): bytes per replica and what receiving them costs the router.

    python -m harness.summary_bench --replicas 8 --mode stream --mode full

Each replica is a model-free Serve deployment whose cache is a synthetic set
of ``--cached-blocks`` chained block hashes (a 1M-token cache at block 64 is
~16k blocks) with ``--churn-blocks`` replaced every routing-stats period, and
reports it through ``record_routing_stats`` as a Worker does
(``cache.summary_sender.SummarySender`` with ``ray.put``). The driver holds a
handle whose request router is ours (created by one request), so the router
receives Serve's broadcasts here. Over ``--seconds`` it measures:

- bytes per replica per second (the senders' own counters: JSON + 254 per ref);
- the router's CPU applying stats (``router.base_fetch.BaseFetcher.apply_cpu_s``:
  parse + index), and the whole driver process's CPU (it does nothing else:
  Ray's deserialisation of the broadcasts is in it);
- Serve's controller's CPU (``/proc``), which pulls every replica's stats and
  re-broadcasts them;
- whether the router's index holds each replica's blocks once the churn stops
  (6 periods after: a router that missed a summary waits up to 4 for a delta
  naming its base).

Loopback only, bounded in time; it starts and stops its own local Ray.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import tempfile
import time
from pathlib import Path

BLOCK = 64
APP = "kvroute-summary-bench"


def synthetic_worker():
    """The deployment class, built inside a function so Ray pickles it by value."""
    from ray import serve

    @serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=16)
    class SyntheticCacheWorker:
        def __init__(self, num_blocks: int, churn_blocks: int, mode: str):
            import random

            import ray

            from cache.summary_sender import SummarySender

            self.replica_id = serve.get_replica_context().replica_id.to_full_id_str()
            self.rng = random.Random(self.replica_id)
            self.blocks = [self.rng.getrandbits(63) for _ in range(num_blocks)]
            self.churn = churn_blocks
            self.version = 0
            self.sender = SummarySender(self.replica_id, mode, put=ray.put)

        def __call__(self, request=None):
            return self.replica_id

        def report(self, request=None, freeze=False):
            if freeze:  # no more churn: the router can catch up with a fixed state
                self.churn = 0
            return self.replica_id, self.sender.stats(), self.blocks[:]

        def record_routing_stats(self):
            from cache.summary import CacheSummary

            self.version += 1
            if self.version > 1:  # what an LRU does: the oldest blocks leave, new ones come
                self.blocks = self.blocks[self.churn:] + [self.rng.getrandbits(63) for _ in range(self.churn)]
            summary = CacheSummary(self.replica_id, self.version, time.time(), BLOCK, frozenset(self.blocks),
                                   num_cached_tokens=BLOCK * len(self.blocks),
                                   budget_tokens=2 * BLOCK * len(self.blocks))  # room for the bench's own requests
            return self.sender.encode(summary)

    return SyntheticCacheWorker


def _proc_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _controller_pid() -> int | None:
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if b"ServeController" in (entry / "cmdline").read_bytes():
                    return int(entry.name)
            except OSError:
                continue
    return None


def run_mode(mode: str, args) -> dict:
    import ray
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from router.request import RoutingRequest

    serve.run(synthetic_worker().options(
        num_replicas=args.replicas,
        request_router_config=RequestRouterConfig(
            request_router_class="router.serve:KVRouteRouter",
            request_router_kwargs={"block_size": BLOCK},
            request_routing_stats_period_s=args.period_s,
        ),
    ).bind(args.cached_blocks, args.churn_blocks, mode), name=APP, route_prefix=None)
    handle = serve.get_app_handle(APP)
    request = RoutingRequest((1, 2, 3), 3 * BLOCK, None, "")
    handle.remote(request).result(timeout_s=60)  # creates this process's router
    router = handle._router._asyncio_router._request_router
    time.sleep(args.warmup_s)
    reports_before = _reports(handle, args.replicas)
    controller = _controller_pid()
    start = (time.monotonic(), time.process_time(), router._summaries.apply_cpu_s,
             _proc_cpu_s(controller) if controller else None)
    time.sleep(args.seconds)
    wall = time.monotonic() - start[0]
    driver_cpu = time.process_time() - start[1]
    apply_cpu = router._summaries.apply_cpu_s - start[2]
    controller_cpu = _proc_cpu_s(controller) - start[3] if controller else None
    reports_after = _reports(handle, args.replicas)
    sent = {r: reports_after[r][0]["summary_bytes"] - reports_before[r][0]["summary_bytes"]
            for r in reports_after if r in reports_before}
    messages = {r: reports_after[r][0]["summary_messages"] - reports_before[r][0]["summary_messages"]
                for r in sent}
    _reports(handle, args.replicas, freeze=True)
    # a router that missed a summary is whole again at the next delta naming its base: within
    # SummarySender's ref_every (4) periods, plus the fetch
    time.sleep(6 * args.period_s)
    policy = router._policy
    held = [sum(policy.index.holds(r, h) for h in blocks) / max(len(blocks), 1)
            for r, (_, blocks) in _reports(handle, args.replicas).items()]
    serve.delete(APP)
    return {
        "mode": mode,
        "replicas": args.replicas,
        "bytes_per_replica_s": sum(sent.values()) / (len(sent) * wall),
        "messages_per_replica_s": sum(messages.values()) / (len(sent) * wall),
        "router_apply_cpu_ms_per_s": 1e3 * apply_cpu / wall,
        "driver_cpu_ms_per_s": 1e3 * driver_cpu / wall,
        "controller_cpu_ms_per_s": None if controller_cpu is None else 1e3 * controller_cpu / wall,
        "bases_fetched": router._summaries.num_fetched,
        "index_holds_current_blocks_min": min(held),
        "wall_s": wall,
        "load_average": os.getloadavg(),
    }


def _reports(handle, expected: int, freeze: bool = False) -> dict:
    """``{replica_id: (sender stats, blocks)}`` for every replica (calls rotate over them)."""
    from router.request import RoutingRequest

    found = {}
    deadline = time.monotonic() + 60
    seed = 0
    while len(found) < expected and time.monotonic() < deadline:
        seed += 1
        request = RoutingRequest((10_000 + seed,), BLOCK, None, "")  # cold: routing spreads them
        replica_id, stats, blocks = handle.report.remote(request, freeze).result(timeout_s=30)
        found[replica_id] = (stats, blocks)
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--mode", action="append", choices=["stream", "full"], help="repeat to compare (default both)")
    parser.add_argument("--cached-blocks", type=int, default=16_384, help="per replica (16,384 = 1M tokens at block 64)")
    parser.add_argument("--churn-blocks", type=int, default=64, help="blocks replaced per period per replica")
    parser.add_argument("--period-s", type=float, default=1.0)
    parser.add_argument("--warmup-s", type=float, default=5.0)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if not 1 <= args.replicas <= 64 or args.seconds > 300:
        parser.error("--replicas must be 1..64 and --seconds <= 300 (bounded runs)")

    import ray
    from ray import serve

    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", _temp_dir=tempfile.mkdtemp(prefix="kvr"),
             namespace=f"summary-bench-{time.time_ns()}")
    with socket.socket() as probe:  # a free loopback port for Serve's proxy (no HTTP is sent)
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        results = [run_mode(mode, args) for mode in (args.mode or ["stream", "full"])]
    finally:
        serve.shutdown()
        ray.shutdown()
    for row in results:
        print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
