"""An owner's export that waits for its own prefill of the asked prefix
(``ExportRequest.wait_s``, worker/kv_fetch.py step 3), in process: two real
tiny-llama engines whose prefill takes several steps (16 tokens a step), an
owner forward stalled on purpose so that "still prefilling" is a state the
test holds, not a race it hopes to win."""

from __future__ import annotations

import asyncio
import math
import threading

import pytest

from router.fetch import FetchHint
from tests.worker.test_kv_fetch import GREEDY, OWNER, RECEIVER, Answers, Direct, assert_clean, assert_reference, fetchers
from worker.config import FetchConfig
from worker.kv_fetch import PrefixFetcher
from worker.messages import ExportRequest

CHUNK = 16  # max_batch_tokens: one block of prefill a step


class StallsAt:
    """An engine's model forward whose ``n``-th call waits for ``release``;
    the calls before it run, so their chunks are cached when it stalls.
    ``installed`` lists every one, for the fixture to release after a failed test."""

    installed: list[StallsAt] = []

    def __init__(self, engine, n: int) -> None:
        self.num_calls, self.stall_at = 0, n
        self.entered, self.release = threading.Event(), threading.Event()
        StallsAt.installed.append(self)
        runner = engine.engine.runner
        self._forward, runner.forward = runner.forward, self

    def __call__(self, *args, **kwargs):
        self.num_calls += 1
        if self.num_calls == self.stall_at:
            self.entered.set()
            assert self.release.wait(30), "the test never released the forward"
        return self._forward(*args, **kwargs)


@pytest.fixture
def pair(make_async_engine):
    """(owner engine, receiver engine): same weights, separate caches, a 120-token prefill takes 8 steps."""
    engines = make_async_engine(max_batch_tokens=CHUNK), make_async_engine(max_batch_tokens=CHUNK)
    yield engines
    while StallsAt.installed:  # a failed test's stalled forward must not hold the shutdown
        StallsAt.installed.pop().release.set()
    for engine in engines:
        asyncio.run(engine.shutdown())


def owner_fetcher(engine) -> PrefixFetcher:
    return PrefixFetcher(engine, OWNER, FetchConfig(), Answers(None))


def ask(prompt, wait_s, salt=None) -> ExportRequest:
    """All of ``prompt`` but its last token, as a receiver asks for it."""
    return ExportRequest(OWNER, tuple(prompt[:-1]), salt, len(prompt) - 1, wait_s)


async def stalled_prefill(engine, prompt, stall_at: int = 3, salt=None):
    """``prompt``'s generation, its forward number ``stall_at`` stalled: (the
    task, the gate); ``(stall_at - 1) * CHUNK`` positions are cached by then."""
    gate = StallsAt(engine, stall_at)
    task = asyncio.create_task(engine.generate(prompt, GREEDY, salt=salt))
    assert await asyncio.to_thread(gate.entered.wait, 30)
    return task, gate


