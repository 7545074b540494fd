"""The overload scenario: measure capacity, then offer a multiple of it.

    python -m harness.chaos overload --factor 5 --factor 10 --json results/chaos-overload.json

Split out of ``harness/chaos.py`` (which keeps the CLI and re-exports these
names). Figures: RELIABILITY.md section 2.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
from collections import Counter

import httpx
import yaml

from harness import faults, resources
from harness.lean_sender import lean_open_loop
from harness.loadstats import percentile
from harness.retry_client import Outcome, client_session, send
from harness.serving import REPO_ROOT
from harness.traffic import group_bodies, open_loop


async def closed_loop(url: str, bodies: list[dict], concurrency: int, *, headers: dict | None = None) -> tuple[list[Outcome], float]:
    """Send ``bodies`` with ``concurrency`` requests in flight; returns outcomes and wall time."""
    queue = list(enumerate(bodies))[::-1]
    outcomes: list[Outcome] = []
    async with client_session(concurrency * 2) as client:
        async def worker():
            while queue:
                index, body = queue.pop()
                outcomes.append(await send(client, url, body, index=index, headers=headers, max_attempts=1))

        start = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return outcomes, time.monotonic() - start


async def _max_engine_depths(url: str, headers: dict | None, done: asyncio.Event) -> dict:
    """The deepest engine queue and most running requests any replica reported
    while ``done`` is unset (stats are sampled every 0.25 s)."""
    waiting = running = 0
    while not done.is_set():
        try:
            for stats in (await asyncio.to_thread(faults.replica_stats, url, headers)).values():
                waiting, running = max(waiting, stats["num_waiting"]), max(running, stats["num_running"])
        except httpx.HTTPError:
            pass
        await asyncio.sleep(0.25)
    return {"max_engine_waiting": waiting, "max_engine_running": running}


async def overload(app, *, factor: float = 8.0, duration_s: float = 6.0, rounds: int = 2, concurrency: int = 12,
                   max_new_tokens: int = 128, stream: bool = False, headers: dict | None = None,
                   seed: int = 0, generator: str = "lean") -> dict:
    """Measure capacity (closed loop, ``concurrency`` in flight, after a
    warm-up), then offer ``factor`` × capacity open-loop for ``duration_s``,
    ``rounds`` times, no retries. Admitted requests must stay fast, the excess
    must get 429/503 with ``Retry-After``, nothing else; memory is sampled
    after the warm-up and after each round.

    ``generator``: what sends the open-loop rounds — ``lean``
    (harness/lean_sender.py: ~0.2 ms of this process's CPU per request, for
    non-streamed requests) or ``aiohttp`` (harness/traffic.py's retry
    client: ~1.1 ms; the only choice for streams)."""
    if generator not in ("lean", "aiohttp"):
        raise ValueError(f"generator must be 'lean' or 'aiohttp', got {generator!r}")
    generator = "aiohttp" if stream else generator
    def bodies(count: int, offset: int) -> list[dict]:
        pairs = group_bodies(count, num_groups=8, prefix_tokens=64, question_tokens=192,
                             max_new_tokens=max_new_tokens, stream_every=1 if stream else 0, seed=seed + offset)
        return [body for _, body in pairs]

    await closed_loop(app.url, bodies(2 * concurrency, 0), concurrency, headers=headers)  # warm-up
    cluster_cpu_s, own_cpu_s = resources.cpu_s(app.ray_pids()), resources.own_cpu_s()
    probe, probe_s = await closed_loop(app.url, bodies(4 * concurrency, 1), concurrency, headers=headers)
    capacity_rps = sum(o.ok for o in probe) / probe_s
    served_cpu_s = (resources.cpu_s(app.ray_pids()) - cluster_cpu_s) / max(1, sum(o.ok for o in probe))
    generator_served_cpu_s = (resources.own_cpu_s() - own_cpu_s) / max(1, sum(o.ok for o in probe))
    generator_probe_cores = (resources.own_cpu_s() - own_cpu_s) / probe_s
    baseline = [o.latency_s for o in probe if o.ok]
    pids_before = faults.replica_pids(app.url, headers)
    memory = [resources.memory_figures(app, headers)]
    figures: dict = {"capacity_rps": round(capacity_rps, 1), "offered_rps": round(factor * capacity_rps, 1),
                     "stream": stream, "baseline_latency_p50_s": percentile(baseline, 50),
                     "baseline_latency_p99_s": percentile(baseline, 99),
                     "probe_errors": dict(Counter(o.final.kind for o in probe if not o.ok)),
                     "cluster_cpu_s_per_served_request": round(served_cpu_s, 4),
                     "generator_cpu_ms_per_served_request": round(1000 * generator_served_cpu_s, 2),
                     "generator_cpu_share_at_capacity": round((resources.own_cpu_s() - own_cpu_s) / probe_s / 2, 3),
                     "generator_niceness": os.getpriority(os.PRIO_PROCESS, 0), "generator": generator,
                     "rounds": []}
    for round_index in range(rounds):
        offered = bodies(int(factor * capacity_rps * duration_s), 1000 * (round_index + 1))
        start = time.monotonic()
        role_cpu_s, own_cpu_s = resources.cpu_s_by_role(app.ray_pids()), resources.own_cpu_s()
        done = asyncio.Event()
        depths = asyncio.ensure_future(_max_engine_depths(app.url, headers, done))
        try:
            if generator == "lean":
                outcomes = await lean_open_loop(app.url, offered, factor * capacity_rps, headers=headers,
                                                max_connections=1024)
            else:
                outcomes = await open_loop(app.url, offered, factor * capacity_rps, headers=headers, max_attempts=1,
                                           max_connections=1024)
        finally:
            done.set()
        wall_s = time.monotonic() - start
        # one /proc scan per end of the round: the cluster's CPU is the sum over roles
        round_role_cpu_s = {role: cpu - role_cpu_s.get(role, 0.0)
                            for role, cpu in resources.cpu_s_by_role(app.ray_pids()).items()}
        round_cluster_cpu_s, round_own_cpu_s = sum(round_role_cpu_s.values()), resources.own_cpu_s() - own_cpu_s
        role_cores = {role: round(cpu / wall_s, 2) for role, cpu in round_role_cpu_s.items()}
        admitted = [o.latency_s for o in outcomes if o.ok]
        rejected = [o for o in outcomes if not o.ok]
        # What a refusal cost the cluster: its CPU in the round beyond what the
        # served requests cost at capacity, per refusal (the 2 cores are shared).
        refusal_cpu_s = (round_cluster_cpu_s - len(admitted) * served_cpu_s) / max(1, len(rejected))
        memory.append(resources.memory_figures(app, headers))
        figures["rounds"].append({
            "num_sent": len(outcomes), "num_ok": len(admitted), "wall_s": round(wall_s, 2),
            "goodput_rps": round(len(admitted) / wall_s, 1),
            "statuses": dict(Counter(o.final.kind for o in outcomes)),
            "rejected_without_retry_after": sum(o.final.retry_after_s is None for o in rejected),
            "unexpected": [(o.final.kind, o.final.error) for o in rejected if o.final.status not in (429, 503)][:5],
            "admitted_latency_p50_s": percentile(admitted, 50), "admitted_latency_p99_s": percentile(admitted, 99),
            "admitted_latency_max_s": max(admitted, default=None),
            "rejection_latency_p99_s": percentile([o.latency_s for o in rejected], 99),
            "goodput_of_capacity": round(len(admitted) / wall_s / capacity_rps, 2),
            # The generator shares the cores: what its CPU beyond the probe's would have served at the
            # probe's cluster CPU per request, credited back (an estimate, reported beside the raw ratio)
            "goodput_of_capacity_generator_accounted": round(
                (len(admitted) / wall_s + max(0.0, round_own_cpu_s / wall_s - generator_probe_cores)
                 / max(served_cpu_s, 1e-9)) / capacity_rps, 2),
            "admitted_p99_of_baseline_p99": (round(percentile(admitted, 99) / figures["baseline_latency_p99_s"], 2)
                                             if admitted else None),
            "cluster_cpu_cores": round(round_cluster_cpu_s / wall_s, 2),
            "generator_cpu_cores": round(round_own_cpu_s / wall_s, 2),
            "refusal_cpu_ms": round(1000 * refusal_cpu_s, 2),
            "cpu_cores_by_role": {**role_cores, "generator": round(round_own_cpu_s / wall_s, 2)},
            # the generator's own CPU per refusal, beyond what its served requests cost at capacity
            "generator_refusal_cpu_ms": round(1000 * (round_own_cpu_s - len(admitted) * generator_served_cpu_s)
                                              / max(1, len(rejected)), 2),
            "offered_rps_achieved": round(len(outcomes) / wall_s, 1),
            **await depths,
        })
    figures["memory"] = memory
    figures["replicas_restarted"] = sorted(set(pids_before.items()) ^ set(faults.replica_pids(app.url, headers).items()))
    return figures



# Small queues, so that overload shows in seconds on a CPU: the ingress admits
# 6 generation requests per Worker in flight (the capacity probe runs 12 in
# flight on 2 Workers) and answers the rest at once
# (429 JSON + Retry-After, deploy/admission.py); each Worker runs 8 requests and
# queues 8 more (then 429); Serve keeps at most 24 calls on a replica and 16
# waiting for one (then 503); the Ingress takes 1024 at once, so Serve's proxy
# (its own plain-text 503) is never the limit that trips.
OVERLOAD_APP = dict(
    args_overrides={"stats_period_s": 0.5, "max_in_flight_per_worker": 6,
                    "engine": {"max_num_seqs": 8, "max_queued_requests": 8, "max_batch_tokens": 512,
                               "num_threads": 1}},
    deployment_overrides={"Worker": {"max_ongoing_requests": 24, "max_queued_requests": 16},
                          "Ingress": {"max_ongoing_requests": 1024, "max_queued_requests": 256,
                                      "backpressure_config": {"retry_after_s": 1}}},
)

def config_without_access_log(config_path: str) -> str:
    """A copy of ``config_path`` with Serve's access log off (proxy and app)."""
    config = yaml.safe_load((REPO_ROOT / config_path).read_text())
    config["logging_config"] = {"enable_access_log": False}
    for app in config["applications"]:
        app["logging_config"] = {"enable_access_log": False}
    handle, path = tempfile.mkstemp(prefix="kvroute-noaccess-", suffix=".yaml")
    with os.fdopen(handle, "w") as file:
        yaml.safe_dump(config, file)
    return path
