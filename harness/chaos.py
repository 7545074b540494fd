"""Reliability scenarios against a live app, each ending in figures.

    python -m harness.chaos replica-failure --replicas 3 --requests 300 --json results/chaos-failure.json
    python -m harness.chaos overload --factor 8 --json results/chaos-overload.json

Each command starts a private Ray cluster and the app (``harness/serving.py``),
runs one scenario on 127.0.0.1 (bounded in requests and time), prints the
figures as JSON, and stops everything it started (slow clients, disconnects
and the other cases run as tests in tests/reliability). The tests in
tests/reliability call the same functions with smaller sizes and assert on
their figures; RELIABILITY.md records the figures of these commands.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import random
import sys
import tempfile
import time
from collections import Counter

import httpx
import yaml

from harness import faults, resources
from harness.loadstats import percentile
from harness.retry_client import Outcome, client_session, send
from harness.workloads import shared_prefix


def group_bodies(num_requests: int, *, num_groups: int, prefix_tokens: int, question_tokens: int,
                 max_new_tokens: int, stream_every: int = 0, seed: int = 0) -> list[tuple[int, dict]]:
    """``(group, /generate body)`` pairs: groups sharing a prefix, shuffled;
    every ``stream_every``-th request is streamed (0: none)."""
    rng = random.Random(seed)
    per_group = -(-num_requests // num_groups)
    sessions = shared_prefix(rng, num_groups, per_group, prefix_tokens, question_tokens, max_new_tokens)
    prefix_to_group: dict[tuple, int] = {}
    pairs = []
    for index, session in enumerate(sessions[:num_requests]):
        group = prefix_to_group.setdefault(session.prefix, len(prefix_to_group))
        body = {"prompt_token_ids": list(session.prefix + session.turns[0].question),
                "max_new_tokens": max_new_tokens, "ignore_eos": True}
        if stream_every and index % stream_every == 0:
            body["stream"] = True
        pairs.append((group, body))
    return pairs


async def open_loop(url: str, bodies: list[dict], rate_rps: float, *, headers: dict | None = None,
                    max_attempts: int = 4, timeout_s: float = 60.0, max_connections: int = 256,
                    finished: list[Outcome] | None = None) -> list[Outcome]:
    """Send ``bodies`` at a fixed rate (open loop: arrivals never wait for
    answers); ``finished`` collects outcomes as they end."""
    finished = finished if finished is not None else []

    async def one(client, index, body) -> Outcome:
        outcome = await send(client, url, body, index=index, headers=headers, max_attempts=max_attempts,
                             timeout_s=timeout_s)
        finished.append(outcome)
        return outcome

    async with client_session(max_connections) as client:
        start = time.monotonic()
        tasks = []
        for index, body in enumerate(bodies):
            delay = start + index / rate_rps - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(client, index, body)))
        return list(await asyncio.gather(*tasks))


def _retries_total(url: str, headers: dict | None) -> float:
    text = httpx.get(f"{url}/metrics", headers=headers, timeout=10, trust_env=False).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("kvroute_replica_retries_total"))


# ------------------------------------------------------------ replica failure
async def replica_failure(app, *, num_requests: int = 300, rate_rps: float = 20.0, kill_at_s: float = 3.0,
                          num_groups: int = 12, max_new_tokens: int = 32, recovery_timeout_s: float = 60.0, headers: dict | None = None,
                          seed: int = 0) -> dict:
    """Kill one Worker replica's process mid-load; every request must complete
    (the ingress retries in-flight calls elsewhere; a stream cut after its first
    token gets a retriable error event the client retries). Then wait for Serve's
    replacement and check it rejoins the ring (fresh prefixes reach it)."""
    pairs = group_bodies(num_requests, num_groups=num_groups, prefix_tokens=96, question_tokens=8,
                         max_new_tokens=max_new_tokens, stream_every=2, seed=seed)
    before = faults.replica_pids(app.url, headers)
    timeline: dict[str, float | None] = {"replacement_registered_s": None, "last_ingress_retry_s": None}
    kill_t = time.monotonic() + kill_at_s
    done = asyncio.Event()
    finished: list[Outcome] = []
    victim = ""

    async def kill() -> None:
        nonlocal victim  # the busiest replica so far: home to the most prefixes
        await asyncio.sleep(max(0.0, kill_t - time.monotonic()))
        served = Counter(o.final.replica_id for o in finished if o.ok)
        victim = max(sorted(before), key=lambda replica: served[replica])
        await asyncio.to_thread(faults.kill_replica, app, victim, headers)
        timeline["killed_s"] = time.monotonic() - kill_t  # the SIGKILL itself (after a /stats read)

    async def watch() -> None:
        retries = 0.0
        while not done.is_set() or timeline["replacement_registered_s"] is None:
            if time.monotonic() - kill_t > recovery_timeout_s:
                return
            now = time.monotonic()
            try:
                current = await asyncio.to_thread(faults.replica_pids, app.url, headers)
                total = await asyncio.to_thread(_retries_total, app.url, headers)
            except httpx.HTTPError:
                await asyncio.sleep(0.25)
                continue
            if total > retries:
                retries, timeline["last_ingress_retry_s"] = total, now - kill_t
            if timeline["replacement_registered_s"] is None and set(current) - set(before):
                timeline["replacement_registered_s"] = now - kill_t
            await asyncio.sleep(0.25)
        timeline["ingress_retries"] = retries

    async def load() -> list[Outcome]:
        try:
            return await open_loop(app.url, [body for _, body in pairs], rate_rps, headers=headers, finished=finished)
        finally:
            done.set()

    outcomes, _, _ = await asyncio.gather(load(), kill(), watch())
    replacement = sorted(set(faults.replica_pids(app.url, headers)) - set(before))
    registered_s = timeline["replacement_registered_s"]
    rejoin_t = kill_t + (registered_s if registered_s is not None else recovery_timeout_s)
    figures = _failure_figures(outcomes, pairs, victim, kill_t, rejoin_t, kill_t + (timeline.get("killed_s") or 0.0))
    served_by_new = [o.final.end_s - kill_t for o in outcomes if o.ok and o.final.replica_id in replacement]
    figures.update(timeline, victim=victim, replacement=replacement[0] if replacement else None,
                   kill_at_s=kill_at_s, rate_rps=rate_rps,
                   replacement_first_served_s=min(served_by_new, default=None),
                   served_by_replacement=len(served_by_new))
    share, routed_s = (await _rejoin_probe(app.url, replacement, headers, seed, kill_t) if replacement
                       else (None, None))
    figures.update(replacement_share=share, replacement_routed_s=routed_s)
    return figures


def _failure_figures(outcomes: list[Outcome], pairs, victim: str, kill_t: float, rejoin_t: float,
                     killed_t: float | None = None) -> dict:
    """``kill_t``: when the kill was due; ``killed_t``: when the SIGKILL was sent
    (later by a ``/stats`` read, which under load takes a while)."""
    killed_t = kill_t if killed_t is None else killed_t
    ok = [o for o in outcomes if o.ok]
    failed_attempts = [a for o in outcomes for a in o.attempts if not a.ok]
    # Prefixes the victim was home to at the kill (it answered their last
    # request before it): until the replacement arrives (the ring changes
    # again) their requests must go to survivors and hit there again after at
    # most one miss per survivor (the prefix is re-homed, not re-computed).
    group_to_home: dict[int, tuple[float, str]] = {}
    group_to_after: dict[int, list] = {}
    for outcome in ok:
        group, start, end = pairs[outcome.index][0], outcome.attempts[0].start_s, outcome.final.end_s
        if end < kill_t:
            if end > group_to_home.get(group, (0.0, ""))[0]:
                group_to_home[group] = (end, outcome.final.replica_id)
        elif kill_t <= start < rejoin_t:
            group_to_after.setdefault(group, []).append((start, outcome.final.replica_id, outcome.final.cached_tokens))
    orphaned = [g for g, (_, home) in group_to_home.items() if home == victim]
    rehomed, on_one_replica, hits, lookups = 0, 0, 0, 0
    for group in orphaned:
        after = sorted(group_to_after.get(group, []))
        replicas = [replica for _, replica, _ in after]
        misses = sum(not cached for _, _, cached in after)
        rehomed += bool(after) and victim not in replicas and misses <= len(set(replicas))
        on_one_replica += len(set(replicas)) == 1
        seen: set = set()
        for _, replica, cached in after:
            if replica in seen:
                lookups, hits = lookups + 1, hits + bool(cached)
            seen.add(replica)
    return {
        "num_requests": len(outcomes),
        "num_ok": len(ok),
        "num_ok_first_try": sum(len(o.attempts) == 1 for o in ok),
        "num_ok_after_retry": sum(len(o.attempts) > 1 for o in ok),
        "num_lost": sum(o.is_lost for o in outcomes),
        "lost": [(o.index, o.final.kind, o.final.error) for o in outcomes if o.is_lost][:10],
        "failed_attempts_by_kind": dict(Counter(a.kind for a in failed_attempts)),
        "served_by_victim_after_kill": sum(o.final.replica_id == victim and o.final.end_s > killed_t + 0.5 for o in ok),
        "orphaned_groups": len(orphaned),
        "orphaned_groups_rehomed": rehomed,
        "orphaned_groups_on_one_replica": on_one_replica,
        "orphaned_repeat_hit_rate": hits / lookups if lookups else None,
        "latency_p50_s": percentile([o.latency_s for o in ok], 50),
        "latency_p99_s": percentile([o.latency_s for o in ok], 99),
        "retried_latency_max_s": max((o.latency_s for o in ok if len(o.attempts) > 1), default=None),
    }


async def _rejoin_probe(url: str, replacement: list[str], headers: dict | None, seed: int, kill_t: float,
                        num_probes: int = 24, max_rounds: int = 8, pause_s: float = 2.0) -> tuple[float, float | None]:
    """``(share, seconds after the kill)`` of the first round of fresh cold
    prefixes that reached the replacement: > 0 once it rejoined the ring.

    A replica posts its stats (which is when it counts as registered) from
    its constructor, before Serve marks it running and the ingress's router
    learns of it, so rounds repeat ``pause_s`` apart, at most ``max_rounds``
    times; ``(0.0, None)`` if none reached it."""
    for round_index in range(max_rounds):
        bodies = [body for _, body in group_bodies(num_probes, num_groups=num_probes, prefix_tokens=96,
                                                   question_tokens=4, max_new_tokens=2,
                                                   seed=seed + 10_000 + round_index)]
        sent_s = time.monotonic() - kill_t
        outcomes = await open_loop(url, bodies, rate_rps=20.0, headers=headers)
        served = [o.final.replica_id for o in outcomes if o.ok]
        share = sum(r in replacement for r in served) / max(1, len(served))
        if share > 0:
            return share, sent_s
        await asyncio.sleep(pause_s)
    return 0.0, None


# ------------------------------------------------------------------ overload
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
                   seed: int = 0) -> dict:
    """Measure capacity (closed loop, ``concurrency`` in flight, after a
    warm-up), then offer ``factor`` × capacity open-loop for ``duration_s``,
    ``rounds`` times, no retries. Admitted requests must stay fast, the excess
    must get 429/503 with ``Retry-After``, nothing else; memory is sampled
    after the warm-up and after each round."""
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
                     "generator_niceness": os.getpriority(os.PRIO_PROCESS, 0), "rounds": []}
    for round_index in range(rounds):
        offered = bodies(int(factor * capacity_rps * duration_s), 1000 * (round_index + 1))
        start = time.monotonic()
        cluster_cpu_s, own_cpu_s = resources.cpu_s(app.ray_pids()), resources.own_cpu_s()
        role_cpu_s = resources.cpu_s_by_role(app.ray_pids())
        done = asyncio.Event()
        depths = asyncio.ensure_future(_max_engine_depths(app.url, headers, done))
        try:
            outcomes = await open_loop(app.url, offered, factor * capacity_rps, headers=headers, max_attempts=1,
                                       max_connections=1024)
        finally:
            done.set()
        wall_s = time.monotonic() - start
        round_cluster_cpu_s, round_own_cpu_s = resources.cpu_s(app.ray_pids()) - cluster_cpu_s, resources.own_cpu_s() - own_cpu_s
        role_cores = {role: round((cpu - role_cpu_s.get(role, 0.0)) / wall_s, 2)
                      for role, cpu in resources.cpu_s_by_role(app.ray_pids()).items()}
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


# ------------------------------------------------------------------- CLI
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

def _config_without_access_log(config_path: str) -> str:
    """A copy of ``config_path`` with Serve's access log off (proxy and app)."""
    from harness.serving import REPO_ROOT

    config = yaml.safe_load((REPO_ROOT / config_path).read_text())
    config["logging_config"] = {"enable_access_log": False}
    for app in config["applications"]:
        app["logging_config"] = {"enable_access_log": False}
    handle, path = tempfile.mkstemp(prefix="kvroute-noaccess-", suffix=".yaml")
    with os.fdopen(handle, "w") as file:
        yaml.safe_dump(config, file)
    return path


