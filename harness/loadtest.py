"""Load test across the replicas, and the same workload under several request
routers side by side.

    python -m harness.loadtest --url http://127.0.0.1:8000 --workload shared-prefix
    python -m harness.loadtest --compare-routers pow2,prefix_affinity,kvroute \\
        --workload shared-prefix --rounds 3 --json results/loadtest.json --plot results/loadtest.png

Every request is a streamed ``POST /generate`` so the client measures TTFT and
inter-token latency itself. ``--compare-routers`` deploys ``deploy/config.yaml``
once per router and round (``serve run --non-blocking`` with ``args.router``
replaced, fresh replicas and caches each time), warms it up with a few
unrelated requests, runs the identical workload, and shuts the app down
again; the router order rotates from round to round (whoever runs first on a
fresh cluster has an edge) and each router's requests pool over its rounds. It needs a running Ray cluster (``ray start --head``) or
starts one itself and stops it at the end. Targets 127.0.0.1 by default; every
loop is bounded in request count and wall time.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, replace

import httpx

from harness.loadstats import RequestRecord, summarize
from harness.sse import DONE, sse_event
from harness.workloads import WORKLOADS, Session, build_workload, shared_prefix


@dataclass(frozen=True, slots=True)
class RunOptions:
    url: str
    mode: str  # "closed" | "open"
    concurrency: int
    rate_rps: float | None  # open loop: Poisson rate; None = the workload's own arrival times
    time_scale: float  # open loop with arrival times: multiply gaps by this
    timeout_s: float
    max_duration_s: float


async def _one_request(client: httpx.AsyncClient, url: str, prompt: list[int], max_new_tokens: int,
                       salt: str | None, session_id: int, turn: int, timeout_s: float) -> tuple[RequestRecord, list[int]]:
    body = {"prompt_token_ids": prompt, "max_new_tokens": max_new_tokens, "stream": True, "ignore_eos": True}
    if salt:
        body["cache_salt"] = salt
    start = time.perf_counter()
    token_times: list[float] = []
    tokens: list[int] = []
    record = RequestRecord(session_id=session_id, turn=turn, prompt_tokens=len(prompt), start_s=start)
    try:
        async with client.stream("POST", f"{url}/generate", json=body, timeout=timeout_s) as response:
            if response.status_code != 200:
                await response.aread()
                record.status = response.status_code
                record.error = response.text[:200]
                record.end_s = time.perf_counter()
                return record, tokens
            async for line in response.aiter_lines():
                event = sse_event(line)
                if event is None or event == DONE:
                    continue
                if "error" in event:
                    record.status, record.error = 500, str(event["error"])[:200]
                elif event.get("done"):
                    record.replica_id = event.get("replica_id")
                    record.cached_tokens = event.get("cached_tokens", 0)
                    record.server_ttft_s = event.get("ttft_s")
                elif "token_id" in event:
                    token_times.append(time.perf_counter())
                    tokens.append(event["token_id"])
    except (httpx.HTTPError, asyncio.TimeoutError) as error:
        record.status, record.error = 599, f"{type(error).__name__}: {error}"[:200]
    record.end_s = time.perf_counter()
    record.output_tokens = len(tokens)
    if token_times:
        record.ttft_s = token_times[0] - start
        record.itl_s = [b - a for a, b in zip(token_times, token_times[1:])]
    return record, tokens


async def _run_session(client, options: RunOptions, session: Session, session_id: int,
                       records: list[RequestRecord], deadline: float, progress) -> None:
    history: list[int] = list(session.prefix)
    for turn_index, turn in enumerate(session.turns):
        if time.perf_counter() > deadline:
            return
        prompt = history + list(turn.question)
        record, answer = await _one_request(client, options.url, prompt, turn.max_new_tokens, session.salt,
                                            session_id, turn_index, options.timeout_s)
        records.append(record)
        progress(1)
        if record.status != 200:
            return  # a conversation cannot continue past a failed turn
        history = prompt + answer


async def run_workload(options: RunOptions, sessions: list[Session], progress=lambda n: None) -> tuple[list[RequestRecord], float]:
    """Drive ``sessions`` against ``options.url``; returns the records and wall time."""
    records: list[RequestRecord] = []
    limits = httpx.Limits(max_connections=max(options.concurrency, 64) * 2, max_keepalive_connections=64)
    start = time.perf_counter()
    deadline = start + options.max_duration_s
    async with httpx.AsyncClient(limits=limits, trust_env=False) as client:
        if options.mode == "closed":
            queue = list(enumerate(sessions))[::-1]

            async def worker():
                while queue and time.perf_counter() < deadline:
                    session_id, session = queue.pop()
                    await _run_session(client, options, session, session_id, records, deadline, progress)

            await asyncio.gather(*(worker() for _ in range(options.concurrency)))
        else:
            rng = random.Random(0)
            arrivals, clock = [], 0.0
            for session in sessions:
                if options.rate_rps:
                    clock += rng.expovariate(options.rate_rps)
                else:
                    clock = session.arrival_s * options.time_scale
                arrivals.append(clock)
            tasks = []
            for session_id, (session, arrival) in enumerate(zip(sessions, arrivals)):
                delay = start + arrival - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                if time.perf_counter() > deadline:
                    break
                tasks.append(asyncio.create_task(
                    _run_session(client, options, session, session_id, records, deadline, progress)))
            await asyncio.gather(*tasks)
    return records, time.perf_counter() - start


async def fetch_stats(url: str) -> dict:
    async with httpx.AsyncClient(trust_env=False) as client:
        response = await client.get(f"{url}/stats", timeout=10)
        response.raise_for_status()
        return response.json()


def _progress_bar(total: int, label: str):
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm is in the bench extra; fall back to silence
        return lambda n: None, lambda: None
    bar = tqdm(total=total, desc=label, unit="req", file=sys.stderr)
    return bar.update, bar.close


def run_one(options: RunOptions, sessions: list[Session], label: str) -> tuple[list[RequestRecord], float, dict]:
    """One measured run: records, wall time, and the server's /stats after it."""
    total = sum(len(s.turns) for s in sessions)
    update, close = _progress_bar(total, label)
    records, wall_s = asyncio.run(run_workload(options, sessions, update))
    close()
    try:
        server_stats = asyncio.run(fetch_stats(options.url))
    except Exception as error:  # noqa: BLE001 - stats are a bonus, the run already happened
        server_stats = {"error": str(error)}
    return records, wall_s, server_stats


