"""Integrity under concurrency: many concurrent streams sharing prefixes on
small KV pools (so requests are also preempted), a third of the clients
vanishing mid-stream. Afterwards every replica is back to its baseline (no
request holds a block, every used block is held only by the radix cache,
nothing is locked, ``check_invariants()`` passes) and every completed output
equals the plain reference, bit for bit (deterministic mode)."""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import pytest

from harness.faults import replica_stats, wait_for_clean_audits
from harness.sse import DONE, sse_event
from harness.serving import config_engine_args
from tests.reliability.conftest import AUTH, CORE_ENGINE, tokens
from worker import Engine, EngineConfig, reference

pytestmark = pytest.mark.ray

NUM_REQUESTS = 48
MAX_NEW_TOKENS = 32


def _bodies(seed: int) -> list[dict]:
    rng = random.Random(seed)
    systems = [tokens(seed * 10 + g, 80) for g in range(6)]
    bodies = []
    for i in range(NUM_REQUESTS):
        body = {"prompt_token_ids": rng.choice(systems) + tokens(seed * 1000 + i, rng.randrange(4, 24)),
                "max_new_tokens": MAX_NEW_TOKENS, "ignore_eos": True, "logprobs": True, "stream": True}
        if i % 7 == 0:
            body["cache_salt"] = "tenant-x"
        bodies.append(body)
    return bodies


async def _stream(client: httpx.AsyncClient, url: str, body: dict, leave_after: int | None):
    """Token ids and logprobs of a completed stream, or None if we walked away."""
    token_ids, logprobs = [], []
    async with client.stream("POST", url + "/generate", json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            event = sse_event(line)
            if event is None or event == DONE:
                continue
            assert "error" not in event, event
            if event.get("done"):
                return token_ids, logprobs
            token_ids.append(event["token_id"])
            logprobs.append(event["logprob"])
            if leave_after is not None and len(token_ids) > leave_after:
                return None  # closing the response drops the connection mid-stream
    raise AssertionError("stream ended without its summary")


@pytest.fixture(scope="module")
def reference_engine():
    config = config_engine_args(**CORE_ENGINE)
    config.pop("num_threads", None)  # process-wide in torch: leave this test process alone
    return Engine(EngineConfig(**config))


def test_concurrent_shared_prefixes_with_disconnects_leave_no_leak_and_match_the_reference(core_app, reference_engine):
    rng = random.Random(5)
    bodies = _bodies(5)
    leave_after = [rng.choice([0, 1, 3, 8, 20]) if i % 3 == 0 else None for i in range(NUM_REQUESTS)]
    before = replica_stats(core_app.url, AUTH)

    async def run():
        limits = httpx.Limits(max_connections=NUM_REQUESTS + 8)
        async with httpx.AsyncClient(trust_env=False, headers=AUTH, timeout=120, limits=limits) as client:
            return await asyncio.gather(*(_stream(client, core_app.url, b, k) for b, k in zip(bodies, leave_after)))

    results = asyncio.run(run())
    end_s = time.time()
    audits = wait_for_clean_audits(core_app.url, 2, after_s=end_s, headers=AUTH)
    for audit in audits:
        assert audit.is_clean, audit  # idle, invariants ok, every block free or cached only
        assert audit.details["kv_blocks_unaccounted"] == 0 and audit.details["kv_blocks_in_use"] == 0
    stats = replica_stats(core_app.url, AUTH)
    def grew(key: str) -> int:
        return sum(s[key] for s in stats.values()) - sum(s[key] for s in before.values())

    assert grew("num_aborted") >= 1  # the servers noticed the clients leaving (not all: some finished first)
    assert grew("preemptions") > 0  # the small pools really ran out

    completed = [(b, r) for b, r in zip(bodies, results) if r is not None]
    print(f"FIGURES integrity: {NUM_REQUESTS} streams, {NUM_REQUESTS - len(completed)} clients left mid-stream, "
          f"{grew('num_aborted')} aborted and {grew('preemptions')} preemptions on the servers; audits: "
          + "; ".join(f"{a.details['invariants']}, free {a.details['kv_blocks_free']} + cached-only "
                      f"{a.details['kv_blocks_cached_only']} = {a.details['kv_blocks_total']}, unaccounted "
                      f"{a.details['kv_blocks_unaccounted']}" for a in audits))
    assert len(completed) >= NUM_REQUESTS // 2
    for body, (token_ids, logprobs) in completed:
        assert len(token_ids) == MAX_NEW_TOKENS
        expected_tokens, expected_logprobs = reference.generate(
            reference_engine, body["prompt_token_ids"], MAX_NEW_TOKENS, logprobs=True)
        n = len(expected_tokens)  # the reference stops at EOS; the stream ran on (ignore_eos)
        assert token_ids[:n] == expected_tokens and logprobs[:n] == expected_logprobs