def _app(args, **overrides):
    from harness.serving import ServeApp

    return ServeApp(args.config, **overrides)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("scenario", choices=["replica-failure", "overload"])
    parser.add_argument("--factor", type=float, action="append", default=None,
                        help="overload: offered load / capacity (repeat: one scenario per factor, same cluster)")
    parser.add_argument("--duration-s", type=float, default=6.0, help="overload: seconds per round")
    parser.add_argument("--stream", action="store_true", help="overload: streamed requests")
    parser.add_argument("--rounds", type=int, default=2, help="overload: rounds (memory is sampled after each)")
    parser.add_argument("--nice", type=int, default=19,
                        help="overload: the load generator's niceness once the cluster is up (it shares the cores)")
    parser.add_argument("--no-access-log", action="store_true",
                        help="overload: Serve's access log off (logging_config.enable_access_log: false)")
    parser.add_argument("--proxy-limit", type=int, default=None, metavar="N",
                        help="overload: the Ingress takes N requests at once and Serve's proxy queues 1 more: the "
                             "proxy refuses the rest itself (plain-text 503 + Retry-After), before any Ray call")
    parser.add_argument("--config", default="deploy/config.yaml")
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--rate", type=float, default=20.0)
    parser.add_argument("--kill-at-s", type=float, default=3.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    figures: dict
    if args.scenario == "replica-failure":
        with _app(args, num_cpus=args.replicas, deployment_overrides={"Worker": {"num_replicas": args.replicas}},
                  args_overrides={"stats_period_s": 0.5}) as app:
            app.deploy()
            figures = asyncio.run(replica_failure(app, num_requests=args.requests, rate_rps=args.rate,
                                                  kill_at_s=args.kill_at_s, seed=args.seed))
    elif args.scenario == "overload":
        overrides = copy.deepcopy(OVERLOAD_APP)
        if args.proxy_limit is not None:
            overrides["deployment_overrides"]["Ingress"].update(max_ongoing_requests=args.proxy_limit,
                                                                 max_queued_requests=1)
        if args.no_access_log:
            args.config = _config_without_access_log(args.config)
        with _app(args, num_cpus=2, **overrides) as app:
            app.deploy()
            os.nice(args.nice)  # this process only: the cluster started above keeps its priority
            figures = {f"{factor:g}x": asyncio.run(overload(app, factor=factor, duration_s=args.duration_s,
                                                             stream=args.stream, rounds=args.rounds, seed=args.seed))
                       for factor in args.factor or [8.0]}
    text = json.dumps({"scenario": args.scenario, "args": vars(args), "figures": figures}, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as file:
            file.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