def warm_up(options: RunOptions, num_requests: int, seed: int) -> None:
    """Untimed requests on unrelated prompts (so no measured prefix is cached):
    every replica has run a step and the ingress's router knows every replica
    before the clock starts. Then one routing-stats period of quiet."""
    if num_requests <= 0:
        return
    sessions = shared_prefix(random.Random(seed + 7919), num_requests, 1, 64, 16, 4)
    asyncio.run(run_workload(replace(options, mode="closed", concurrency=num_requests), sessions))
    time.sleep(2.0)


def _rank_replicas(records: list[RequestRecord]) -> list[RequestRecord]:
    """Replica ids → "busiest", "2nd", ... so rounds on fresh replicas pool."""
    counts = Counter(r.replica_id for r in records if r.ok)
    rank = {replica: f"rank-{i + 1}" for i, (replica, _) in enumerate(counts.most_common())}
    return [dataclasses.replace(r, replica_id=rank.get(r.replica_id, r.replica_id)) for r in records]


def compare_routers(args, options: RunOptions, sessions: list[Session], slo: dict) -> dict[str, dict]:
    """Each round deploys every router in turn (fresh replicas and caches),
    rotating the order so none always goes first; records pool per router."""
    from harness.serving import ServeApp

    routers = args.compare_routers.split(",")
    pooled: dict[str, list] = {router: [] for router in routers}
    per_round: dict[str, list] = {router: [] for router in routers}
    with ServeApp(args.config) as app:
        options = replace(options, url=app.url)
        num_workers = None
        for round_index in range(args.rounds):
            shift = round_index % len(routers)
            for router in routers[shift:] + routers[:shift]:
                kwargs = json.loads(args.kvroute_kwargs) if args.kvroute_kwargs and router == "kvroute" else None
                app.deploy(router=router, router_kwargs=kwargs)
                warm_up(options, args.warmup_requests, args.seed)
                records, wall_s, stats = run_one(options, sessions, f"{router} (round {round_index + 1})")
                num_workers = app.expected_workers()
                app.shutdown_app()
                pooled[router].append((records, wall_s))
                round_summary = summarize(records, wall_s, slo, num_workers)
                round_summary["server_stats"] = stats
                round_summary["load_average"] = os.getloadavg()  # 1/5/15 min, at the round's end
                per_round[router].append(round_summary)
    results = {}
    for router in routers:
        records = [r for round_records, _ in pooled[router] for r in _rank_replicas(round_records)]
        summary = summarize(records, sum(wall for _, wall in pooled[router]), slo, num_workers)
        summary["rounds"] = per_round[router]
        results[router] = summary
    return results


