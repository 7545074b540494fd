"""Reliability scenarios against a live app, each ending in figures.

    python -m harness.chaos replica-failure --replicas 3 --requests 300 --json results/chaos-failure.json
    python -m harness.chaos overload --factor 8 --json results/chaos-overload.json
    python -m harness.chaos overload --direct-ingress --factor 5 --factor 10 --json results/chaos-overload-direct.json
    python -m harness.chaos refusal-cost [--direct-ingress | --proxy-limit 2] --json results/refusal-cost.json

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
import sys
import time
from collections import Counter

import httpx

from harness import faults
from harness.loadstats import percentile
from harness.overload import OVERLOAD_APP, closed_loop, config_without_access_log, overload  # noqa: F401 (re-exported)
from harness.refusal_cost import refusal_cost
from harness.retry_client import Outcome
from harness.traffic import group_bodies, open_loop  # noqa: F401 (re-exported)


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

    def homes() -> Counter:
        """How many groups each replica is home to: it answered the group's latest finished request."""
        latest: dict[int, tuple[float, str]] = {}
        for outcome in finished:
            group = pairs[outcome.index][0]
            if outcome.ok and outcome.final.end_s > latest.get(group, (0.0, ""))[0]:
                latest[group] = (outcome.final.end_s, outcome.final.replica_id)
        return Counter(replica for _, replica in latest.values())

    async def kill() -> None:
        # The victim is home to the most prefixes at the kill. On a slow machine
        # nothing may have finished by ``kill_at_s``: the kill then waits for the
        # first answers (bounded), so that there are prefixes to orphan.
        nonlocal victim, kill_t
        await asyncio.sleep(max(0.0, kill_t - time.monotonic()))
        while not homes() and not done.is_set() and time.monotonic() - kill_t < recovery_timeout_s:
            await asyncio.sleep(0.05)
        kill_t, home_counts = time.monotonic(), homes()
        victim = max(sorted(before), key=lambda replica: home_counts[replica])
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
    """``kill_t``: when the kill was decided (the victim chosen); ``killed_t``: when the SIGKILL was sent
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
        # Sent more than 0.5 s after the SIGKILL and answered by the dead replica: the router chose it after
        # all. (By when the answer *ended* this counted answers the victim had finished before dying but a
        # client busy on an overloaded 2-core machine read up to seconds later.)
        "served_by_victim_after_kill": sum(o.final.replica_id == victim and o.final.start_s > killed_t + 0.5 for o in ok),
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


# ------------------------------------------------------------------- CLI
def _app(args, **overrides):
    from harness.direct_ingress import INGRESS_ENV, DirectIngressApp
    from harness.haproxy_ingress import HAProxyApp
    from harness.serving import ServeApp

    if args.proxy_admission is not None:
        from deploy.proxy_admission import environment

        overrides["cluster_env"] = environment(None if args.proxy_admission == "auto" else int(args.proxy_admission))
    if not (args.direct_ingress or args.haproxy):
        return ServeApp(args.config, **overrides)
    ingress_env = {**INGRESS_ENV, **dict(item.split("=", 1) for item in args.ingress_env)}
    return (HAProxyApp if args.haproxy else DirectIngressApp)(args.config, ingress_env=ingress_env, **overrides)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("scenario", choices=["replica-failure", "overload", "refusal-cost"])
    parser.add_argument("--factor", type=float, action="append", default=None,
                        help="overload: offered load / capacity (repeat: one scenario per factor, same cluster)")
    parser.add_argument("--duration-s", type=float, default=6.0, help="overload: seconds per round")
    parser.add_argument("--stream", action="store_true", help="overload: streamed requests")
    parser.add_argument("--rounds", type=int, default=2, help="overload: rounds (memory is sampled after each)")
    parser.add_argument("--nice", type=int, default=19,
                        help="overload: the load generator's niceness once the cluster is up (it shares the cores)")
    parser.add_argument("--generator", choices=["lean", "aiohttp"], default="lean",
                        help="overload: what sends the open-loop rounds (harness/lean_sender.py, or the aiohttp retry "
                             "client the figures before 2026-12-02 used); streams always use aiohttp")
    parser.add_argument("--no-access-log", action="store_true",
                        help="overload: Serve's access log off (logging_config.enable_access_log: false)")
    parser.add_argument("--proxy-limit", type=int, default=None, metavar="N",
                        help="overload: the Ingress takes N requests at once and Serve's proxy queues 1 more: the "
                             "proxy refuses the rest itself (plain-text 503 + Retry-After), before any Ray call")
    parser.add_argument("--proxy-admission", default=None, metavar="N|auto",
                        help="overload: kvroute's admission in Serve's Python proxy (deploy/proxy_admission.py): the "
                             "proxy lets N generation requests through at once (auto: the Ingress's limit, learned "
                             "from its answers) and refuses the rest with kvroute's JSON 429 + Retry-After, before "
                             "any Ray call")
    parser.add_argument("--direct-ingress", action="store_true",
                        help="Serve's direct ingress (RAY_SERVE_ENABLE_DIRECT_INGRESS=1): the load goes to the Ingress "
                             "replica's own HTTP server, no proxy and no Ray call before kvroute's admission")
    parser.add_argument("--haproxy", action="store_true",
                        help="Serve's HAProxy ingress (RAY_SERVE_ENABLE_HA_PROXY=1): HAProxy on the app's port forwards "
                             "to the Ingress replica's own HTTP server (harness/haproxy_ingress.py)")
    parser.add_argument("--ingress-env", action="append", default=[], metavar="NAME=VALUE",
                        help="with --direct-ingress or --haproxy: an env var for the Ingress replica over harness/direct_ingress.py's "
                             "INGRESS_ENV, e.g. RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD=1")
    parser.add_argument("--config", default="deploy/config.yaml")
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--requests", type=int, default=None,
                        help="replica-failure: requests (300); refusal-cost: refusals sent (1200)")
    parser.add_argument("--rate", type=float, default=None,
                        help="replica-failure: req/s (20); refusal-cost: refusals/s (150)")
    parser.add_argument("--kill-at-s", type=float, default=3.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    default_requests, default_rate = (1200, 150.0) if args.scenario == "refusal-cost" else (300, 20.0)
    args.requests = default_requests if args.requests is None else args.requests
    args.rate = default_rate if args.rate is None else args.rate

    figures: dict
    if args.scenario == "replica-failure":
        with _app(args, num_cpus=args.replicas, deployment_overrides={"Worker": {"num_replicas": args.replicas}},
                  args_overrides={"stats_period_s": 0.5}) as app:
            app.deploy()
            figures = asyncio.run(replica_failure(app, num_requests=args.requests, rate_rps=args.rate,
                                                  kill_at_s=args.kill_at_s, seed=args.seed))
    else:
        overrides = copy.deepcopy(OVERLOAD_APP)
        if args.scenario == "refusal-cost":  # 1 per Worker: the limit is 2, held by 2 long requests
            overrides["args_overrides"]["max_in_flight_per_worker"] = 1
        if args.proxy_limit is not None:
            overrides["deployment_overrides"]["Ingress"].update(max_ongoing_requests=args.proxy_limit,
                                                                 max_queued_requests=1)
        if args.no_access_log:
            args.config = config_without_access_log(args.config)
        with _app(args, num_cpus=2, **overrides) as app:
            app.deploy()
            os.nice(args.nice)  # this process only: the cluster started above keeps its priority
            if args.scenario == "refusal-cost":
                figures = asyncio.run(refusal_cost(app, num_held=2, num_refusals=args.requests, rate_rps=args.rate,
                                                   seed=args.seed))
            else:
                figures = {f"{factor:g}x": asyncio.run(overload(app, factor=factor, duration_s=args.duration_s,
                                                                 stream=args.stream, rounds=args.rounds,
                                                                 seed=args.seed, generator=args.generator))
                           for factor in args.factor or [8.0]}
    text = json.dumps({"scenario": args.scenario, "args": vars(args), "figures": figures}, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as file:
            file.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
