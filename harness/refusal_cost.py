"""What one refusal costs in CPU, per path a request takes to kvroute's
admission (Serve's proxy → Ray → Ingress, or the Ingress's own server with
direct ingress, or Serve's proxy refusing by itself).

    python -m harness.chaos refusal-cost --json results/refusal-cost-proxy.json
    python -m harness.chaos refusal-cost --direct-ingress --json results/refusal-cost-direct.json

The admission limit is held full by long requests that keep it full (each
re-sent as it finishes); then two windows of the same length: a quiet one
(held, nothing else) and one with refusals arriving open loop. A role's CPU
per refusal is its CPU in the refusal window beyond the quiet window's rate,
over the refusals: the Workers' decoding of the held requests cancels out,
and so does Ray's background work. The generator's own share is measured
the same way (this process; run at a niceness, it takes what is left).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter

from harness import resources
from harness.retry_client import client_session, send
from harness.traffic import group_bodies, open_loop


def _cpu_by_role(app) -> dict[str, float]:
    return {**resources.cpu_s_by_role(app.ray_pids()), "generator": resources.own_cpu_s()}


async def _window(app, work) -> tuple[dict[str, float], float, object]:
    """(CPU seconds per role, wall seconds, result) of awaiting ``work``."""
    before, start = _cpu_by_role(app), time.monotonic()
    result = await work
    after, wall_s = _cpu_by_role(app), time.monotonic() - start
    return {role: after[role] - before.get(role, 0.0) for role in after}, wall_s, result


async def refusal_cost(app, *, num_held: int, num_refusals: int = 1200, rate_rps: float = 150.0,
                       hold_tokens: int = 1024, headers: dict | None = None, seed: int = 0) -> dict:
    """Hold ``num_held`` requests (the admission limit) in flight, then
    measure a quiet window and a window of ``num_refusals`` requests at
    ``rate_rps``; CPU ms per refusal by role (module docstring)."""
    held_body = {"prompt_token_ids": list(range(40, 56)), "max_new_tokens": hold_tokens, "ignore_eos": True}
    refused_bodies = [body for _, body in group_bodies(
        num_refusals, num_groups=8, prefix_tokens=64, question_tokens=192, max_new_tokens=8, seed=seed)]
    stop = asyncio.Event()
    held_kinds: list[str] = []

    async def hold(client) -> None:
        while not stop.is_set():
            outcome = await send(client, app.url, held_body, headers=headers, max_attempts=1, timeout_s=300)
            held_kinds.append(outcome.final.kind)
            if not outcome.ok:
                await asyncio.sleep(0.05)

    async with client_session(2 * num_held) as client:
        holders = [asyncio.ensure_future(hold(client)) for _ in range(num_held)]
        try:
            await asyncio.sleep(3.0)  # all admitted and decoding
            window_s = num_refusals / rate_rps
            quiet_cpu, quiet_s, _ = await _window(app, asyncio.sleep(window_s))
            loud_cpu, loud_s, outcomes = await _window(app, open_loop(
                app.url, refused_bodies, rate_rps, headers=headers, max_attempts=1, max_connections=256))
        finally:
            stop.set()
            for task in holders:
                task.cancel()
            await asyncio.gather(*holders, return_exceptions=True)
    refused = [o for o in outcomes if not o.ok]
    num_refused = max(1, len(refused))
    # a role's CPU in the refusal window beyond what it used at its quiet rate
    extra_cpu_s = {role: loud_cpu[role] - quiet_cpu.get(role, 0.0) / quiet_s * loud_s for role in loud_cpu}
    per_refusal_ms = {role: round(1000 * cpu / num_refused, 2) for role, cpu in extra_cpu_s.items()}
    kinds = dict(Counter(outcome.final.kind for outcome in outcomes))
    return {
        "num_held": num_held, "num_sent": len(outcomes), "num_refused": len(refused), "statuses": kinds,
        "rate_rps": rate_rps, "achieved_rps": round(len(outcomes) / loud_s, 1),
        "cpu_ms_per_refusal": per_refusal_ms,
        "serving_path_cpu_ms_per_refusal": round(sum(per_refusal_ms[r] for r in ("proxy", "ingress", "ray")), 2),
        "quiet_cores": {role: round(cpu / quiet_s, 3) for role, cpu in quiet_cpu.items()},
        "refusal_window_cores": {role: round(cpu / loud_s, 3) for role, cpu in loud_cpu.items()},
        "refusal_latency_p50_s": sorted(o.latency_s for o in refused)[len(refused) // 2] if refused else None,
        "held_requests_finished": dict(Counter(held_kinds)),
        "rejected_without_retry_after": sum(o.final.retry_after_s is None for o in refused),
    }