async def wait_until(predicate, timeout_s: float = 10.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await asyncio.sleep(0.005)


def num_exported(reply) -> int:
    return 0 if reply.bundle is None else reply.bundle.num_tokens


def test_an_export_waits_for_the_prefill_in_flight_and_sends_the_whole_prefix(pair, tokens):
    owner_engine, _ = pair
    prompt = tokens(120)

    async def main():
        owner = owner_fetcher(owner_engine)
        task, gate = await stalled_prefill(owner_engine, prompt)
        assert await asyncio.to_thread(owner_engine.in_flight_prefix_tokens, prompt[:-1]) == 119
        now = await owner.export(ask(prompt, 0.0))  # wait_s 0: what is cached now, as before
        assert num_exported(now) == 2 * CHUNK and owner.counters.num_export_waits == 0
        waiting = asyncio.create_task(owner.export(ask(prompt, 30.0)))
        await wait_until(lambda: owner.counters.num_export_waits == 1)
        await asyncio.sleep(0.05)
        assert not waiting.done()  # the prefill cannot move: the export keeps waiting for it
        gate.release.set()
        later = await asyncio.wait_for(waiting, 20)
        assert num_exported(later) == 119 and later.bundle.token_ids == tuple(prompt[:-1])
        stats = owner.stats()
        assert stats["fetch_export_waits"] == 1 and 0 < stats["fetch_export_wait_prefill_seconds"] < 20
        assert stats["fetch_exports"] == 2
        return await task

    result = asyncio.run(main())
    assert_reference(result, owner_engine, prompt)  # the waiting export changed nothing of the prefill
    assert_clean(owner_engine)


def test_a_prompt_handed_in_during_a_forward_counts_before_it_is_a_sequence(pair, tokens):
    """A request submitted while the owner's engine is inside a forward waits
    in ``AsyncEngine``'s inbox until the next step begins (on a busy ~125M
    replica, seconds). An export asked then still sees the prefix coming
    and waits for it, rather than answering with what is cached."""
    owner_engine, _ = pair
    other, prompt = tokens(120), tokens(120)

    async def main():
        owner = owner_fetcher(owner_engine)
        task, gate = await stalled_prefill(owner_engine, other)  # the engine thread is inside a forward
        queued = asyncio.create_task(owner_engine.generate(prompt, GREEDY, salt="a"))
        await wait_until(lambda: any(c[0] == "add" for c in tuple(owner_engine._inbox)))
        scheduler = owner_engine.engine.scheduler
        assert all(seq.salt != "a" for seq in (*scheduler.running, *scheduler.waiting))  # not a sequence yet
        assert await asyncio.to_thread(owner_engine.in_flight_prefix_tokens, prompt[:-1], "a") == 119
        assert await asyncio.to_thread(owner_engine.in_flight_prefix_tokens, prompt[:-1], "b") == 0  # its tenant only
        waiting = asyncio.create_task(owner.export(ask(prompt, 30.0, salt="a")))
        await wait_until(lambda: owner.counters.num_export_waits == 1)
        gate.release.set()
        reply = await asyncio.wait_for(waiting, 20)
        assert num_exported(reply) == 119
        await task
        return await queued

    result = asyncio.run(main())
    assert_clean(owner_engine)
    assert result.cached_tokens == 0


def test_an_export_nobody_computes_more_of_returns_at_once_whatever_its_wait(pair, tokens):
    """No wait when the cache holds all of it, nothing of it is cached or
    computed, the sequence in flight is another tenant's, or it shares less
    than a block with the asked prefix: the counters stay 0 (no timing)."""
    owner_engine, _ = pair
    held, computing = tokens(40), tokens(120)

    async def main():
        owner = owner_fetcher(owner_engine)
        await owner_engine.generate(held, GREEDY)
        assert num_exported(await asyncio.wait_for(owner.export(ask(held, 60.0)), 10)) == 39
        assert num_exported(await asyncio.wait_for(owner.export(ask(tokens(40), 60.0)), 10)) == 0
        task, gate = await stalled_prefill(owner_engine, computing, salt="a")
        other_tenant = await asyncio.wait_for(owner.export(ask(computing, 60.0, salt="b")), 10)
        chance = await asyncio.wait_for(owner.export(ask(computing[:CHUNK - 1] + tokens(30), 60.0, salt="a")), 10)
        assert num_exported(other_tenant) == 0 and num_exported(chance) < CHUNK
        assert owner.counters.num_export_waits == 0 and owner.counters.export_wait_prefill_s == 0.0
        gate.release.set()
        await task

    asyncio.run(main())
    assert_clean(owner_engine)


def test_the_wait_ends_at_wait_s_when_the_prefill_is_stalled(pair, tokens):
    owner_engine, _ = pair
    prompt = tokens(120)

    async def main():
        owner = owner_fetcher(owner_engine)
        task, gate = await stalled_prefill(owner_engine, prompt)
        reply = await asyncio.wait_for(owner.export(ask(prompt, 0.2)), 10)
        assert num_exported(reply) == 2 * CHUNK  # what was cached when the wait ran out
        assert owner.counters.num_export_waits == 1 and 0.2 - 1e-6 <= owner.counters.export_wait_prefill_s < 10
        gate.release.set()
        return await task

    result = asyncio.run(main())
    assert_reference(result, owner_engine, prompt)
    assert_clean(owner_engine)


def test_an_abort_ends_the_wait_and_a_cancelled_wait_leaves_nothing_pinned(pair, tokens):
    owner_engine, _ = pair
    prompt = tokens(120)

    async def main():
        owner = owner_fetcher(owner_engine)
        task, gate = await stalled_prefill(owner_engine, prompt)
        cancelled = asyncio.create_task(owner.export(ask(prompt, 60.0)))
        waiting = asyncio.create_task(owner.export(ask(prompt, 60.0)))
        await wait_until(lambda: owner.counters.num_export_waits == 2)
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        task.cancel()  # the request leaves: its abort is queued behind the stalled step
        with pytest.raises(asyncio.CancelledError):
            await task
        gate.release.set()
        reply = await asyncio.wait_for(waiting, 10)  # the abort, not the 60 s, ended the wait
        assert num_exported(reply) == 3 * CHUNK  # the stalled step's chunk was cached, then the abort landed
        assert owner.counters.num_export_waits == 2 and owner.counters.export_wait_prefill_s < 20
        await owner_engine.wait_idle()

    asyncio.run(main())
    assert owner_engine.engine.stats["num_aborted"] == 1
    assert_clean(owner_engine)


def test_a_malformed_wait_is_a_value_error(pair, tokens):
    owner_engine, _ = pair
    prompt = tokens(40)

    async def main():
        owner = owner_fetcher(owner_engine)
        for bad in (-1.0, math.nan, math.inf, True, "1", None):
            with pytest.raises(ValueError, match="wait_s"):
                await owner.export(ask(prompt, bad))
        with pytest.raises(ValueError, match="token"):  # checked before any wait
            await owner.export(ExportRequest(OWNER, (1, -5), None, 2, 1.0))
        assert owner.counters.num_export_waits == 0 and ExportRequest(OWNER, (1,), None, 1).wait_s == 0.0

    asyncio.run(main())


def test_a_fetch_of_a_prefix_the_owner_is_prefilling_gets_all_of_it_and_equals_the_reference(pair, tokens):
    """A group's two requests: the first is prefilling at the owner when the
    second, hinted to the owner, reaches the receiver; the owner waits for
    its prefill and sends the whole shared prefix, and both outputs equal
    the reference's bit for bit."""
    owner_engine, receiver_engine = pair
    shared = tokens(112)
    first, second = shared + [3] * 8, shared + [4] * 8

    async def main():
        transport = Direct(owner_fetcher(owner_engine))
        _, receiver = fetchers(owner_engine, receiver_engine, transport, timeout_s=30.0)
        owner = transport.owner
        task, gate = await stalled_prefill(owner_engine, first)
        fetching = asyncio.create_task(receiver.prepare(second, None, FetchHint(OWNER, 2 * CHUNK)))
        await wait_until(lambda: owner.counters.num_export_waits == 1)
        assert 0 < transport.requests[0].wait_s <= 30.0
        gate.release.set()
        assert await asyncio.wait_for(fetching, 20) == 112  # all the two prompts share, not the 32 cached at the ask
        return await task, await receiver_engine.generate(second, GREEDY)

    first_result, second_result = asyncio.run(main())
    assert second_result.cached_tokens == 112
    assert_reference(first_result, owner_engine, first)
    assert_reference(second_result, receiver_engine, second)
    assert_clean(owner_engine, receiver_engine)


def test_the_receiver_lets_the_owner_wait_no_longer_than_it_would_itself(pair, tokens):
    """``wait_s`` is what is left of the request's patience (its estimated
    recompute time) less the transfer's estimate; without a patience, of
    ``timeout_s`` less the prior overhead while the transfer is unmeasured."""
    owner_engine, receiver_engine = pair
    prompt = tokens(96)

    async def main():
        await receiver_engine.generate(tokens(80), GREEDY)  # measures the receiver's prefill rate
        await owner_engine.generate(prompt, GREEDY)
        patience_s = 1000 * 64 * receiver_engine.prefill_s_per_token  # long enough to outlast the ask's own delay
        transport = Direct(owner_fetcher(owner_engine))
        config = FetchConfig(prior_overhead_s=0.0, patience=1000.0, timeout_s=600.0)
        patient = PrefixFetcher(receiver_engine, RECEIVER, config, transport, bandwidth_bytes_per_s=1e15)
        assert await patient.prepare(prompt, None, FetchHint(OWNER, 64)) == 95
        assert 0 < transport.requests[-1].wait_s <= patience_s < 600  # the patience bounds it, not timeout_s
        _, eager = fetchers(owner_engine, receiver_engine, transport, timeout_s=5.0, prior_overhead_s=0.25)
        assert await eager.prepare(tokens(70), None, FetchHint(OWNER, 64)) == 0  # not held: evicted
        assert transport.requests[-1].wait_s == pytest.approx(5.0 - 0.25, abs=0.05)

    asyncio.run(main())
    assert_clean(owner_engine, receiver_engine)
