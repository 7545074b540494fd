"""The load test's client (``python -m harness.loadtest``): every request a
streamed ``POST /generate``, so the client measures TTFT and inter-token
latency itself.

A session's turns go one after another, each prompt holding the previous
prompt and answer; sessions run closed loop (``concurrency`` at a time) or
open loop (Poisson arrivals, or the workload's own arrival times), bounded in
wall time. :func:`run_one` is one measured run with the server's /stats read
before and after it; :func:`warm_up` sends untimed requests before one.
"""

from __future__ import annotations

import asyncio
import random
import sys
import time
from dataclasses import dataclass, replace

import httpx

from harness.loadstats import RequestRecord
from harness.replica_counters import run_counters
from harness.sse import DONE, sse_event
from harness.workloads import Session, shared_prefix


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
                    record.server_queue_s = event.get("queue_s")
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


STATS_SETTLE_S = 2.5  # replicas post /stats every stats_period_s (1 s): the last requests show after this


def _stats_or_error(url: str) -> dict:
    try:
        return asyncio.run(fetch_stats(url))
    except Exception as error:  # noqa: BLE001 - stats are a bonus, the run already happened
        return {"error": str(error)}


ROUTING_READS = 8  # /stats reads after a run: each shows the router of the Ingress replica that answered


def every_router(url: str, first: dict) -> list[dict]:
    """The request routers' own view (``/stats``' ``routing``) of every
    Ingress replica that answered one of ``ROUTING_READS`` more reads
    (the proxy spreads them), by the replica each runs in; ``first``: a
    ``/stats`` answer already read."""
    routers = {router.get("in_replica"): router for router in first.get("routing", ())}
    for _ in range(ROUTING_READS):
        for router in _stats_or_error(url).get("routing", ()):
            routers.setdefault(router.get("in_replica"), router)
    return [routers[key] for key in sorted(routers, key=str)]


def run_one(options: RunOptions, sessions: list[Session], label: str) -> tuple[list[RequestRecord], float, dict]:
    """One measured run: records, wall time, and the server's /stats after it
    (its ``run_counters``: the replicas' counters over the run, after minus
    before; ``routing``: what every Ingress's router read, :func:`every_router`)."""
    total = sum(len(s.turns) for s in sessions)
    before = _stats_or_error(options.url)
    update, close = _progress_bar(total, label)
    records, wall_s = asyncio.run(run_workload(options, sessions, update))
    close()
    time.sleep(STATS_SETTLE_S)
    server_stats = _stats_or_error(options.url)
    server_stats["run_counters"] = run_counters(before, server_stats)
    if "error" not in server_stats:
        server_stats["routing"] = every_router(options.url, server_stats)
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