def main(argv: list[str] | None = None) -> int:
    from harness.loadreport import print_table, write_plot

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--compare-routers", default=None, help="comma list, e.g. pow2,prefix_affinity,kvroute")
    parser.add_argument("--config", default="deploy/config.yaml")
    parser.add_argument("--rounds", type=int, default=3, help="--compare-routers: rounds, router order rotated")
    parser.add_argument("--warmup-requests", type=int, default=8, help="untimed requests before each run")
    parser.add_argument("--kvroute-kwargs", default=None, help="JSON request_router_kwargs for our router")
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="shared-prefix")
    parser.add_argument("--trace", default=None, help="Mooncake-format JSONL for --workload mooncake")
    parser.add_argument("--scale", default="cpu", choices=["cpu", "gpu"], help="workload size preset")
    parser.add_argument("--workload-args", default="{}", help='JSON overrides, e.g. {"num_groups": 4}')
    parser.add_argument("--mode", choices=["closed", "open"], default="closed")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rate", type=float, default=None, help="open loop: Poisson arrivals per second")
    parser.add_argument("--time-scale", type=float, default=1.0)
    parser.add_argument("--timeout-s", type=float, default=300.0)
    parser.add_argument("--max-duration-s", type=float, default=900.0)
    parser.add_argument("--slo-ttft-s", type=float, default=2.0)
    parser.add_argument("--slo-itl-s", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    parser.add_argument("--plot", default=None)
    args = parser.parse_args(argv)

    sessions = build_workload(args.workload, args.scale, json.loads(args.workload_args), args.trace, args.seed)
    options = RunOptions(args.url, args.mode, args.concurrency, args.rate, args.time_scale, args.timeout_s, args.max_duration_s)
    slo = {"ttft_s": args.slo_ttft_s, "itl_s": args.slo_itl_s}
    meta = {"workload": args.workload, "scale": args.scale, "mode": args.mode, "concurrency": args.concurrency,
            "rate_rps": args.rate, "num_sessions": len(sessions), "num_requests": sum(len(s.turns) for s in sessions),
            "options": asdict(options), "slo": slo}
    if args.compare_routers:
        meta["rounds"] = args.rounds
        results = compare_routers(args, options, sessions, slo)
    else:
        warm_up(options, args.warmup_requests, args.seed)
        records, wall_s, stats = run_one(options, sessions, "server")
        results = {"server": summarize(records, wall_s, slo) | {"server_stats": stats}}
    report = {"meta": meta, "results": results}
    print_table(report)
    if args.json:
        with open(args.json, "w") as file:
            json.dump(report, file, indent=2)
    if args.plot:
        write_plot(report, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
