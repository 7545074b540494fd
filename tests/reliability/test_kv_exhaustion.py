"""KV pool exhaustion: requests whose KV exceeds what the pool can hold at
once are preempted and recomputed (outputs still equal the plain reference,
bit for bit, in deterministic mode) or, when one request alone exceeds the
pool, rejected with a clear error; never a crash, never a leaked block.

Engine level (worker.AsyncEngine on tiny-llama, no Ray) plus one live check
against the shared app, whose Workers have a 2048-token pool."""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import pytest

from tests.reliability.conftest import AUTH, tokens
from worker import AsyncEngine, EngineConfig, SamplingParams, reference
from worker.results import GenerationResult
from worker.audit import audit

# 24 blocks of 16 positions. Each request below is admitted with 3-6 blocks
# for its prompt and grows to 10-13 while it decodes, so several start
# together and then run out: the youngest are preempted and recomputed.
TINY_POOL = dict(deterministic=True, kv_pool_tokens=384, cache_budget_tokens=128, block_size=16,
                 max_batch_tokens=64, max_num_seqs=8, max_model_len=1024)


@pytest.fixture(scope="module")
def engine():
    engine = AsyncEngine(EngineConfig(**TINY_POOL))
    yield engine
    asyncio.run(engine.shutdown())


def _prompts(seed: int, count: int) -> list[list[int]]:
    rng = random.Random(seed)
    shared = tokens(seed, 48)
    return [(shared if i % 2 else []) + tokens(seed * 100 + i, rng.randrange(40, 70)) for i in range(count)]


def _assert_matches_reference(inner, prompt, result, max_new_tokens: int) -> None:
    """The reference stops at EOS; the engine ran on (``ignore_eos``, to keep
    the pool full), so the reference is a prefix of it, bit for bit."""
    expected_tokens, expected_logprobs = reference.generate(inner, prompt, max_new_tokens, logprobs=True)
    assert list(result.token_ids[: len(expected_tokens)]) == expected_tokens
    assert list(result.logprobs[: len(expected_tokens)]) == expected_logprobs


def _assert_clean(engine: AsyncEngine) -> None:
    report = audit(engine)
    assert report.is_clean, report
    with engine.locked() as inner:
        inner.cache.clear()  # evict everything: every block must come back
        assert inner.allocator.num_free_blocks == inner.allocator.num_blocks
        inner.check_invariants()


def test_requests_beyond_the_pool_are_preempted_recomputed_and_equal_the_reference(engine):
    prompts = _prompts(1, 8)
    params = SamplingParams(max_new_tokens=100, logprobs=True, ignore_eos=True)
    before = engine.stats["preemptions"]

    async def run():
        return await asyncio.gather(*(engine.generate(p, params) for p in prompts))

    results = asyncio.run(run())
    num_preempted = engine.stats["preemptions"] - before
    print(f"FIGURES kv exhaustion: 8 requests growing to 10-13 blocks each on a 24-block pool: {num_preempted} preemptions")
    assert num_preempted >= 4  # the pool really ran out, often
    with engine.locked() as inner:
        for prompt, result in zip(prompts, results):
            assert len(result.token_ids) == 100
            _assert_matches_reference(inner, prompt, result, 100)  # bit-identical despite recomputation
    _assert_clean(engine)


def test_a_request_larger_than_the_pool_is_rejected_clearly_and_others_are_undisturbed(engine):
    params = SamplingParams(max_new_tokens=8, logprobs=True, ignore_eos=True)
    too_big = tokens(7, 400)  # 26 blocks > 24 in the pool

    async def run():
        running = [asyncio.ensure_future(engine.generate(p, params)) for p in _prompts(2, 3)]
        await asyncio.sleep(0.01)
        with pytest.raises(ValueError, match=r"KV blocks, the pool has 24"):
            await engine.generate(too_big, params)
        return await asyncio.gather(*running)

    results = asyncio.run(run())
    with engine.locked() as inner:
        for prompt, result in zip(_prompts(2, 3), results):
            _assert_matches_reference(inner, prompt, result, 8)
    _assert_clean(engine)


def test_cancellations_during_preemption_thrash_leak_nothing(engine):
    """Streams cut at random points (some while preempted and waiting, some
    mid-decode) while the pool is exhausted; survivors equal the reference."""
    rng = random.Random(3)
    prompts = _prompts(3, 12)
    params = SamplingParams(max_new_tokens=100, logprobs=True, ignore_eos=True)
    cut_after = [rng.choice([None, 0, 1, 5, 40, 80]) for _ in prompts]
    before = engine.stats

    async def one(prompt, cut):
        produced = []
        stream = engine.stream(prompt, params)
        async for item in stream:
            if isinstance(item, GenerationResult):
                return item
            produced.append(item.token_id)
            if cut is not None and len(produced) > cut:
                await stream.aclose()
                return None
        return None

    async def run():
        tasks = [asyncio.ensure_future(one(p, c)) for p, c in zip(prompts, cut_after)]
        await asyncio.sleep(0.05)
        tasks[0].cancel()  # and one task cancelled outright, maybe before its first token
        return await asyncio.gather(*tasks, return_exceptions=True)

    results = asyncio.run(run())
    assert not [r for r in results if isinstance(r, BaseException) and not isinstance(r, asyncio.CancelledError)]
    asyncio.run(engine.wait_idle(30))
    survivors = [(p, r) for p, r in zip(prompts, results) if r is not None and not isinstance(r, BaseException)]
    assert survivors and len(survivors) < len(prompts)
    after = engine.stats
    assert after["preemptions"] > before["preemptions"] and after["num_aborted"] > before["num_aborted"]
    with engine.locked() as inner:
        for prompt, result in survivors:
            _assert_matches_reference(inner, prompt, result, 100)
    _assert_clean(engine)


@pytest.mark.ray
def test_live_pool_exhaustion_preempts_or_rejects_with_400(core_app):
    """The shared app's Workers hold 1024 positions (64 blocks). A prompt whose
    KV exceeds that is a 400 naming the pool; eight concurrent ~400-position
    requests exceed it together and are preempted, answers still bit-identical
    to the same requests run alone."""
    url = core_app.url + "/generate"
    huge = httpx.post(url, json={"prompt_token_ids": tokens(11, 1000), "max_new_tokens": 64}, headers=AUTH,
                      timeout=60, trust_env=False)
    assert huge.status_code == 400, huge.text
    assert "KV blocks, the pool has 64" in huge.json()["error"]["message"]

    def preemptions() -> int:
        stats = httpx.get(core_app.url + "/stats", headers=AUTH, trust_env=False).json()["replicas"]
        return sum(r["preemptions"] for r in stats.values())

    shared = tokens(12, 64)
    bodies = [{"prompt_token_ids": shared + tokens(200 + i, 300), "max_new_tokens": 48, "ignore_eos": True,
               "logprobs": True} for i in range(8)]
    before = preemptions()

    async def burst():
        async with httpx.AsyncClient(trust_env=False, timeout=120, headers=AUTH) as client:
            return await asyncio.gather(*(client.post(url, json=b) for b in bodies))

    crushed = asyncio.run(burst())
    assert [r.status_code for r in crushed] == [200] * 8, [r.text for r in crushed if r.status_code != 200]
    for response, body in zip(crushed[:3], bodies):
        alone = httpx.post(url, json=body, headers=AUTH, timeout=60, trust_env=False).json()
        assert response.json()["logprobs"] == alone["logprobs"]
    deadline = time.time() + 5
    while preemptions() == before and time.time() < deadline:
        time.sleep(0.5)  # stats reach the board every 0.5 s
    assert preemptions() > before
