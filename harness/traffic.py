"""Request bodies and an open-loop sender shared by the reliability
scenarios (``harness/chaos.py``, ``harness/overload.py``)."""

from __future__ import annotations

import asyncio
import random
import time

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
