"""Fetching a prefix from the replica that holds it (worker/kv_fetch.py), in
process: two real tiny-llama engines, the owner's real export, transports
that hand its reply over directly or fail the ways a Ray call can."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from router.fetch import FetchHint
from worker import SamplingParams, reference
from worker.audit import audit
from worker.config import FetchConfig
from worker.kv_fetch import FALLBACK_REASONS, PrefillRate, PrefixFetcher, TransferModel
from worker.messages import ExportReply, ExportRequest

OWNER, RECEIVER = "owner-replica", "receiver-replica"
GREEDY = SamplingParams(max_new_tokens=6, logprobs=True)


class Direct:
    """The owner's export called in process; records every request."""

    def __init__(self, owner: PrefixFetcher) -> None:
        self.owner = owner
        self.requests = []

    async def fetch(self, request):
        self.requests.append(request)
        return await self.owner.export(request)


class Hangs:
    """An owner that never answers; records whether the call was cancelled."""

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.cancelled = False

    async def fetch(self, request):
        self.started.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            self.cancelled = True
            raise


class Gated(Direct):
    """The owner's export, once ``gate`` is set."""

    def __init__(self, owner: PrefixFetcher) -> None:
        super().__init__(owner)
        self.gate = asyncio.Event()

    async def fetch(self, request):
        self.requests.append(request)
        await self.gate.wait()
        return await self.owner.export(request)


class Fails:
    async def fetch(self, request):
        raise ConnectionError("owner actor died")


class Answers:
    """Replies with a fixed ExportReply (another replica, a forged bundle, ...)."""

    def __init__(self, reply) -> None:
        self.reply = reply

    async def fetch(self, request):
        return self.reply


def fallbacks(fetcher: PrefixFetcher) -> dict:
    return {r: n for r, n in fetcher.counters.fallbacks.items() if n}


def assert_reference(result, engine, prompt) -> None:
    """``result``'s tokens and logprobs are the plain reference server's, bit for bit."""
    expected_tokens, expected_logprobs = reference.generate(engine.engine, prompt, GREEDY.max_new_tokens, logprobs=True)
    assert list(result.token_ids) == expected_tokens and list(result.logprobs) == expected_logprobs


def assert_clean(*engines) -> None:
    for engine in engines:
        report = audit(engine)
        assert report.is_clean, report


@pytest.fixture
def pair(make_async_engine):
    """(owner engine, receiver engine): same weights, separate caches."""
    engines = make_async_engine(), make_async_engine()
    yield engines
    for engine in engines:
        asyncio.run(engine.shutdown())


def fetchers(owner_engine, receiver_engine, transport=None, **config):
    """Owner and receiver fetchers; every hint is fetched (``min_speedup`` 0) unless ``config`` says
    otherwise: these tests are about the mechanics, not the decision (a fresh receiver has timed no
    prefill and would recompute)."""
    config = {"min_speedup": 0.0, **config}
    owner = PrefixFetcher(owner_engine, OWNER, FetchConfig(**config), Answers(None))
    receiver = PrefixFetcher(receiver_engine, RECEIVER, FetchConfig(**config), transport or Direct(owner))
    return owner, receiver


def test_prefill_rate_counts_prefill_heavy_steps_only():
    rate = PrefillRate()
    assert rate.s_per_token is None
    rate.observe_step({"prefill_tokens": 0, "decode_tokens": 0}, {"prefill_tokens": 1, "decode_tokens": 30}, 0.5)
    assert rate.s_per_token is None  # a decode-heavy step
    rate.observe_step({"prefill_tokens": 0, "decode_tokens": 0}, {"prefill_tokens": 90, "decode_tokens": 10}, 0.5)
    assert rate.s_per_token == pytest.approx(0.005)
    rate.observe_step({"prefill_tokens": 90, "decode_tokens": 10}, {"prefill_tokens": 190, "decode_tokens": 10}, 2.0)
    assert rate.s_per_token == pytest.approx(0.005 + 0.3 * (0.02 - 0.005))


def _step(rate: PrefillRate, prefilled: int, seconds: float) -> None:
    rate.observe_step({"prefill_tokens": 0, "decode_tokens": 0}, {"prefill_tokens": prefilled, "decode_tokens": 0},
                      seconds)


def test_prefill_rate_is_the_marginal_cost_once_step_sizes_vary():
    """A step's fixed cost is paid by the request anyway: the rate is the line's slope, not the
    average (a 5-token step averages 4 ms a token where the marginal cost is 0.1 ms)."""
    rate = PrefillRate()
    _step(rate, 5, 0.0205)
    _step(rate, 7, 0.0207)
    assert rate.s_per_token == pytest.approx(0.0205 / 5 + 0.3 * (0.0207 / 7 - 0.0205 / 5))  # sizes alike: EWMA
    _step(rate, 300, 0.05)
    _step(rate, 100, 0.03)
    assert rate.s_per_token == pytest.approx(0.0001, rel=0.01)  # seconds = 0.02 + 0.0001 x tokens
    inverted = PrefillRate()  # a line with a negative intercept says nothing about a fixed cost
    _step(inverted, 10, 0.001)
    _step(inverted, 100, 0.1)
    assert inverted.s_per_token == pytest.approx((0.001 + 0.1) / (10 + 100))


def test_the_transfer_model_learns_overhead_then_fits_a_line():
    model = TransferModel(probe_bytes_per_s=1e9)
    assert model.terms() == (0.0, 1e9) and model.estimate_s(10**9) == pytest.approx(1.0)
    model.observe(10**6, 0.051)  # a small fetch: mostly the call's overhead
    assert model.terms() == pytest.approx((0.05, 1e9))
    model.observe(4 * 10**6, 0.054)  # sizes 4x apart: the line through both
    overhead_s, bandwidth = model.terms()
    assert overhead_s == pytest.approx(0.05) and bandwidth == pytest.approx(1e9)
    assert TransferModel().terms() is None
    unprobed = TransferModel()
    unprobed.observe(10**6, 0.01)
    assert unprobed.terms() == pytest.approx((0.0, 1e8))
    primed = TransferModel(probe_bytes_per_s=1e9, prior_overhead_s=0.05)  # FetchConfig.prior_overhead_s
    assert primed.terms() == (0.05, 1e9)
    primed.observe(10**6, 0.003)  # the first fetch measures the overhead: the prior is gone
    assert primed.terms() == pytest.approx((0.002, 1e9))


def test_fetch_only_when_the_transfer_beats_recomputing(pair, tokens):
    owner_engine, receiver_engine = pair
    prompt = tokens(96)

    async def main():
        await receiver_engine.generate(tokens(80), GREEDY)  # measures the receiver's prefill rate
        s_per_token = receiver_engine.prefill_s_per_token
        assert s_per_token is not None and s_per_token > 0
        await owner_engine.generate(prompt, GREEDY)
        hint = FetchHint(OWNER, 64)
        # moving 64 positions pays exactly when bandwidth > 64 * bytes_per_token / (64 * s_per_token)
        breakeven = receiver_engine.engine.bytes_per_token / s_per_token
        no_prior = FetchConfig(prior_overhead_s=0.0)  # the bandwidth alone decides
        transport = Direct(PrefixFetcher(owner_engine, OWNER, FetchConfig(), Answers(None)))
        slow = PrefixFetcher(receiver_engine, RECEIVER, no_prior, transport, bandwidth_bytes_per_s=breakeven / 2)
        assert not slow.should_fetch(64, 64)
        assert await slow.prepare(prompt, None, hint) == 0
        assert fallbacks(slow) == {"slower": 1} and transport.requests == []
        fast = PrefixFetcher(receiver_engine, RECEIVER, no_prior, transport, bandwidth_bytes_per_s=breakeven * 2)
        assert fast.should_fetch(64, 64) and not fast.should_fetch(64, 16)  # only 16 missing: recompute
        careful = PrefixFetcher(receiver_engine, RECEIVER, FetchConfig(min_speedup=4.0, prior_overhead_s=0.0),
                                transport, bandwidth_bytes_per_s=breakeven * 2)
        eager = PrefixFetcher(receiver_engine, RECEIVER, FetchConfig(min_speedup=0.0), transport,
                              bandwidth_bytes_per_s=breakeven / 100)
        assert not careful.should_fetch(64, 64) and eager.should_fetch(64, 1)
        # A prior overhead (FetchConfig's default 0.05 s until a fetch measures it): positions that
        # recompute in well under it stay local however fast the bandwidth; a prefix that takes longer
        # is fetched. The prior is scaled to this machine's measured rate so the check holds on any CPU.
        prior_s = 4 * 64 * s_per_token
        primed = PrefixFetcher(receiver_engine, RECEIVER, FetchConfig(prior_overhead_s=prior_s), transport,
                               bandwidth_bytes_per_s=breakeven * 2)
        assert not primed.should_fetch(64, 64)
        long = int(4 * prior_s / s_per_token) + 1
        assert primed.should_fetch(long, long)
        # the owner holds the whole prompt: the receiver asks for all of it but the last token, past the hint
        assert await fast.prepare(prompt, None, hint) == 95
        stats = fast.stats()
        assert stats["fetch_count"] == 1 and stats["fetch_tokens"] == 95
        assert stats["fetch_bytes"] == 95 * receiver_engine.engine.bytes_per_token and stats["fetch_seconds"] > 0
        assert fast.transfer.num_samples == 1 and stats["fetch_overhead_s"] >= 0  # the fetch refined the estimate
        assert await fast.prepare(prompt, None, hint) == 0  # held now: the hint is ignored
        assert fast.stats()["fetch_count"] == 1 and fallbacks(fast) == {}
        assert fast.stats()["fetch_hints"] == 2 and fast.stats()["fetch_hints_ignored"] == 1

    asyncio.run(main())
    assert_clean(owner_engine, receiver_engine)


def test_a_receiver_that_has_timed_no_prefill_recomputes_unless_told_to_fetch_every_hint(pair, tokens):
    """Before its first prefill step a replica cannot weigh a transfer against recomputing: it
    recomputes (``unmeasured``) without calling the owner; ``min_speedup`` 0 still fetches."""
    owner_engine, receiver_engine = pair
    prompt = tokens(96)

    async def main():
        await owner_engine.generate(prompt, GREEDY)
        assert receiver_engine.prefill_s_per_token is None
        owner = PrefixFetcher(owner_engine, OWNER, FetchConfig(), Answers(None))
        calls = Direct(owner)
        fresh = PrefixFetcher(receiver_engine, RECEIVER, FetchConfig(), calls, bandwidth_bytes_per_s=1e12)
        assert not fresh.should_fetch(64, 64)
        assert await fresh.prepare(prompt, None, FetchHint(OWNER, 64)) == 0
        assert fallbacks(fresh) == {"unmeasured": 1} and calls.requests == []
        eager = PrefixFetcher(receiver_engine, RECEIVER, FetchConfig(min_speedup=0.0), calls)
        assert await eager.prepare(prompt, None, FetchHint(OWNER, 64)) == 95 and len(calls.requests) == 1
        result = await receiver_engine.generate(tokens(80), GREEDY)  # a prefill step: now it is measured
        assert result.cached_tokens == 0 and receiver_engine.prefill_s_per_token is not None
        assert fresh.should_fetch(10_000, 10_000)  # a long prefix over a fast link pays

    asyncio.run(main())
    assert_clean(owner_engine, receiver_engine)


def test_after_a_fetch_outputs_equal_the_reference_bit_for_bit(pair, tokens):
    owner_engine, receiver_engine = pair
    prompt = tokens(75)  # the hint: 4 blocks of 16; the rest (11 tokens) is computed

    async def main():
        owner, receiver = fetchers(owner_engine, receiver_engine)
        await owner_engine.generate(prompt[:70], GREEDY)
        assert await receiver.prepare(prompt, "tenant", FetchHint(OWNER, 64)) == 0  # owner holds it unsalted only
        assert fallbacks(receiver) == {"evicted": 1}
        await owner_engine.generate(prompt[:70], GREEDY, salt="tenant")
        assert await receiver.prepare(prompt, "tenant", FetchHint(OWNER, 64)) == 70  # all the owner holds
        assert owner.stats()["fetch_exports"] == 1 and owner.stats()["fetch_exported_bytes"] > 0
        result = await receiver_engine.generate(prompt, GREEDY, salt="tenant")
        return result

    result = asyncio.run(main())
    assert result.cached_tokens == 70
    assert_reference(result, receiver_engine, prompt)
    assert_clean(owner_engine, receiver_engine)


def test_a_follow_up_turn_fetches_the_answer_the_owner_generated_past_the_hint(pair, tokens):
    """The router learns the prompts it routes, not the answers: after a
    chat's turn, its owner holds the prompt and the answer it generated,
    while the router's hint for the next turn names the prompt's depth
    only. The receiver asks for the whole follow-up (but its last token)
    and gets both; the outputs stay the reference's, bit for bit."""
    owner_engine, receiver_engine = pair
    turn = tokens(64)

    async def main():
        owner, receiver = fetchers(owner_engine, receiver_engine)
        first = await owner_engine.generate(turn, GREEDY)
        follow_up = turn + list(first.token_ids) + tokens(5)  # the answer, then the next question
        held = owner_engine.cached_prefix_tokens(follow_up)
        assert held > 64  # the owner cached (most of) its answer too
        assert await receiver.prepare(follow_up, None, FetchHint(OWNER, 64)) == held
        return follow_up, held, await receiver_engine.generate(follow_up, GREEDY)

    follow_up, held, result = asyncio.run(main())
    assert result.cached_tokens == held  # all the owner held of it: the prompt and the answer it cached
    assert_reference(result, receiver_engine, follow_up)
    assert_clean(owner_engine, receiver_engine)


def test_a_within_block_hint_fetches_the_partial_block_past_the_receivers_full_blocks(pair, tokens):
    """The router's within-block hint (``router.fetch.within_block_hint``)
    names a token count that is no multiple of a block: the receiver holds
    the prompt's first 64 tokens, the owner served the same prompt, and the
    hint names 64 + 16 (what the router knows the owner shares of the
    partial block). The receiver fetches all the owner holds of it, its last
    token aside, and the output is the reference's, bit for bit."""
    owner_engine, receiver_engine = pair
    prompt = tokens(90)

    async def main():
        _, receiver = fetchers(owner_engine, receiver_engine)
        await owner_engine.generate(prompt, GREEDY)
        await receiver_engine.generate(prompt[:64] + tokens(10), GREEDY)
        assert receiver_engine.cached_prefix_tokens(prompt) == 64
        newly = await receiver.prepare(prompt, None, FetchHint(OWNER, 80))
        assert newly == 89 - 64 and fallbacks(receiver) == {}
        return await receiver_engine.generate(prompt, GREEDY)

    result = asyncio.run(main())
    assert result.cached_tokens == 89
    assert_reference(result, receiver_engine, prompt)
    assert_clean(owner_engine, receiver_engine)


def test_other_weights_are_refused_and_the_request_recomputes(make_async_engine, tokens):
    owner_engine = make_async_engine(tiny_llama={"seed": 1})
    receiver_engine = make_async_engine()
    assert owner_engine.engine.weights_fingerprint != receiver_engine.engine.weights_fingerprint
    twin = make_async_engine()  # shut down below: an engine thread left running into exit can crash it
    assert twin.engine.weights_fingerprint == receiver_engine.engine.weights_fingerprint
    asyncio.run(twin.shutdown())
    prompt = tokens(70)

    async def main():
        _, receiver = fetchers(owner_engine, receiver_engine)
        await owner_engine.generate(prompt, GREEDY)
        assert await receiver.prepare(prompt, None, FetchHint(OWNER, 64)) == 0
        return await receiver_engine.generate(prompt, GREEDY), receiver

    result, receiver = asyncio.run(main())
    assert fallbacks(receiver) == {"rejected": 1} and result.cached_tokens == 0
    assert (list(result.token_ids), list(result.logprobs)) == reference.generate(receiver_engine.engine, prompt, 6, logprobs=True)
    assert_clean(owner_engine, receiver_engine)
    for engine in (owner_engine, receiver_engine):
        asyncio.run(engine.shutdown())


def test_every_owner_failure_falls_back_to_recompute_by_reason(pair, tokens):
    owner_engine, receiver_engine = pair
    prompt = tokens(70)

    async def main():
        await owner_engine.generate(prompt, GREEDY)
        owner = PrefixFetcher(owner_engine, OWNER, FetchConfig(), Answers(None))
        other_tenant = await owner.export(dataclasses.replace(_request(prompt), salt="b"))
        assert other_tenant.bundle is None  # an export reads the asking request's namespace only
        good = (await owner.export(_request(prompt))).bundle
        forged = dataclasses.replace(good, salt="b")  # a bundle for another tenant than the request's
        cases = {
            "owner_gone": Answers(ExportReply("some-other-replica", None)),
            "evicted": Answers(ExportReply(OWNER, None)),
            "owner_failed": Fails(),
            "rejected": Answers(ExportReply(OWNER, forged)),
        }
        longer = dataclasses.replace(good, token_ids=good.token_ids + (5,))  # more than was asked for
        for bad in (longer, "not a bundle"):
            receiver = PrefixFetcher(receiver_engine, RECEIVER, FetchConfig(min_speedup=0.0), Answers(ExportReply(OWNER, bad)))
            assert await receiver.prepare(prompt, None, FetchHint(OWNER, 64)) == 0
            assert fallbacks(receiver) == {"rejected": 1}
        for reason, transport in cases.items():
            receiver = PrefixFetcher(receiver_engine, RECEIVER, FetchConfig(min_speedup=0.0), transport)
            assert await receiver.prepare(prompt, None, FetchHint(OWNER, 64)) == 0
            assert fallbacks(receiver) == {reason: 1}, reason
        hangs = Hangs()
        receiver = PrefixFetcher(receiver_engine, RECEIVER, FetchConfig(timeout_s=0.2, min_speedup=0.0), hangs)
        started = asyncio.get_running_loop().time()
        assert await receiver.prepare(prompt, None, FetchHint(OWNER, 64)) == 0
        assert asyncio.get_running_loop().time() - started < 2.0 and hangs.cancelled
        assert fallbacks(receiver) == {"timeout": 1}
        result = await receiver_engine.generate(prompt, GREEDY)
        assert result.cached_tokens == 0  # recomputed, never failed
        ignored = PrefixFetcher(receiver_engine, OWNER, FetchConfig(), Fails())  # the hint names this replica
        off = PrefixFetcher(receiver_engine, RECEIVER, FetchConfig(enabled=False), Fails())
        for fetcher in (ignored, off):
            assert await fetcher.prepare(tokens(70), None, FetchHint(OWNER, 64)) == 0 and fallbacks(fetcher) == {}
            assert fetcher.stats()["fetch_hints"] == fetcher.stats()["fetch_hints_ignored"] == 1
        assert (await off.export(dataclasses.replace(_request(prompt), target_replica=RECEIVER))).bundle is None

    asyncio.run(main())
    assert set(FALLBACK_REASONS) >= {"owner_gone", "evicted", "owner_failed", "rejected", "timeout", "slower"}
    assert_clean(owner_engine, receiver_engine)


def _request(prompt):
    return ExportRequest(OWNER, tuple(prompt[:64]), None, 64)


def test_a_request_cancelled_mid_fetch_cancels_the_call_and_leaks_nothing(pair, tokens):
    owner_engine, receiver_engine = pair
    prompt = tokens(70)

    async def main():
        hangs = Hangs()
        receiver = PrefixFetcher(receiver_engine, RECEIVER, FetchConfig(timeout_s=30, min_speedup=0.0), hangs)
        task = asyncio.create_task(receiver.prepare(prompt, None, FetchHint(OWNER, 64)))
        await hangs.started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(100):  # the shared fetch is cancelled once its last waiter is
            if hangs.cancelled:
                break
            await asyncio.sleep(0.01)
        assert hangs.cancelled and fallbacks(receiver) == {}
        # cancelled while its import runs: the import completes, consistent, and the next request hits
        await owner_engine.generate(prompt, GREEDY)
        transport = Direct(PrefixFetcher(owner_engine, OWNER, FetchConfig(), Answers(None)))
        receiver = PrefixFetcher(receiver_engine, RECEIVER, FetchConfig(min_speedup=0.0), transport)
        task = asyncio.create_task(receiver.prepare(prompt, None, FetchHint(OWNER, 64)))
        while not transport.requests:
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await receiver_engine.wait_idle()
        return await receiver_engine.generate(prompt, GREEDY)

    result = asyncio.run(main())
    assert result.cached_tokens in (0, 69)  # whether the import had begun when the cancel landed
    assert_clean(owner_engine, receiver_engine)


def test_the_counters_reach_stats_and_metrics_by_reason(make_async_engine):
    from deploy.metrics import IngressMetrics
    from worker.replica_core import ReplicaReporter

    engine = make_async_engine()
    fetcher = PrefixFetcher(engine, RECEIVER, FetchConfig(), Fails())
    fetcher.counters.num_fetches, fetcher.counters.num_fetched_tokens = 2, 128
    fetcher.counters.fallbacks["timeout"] = 3
    fetcher.counters.num_outwaited = 2
    fetcher.counters.num_alternate_asks, fetcher.counters.num_from_alternate = 3, 1
    fetcher.counters.num_export_waits, fetcher.counters.export_wait_prefill_s = 2, 0.25
    stats = ReplicaReporter(engine, RECEIVER, 64, clock=lambda: 0.0, pid=1, extra_stats=fetcher.stats).stats()
    assert set(engine.stats) < set(stats.engine)  # the engine's keys, unchanged, and the fetch ones
    assert stats.engine["fetch_count"] == 2 and stats.engine["fetch_fallback_timeout"] == 3
    text = IngressMetrics().render({RECEIVER: stats}).decode()
    assert f'kvroute_fetched_tokens_total{{replica="{RECEIVER}"}} 128.0' in text
    assert f'kvroute_fetch_fallbacks_total{{reason="timeout",replica="{RECEIVER}"}} 3.0' in text
    assert f'kvroute_fetch_outwaited_total{{replica="{RECEIVER}"}} 2.0' in text
    assert f'kvroute_fetch_alternate_asks_total{{replica="{RECEIVER}"}} 3.0' in text
    assert f'kvroute_fetch_from_alternate_total{{replica="{RECEIVER}"}} 1.0' in text
    assert stats.engine["fetch_export_waits"] == 2 and stats.engine["fetch_export_wait_prefill_seconds"] == 0.25
    assert f'kvroute_fetch_export_waits_total{{replica="{RECEIVER}"}} 2.0' in text
    assert f'kvroute_fetch_export_wait_prefill_seconds_total{{replica="{RECEIVER}"}} 0.25' in text
    assert f'kvroute_fetch_token_cost{{replica="{RECEIVER}"}} 0.0' in text  # no prefill timed yet
    assert stats.engine["fetch_overhead_tokens"] == 0.0
    reasons = {line.split('reason="')[1].split('"')[0] for line in text.splitlines()
               if line.startswith("kvroute_fetch_fallbacks_total{")}
    assert reasons == set(FALLBACK_REASONS)  # a fixed label set
    asyncio.run(engine.shutdown())


def test_requests_hinted_to_a_prefix_in_flight_join_its_fetch(pair, tokens):
    owner_engine, receiver_engine = pair
    prompt = tokens(70)

    async def main():
        await owner_engine.generate(prompt, GREEDY)
        transport = Gated(PrefixFetcher(owner_engine, OWNER, FetchConfig(), Answers(None)))
        receiver = PrefixFetcher(receiver_engine, RECEIVER, FetchConfig(min_speedup=0.0), transport)
        hint = FetchHint(OWNER, 64)
        waiters = [asyncio.create_task(receiver.prepare(prompt[:66] + [i], None, hint)) for i in range(3)]
        while len(transport.requests) < 1 or receiver.counters.num_joined < 2:
            await asyncio.sleep(0.01)
        waiters[0].cancel()  # the one that started it leaves: the others still get it
        transport.gate.set()
        assert await asyncio.gather(*waiters[1:]) == [66, 66]  # what the first asked for: its prompt but the last
        with pytest.raises(asyncio.CancelledError):
            await waiters[0]
        assert len(transport.requests) == 1
        assert receiver.stats()["fetch_count"] == 1 and receiver.stats()["fetch_joined"] == 2
        assert fallbacks(receiver) == {} and receiver._in_flight == {}
        return await receiver_engine.generate(prompt, GREEDY)

    result = asyncio.run(main())
    assert result.cached_tokens == 66
    assert_clean(owner_engine, receiver_engine)


def test_a_request_stops_waiting_for_a_slow_fetch_after_its_recompute_time(pair, tokens):
    owner_engine, receiver_engine = pair
    prompt = tokens(96)

    async def main():
        loop = asyncio.get_running_loop()
        await receiver_engine.generate(tokens(80), GREEDY)  # measures the receiver's prefill rate
        recompute_s = 64 * receiver_engine.prefill_s_per_token
        await owner_engine.generate(prompt, GREEDY)
        transport = Gated(PrefixFetcher(owner_engine, OWNER, FetchConfig(), Answers(None)))
        # no prior overhead and a near-infinite bandwidth: the estimate says fetch; the owner is slow
        receiver = PrefixFetcher(receiver_engine, RECEIVER, FetchConfig(prior_overhead_s=0.0, timeout_s=60.0),
                                 transport, bandwidth_bytes_per_s=1e15)
        assert receiver.should_fetch(64, 64)
        started = loop.time()
        assert await receiver.prepare(prompt, None, FetchHint(OWNER, 64)) == 0  # recompute
        waited = loop.time() - started
        assert 0.5 * recompute_s <= waited < recompute_s + 1.0, (waited, recompute_s)
        assert receiver.stats()["fetch_outwaited"] == 1 and fallbacks(receiver) == {}
        assert len(receiver._in_flight) == 1 and len(transport.requests) == 1  # the fetch runs on
        await asyncio.sleep(2 * recompute_s)  # the owner answers after 3x the recompute time
        recomputed = asyncio.create_task(receiver_engine.generate(prompt, GREEDY))  # the request recomputes
        transport.gate.set()  # and the owner answers at last, while it runs
        while receiver._in_flight:
            await asyncio.sleep(0.01)
        await recomputed
        landed = receiver.stats()["fetch_count"] + receiver.counters.fallbacks["cached_meanwhile"]
        assert landed == 1, (receiver.stats(), fallbacks(receiver))
        assert receiver.transfer.num_samples == receiver.stats()["fetch_count"]
        assert receiver.stats()["fetch_outwaited"] == 1
        if receiver.stats()["fetch_count"]:  # imported before the recompute finished: measured
            assert not receiver.should_fetch(64, 64)  # the overhead alone exceeds recomputing 64
        return (await recomputed), await receiver_engine.generate(prompt, GREEDY)

    recomputed, after = asyncio.run(main())
    assert recomputed.token_ids == after.token_ids  # the late import changed no output
    assert after.cached_tokens >= 64  # the prefix is held (imported or recomputed) and serves the next request
    assert_clean(owner_engine, receiver_engine)


def test_a_hint_whose_owner_computes_the_prefix_waits_prefill_patience(pair, tokens):
    """``FetchHint.owner_computing``: the owner's export waits for its prefill
    in flight, so the request gives the fetch ``prefill_patience`` (3) x its
    recompute time, not ``patience`` (1)."""
    owner_engine, receiver_engine = pair

    async def main():
        await receiver_engine.generate(tokens(80), GREEDY)  # measures the receiver's prefill rate
        receiver = PrefixFetcher(receiver_engine, RECEIVER, FetchConfig(), Answers(None))
        recompute_s = 64 * receiver_engine.prefill_s_per_token
        assert receiver._patience_s(64) == pytest.approx(recompute_s)
        assert receiver._patience_s(64, owner_computing=True) == pytest.approx(3 * recompute_s)
        slow = PrefixFetcher(receiver_engine, RECEIVER, FetchConfig(patience=4.0), Answers(None))
        assert slow._patience_s(64, owner_computing=True) == pytest.approx(4 * recompute_s)  # never shorter

    asyncio.run(main())
    with pytest.raises(ValueError):
        FetchConfig(prefill_patience=-1.0)


def test_patience_0_waits_for_the_fetch(pair, tokens):
    owner_engine, receiver_engine = pair
    prompt = tokens(96)

    async def main():
        await receiver_engine.generate(tokens(80), GREEDY)
        recompute_s = 64 * receiver_engine.prefill_s_per_token
        await owner_engine.generate(prompt, GREEDY)
        transport = Gated(PrefixFetcher(owner_engine, OWNER, FetchConfig(), Answers(None)))
        receiver = PrefixFetcher(receiver_engine, RECEIVER, FetchConfig(prior_overhead_s=0.0, patience=0.0),
                                 transport, bandwidth_bytes_per_s=1e15)
        task = asyncio.create_task(receiver.prepare(prompt, None, FetchHint(OWNER, 64)))
        await asyncio.sleep(3 * recompute_s + 0.05)
        assert not task.done()  # still waiting, as before patience existed
        transport.gate.set()
        assert await task == 95
        assert receiver.stats()["fetch_outwaited"] == 0 and receiver.stats()["fetch_count"] == 1

    asyncio.run(main())
    assert_clean(owner_engine, receiver_engine)


class ComputedFirst:
    """The owner's export, answered only after the receiver has computed the
    same prompt itself (a request of that prefix that did not wait for the fetch)."""

    def __init__(self, owner: PrefixFetcher, receiver_engine, prompt) -> None:
        self.owner, self.receiver_engine, self.prompt = owner, receiver_engine, prompt

    async def fetch(self, request):
        await self.receiver_engine.generate(self.prompt, GREEDY)
        return await self.owner.export(request)


def test_a_prefix_cached_while_its_fetch_ran_is_counted_as_such_not_as_no_room(pair, tokens):
    owner_engine, receiver_engine = pair
    prompt = tokens(70)

    async def main():
        await owner_engine.generate(prompt, GREEDY)
        transport = ComputedFirst(PrefixFetcher(owner_engine, OWNER, FetchConfig(), Answers(None)),
                                  receiver_engine, prompt)
        receiver = PrefixFetcher(receiver_engine, RECEIVER, FetchConfig(min_speedup=0.0), transport)
        assert await receiver.prepare(prompt, None, FetchHint(OWNER, 64)) == 0  # the import had nothing to add
        assert fallbacks(receiver) == {"cached_meanwhile": 1} and receiver.stats()["fetch_count"] == 0
        return await receiver_engine.generate(prompt, GREEDY)

    result = asyncio.run(main())
    assert result.cached_tokens >= 64  # the copy computed meanwhile serves it
    assert_clean(owner_engine, receiver_engine)


class GatedForward:
    """An engine's model forward that, once ``armed``, signals ``entered`` and
    waits for ``release`` (a forward that takes as long as the test wants)."""

    def __init__(self, engine) -> None:
        import threading

        self.armed, self.entered, self.release = threading.Event(), threading.Event(), threading.Event()
        runner = engine.engine.runner
        self._forward = runner.forward
        runner.forward = self

    def __call__(self, *args, **kwargs):
        if self.armed.is_set():
            self.entered.set()
            assert self.release.wait(30), "the test never released the forward"
        return self._forward(*args, **kwargs)


def test_exports_and_imports_run_while_the_engine_is_in_a_forward(pair, tokens):
    """The owner's export and the receiver's import take the cache lock only,
    so neither waits for the step in flight to end (both forwards are held
    until they finished); the request stepping beside the import still
    equals the reference, and the fetched prefix is then a hit."""
    owner_engine, receiver_engine = pair
    prefix, busy_prompt, prompt = tokens(64), tokens(40), None
    prompt = prefix + tokens(11)

    async def main():
        await owner_engine.generate(prefix, GREEDY)
        gates = GatedForward(owner_engine), GatedForward(receiver_engine)
        busy = []
        for gate, engine in zip(gates, pair):
            gate.armed.set()
            busy.append(asyncio.create_task(engine.generate(busy_prompt, GREEDY)))
            assert await asyncio.to_thread(gate.entered.wait, 30)
        bundle = await asyncio.wait_for(asyncio.to_thread(owner_engine.export_prefix, prefix), 10)
        assert bundle is not None and bundle.num_tokens == 64
        assert await asyncio.to_thread(receiver_engine.cached_prefix_tokens, prefix) == 0
        timing = {}
        assert await asyncio.wait_for(asyncio.to_thread(receiver_engine.import_prefix, bundle, timing=timing), 10) == 64
        assert not any(gate.release.is_set() for gate in gates)  # both forwards were still running
        assert set(timing) == {"check_s", "wait_s", "copy_s"}
        for gate in gates:
            gate.armed.clear()
            gate.release.set()
        busy_results = await asyncio.gather(*busy)
        return busy_results, await receiver_engine.generate(prompt, GREEDY)

    busy_results, result = asyncio.run(main())
    for busy_result, engine in zip(busy_results, pair):
        assert list(busy_result.token_ids) == reference.generate(engine.engine, busy_prompt, 6)
    assert result.cached_tokens == 64
    assert_reference(result, receiver_engine, prompt)
    assert_clean(owner_engine, receiver_engine)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_bundle_pickles_its_rows_out_of_band(dtype, make_engine, tokens):
    """Ray pickles a return value with protocol 5 and moves the buffers it is
    handed out of band (no copy into the pickle, read in place on arrival):
    the rows travel that way, and the bundle on the far side checks."""
    import pickle

    import torch

    engine = make_engine(dtype=dtype)
    prompt = tokens(40)
    engine.generate(prompt, 1)
    bundle = engine.export_prefix(prompt)
    buffers = []
    data = pickle.dumps(bundle, protocol=5, buffer_callback=buffers.append)
    assert len(data) < bundle.num_bytes // 4 and sum(b.raw().nbytes for b in buffers) == bundle.num_bytes
    arrived = pickle.loads(data, buffers=buffers)
    assert arrived.rows.dtype == getattr(torch, dtype) and torch.equal(arrived.rows, bundle.rows)
    assert arrived.token_ids == bundle.token_ids and arrived.checksum == bundle.checksum
    engine.check_bundle(arrived)


def test_the_fetch_prices_a_summary_reports_agree_with_the_fetch_decision(pair, tokens):
    """``fetch_prices`` (CacheSummary.fetch_token_cost / fetch_overhead_tokens,
    what the router reads to offer a hot prefix a fetched holder) prices a
    fetch of n tokens at ``n * token_cost + overhead_tokens`` prefill tokens,
    times ``min_speedup``: below n exactly when ``should_fetch(n, n)``; 0.0
    for both until the prefill rate is measured, with fetch off, or when
    every hint is fetched."""
    _, receiver_engine = pair
    transport = Answers(None)
    unmeasured = PrefixFetcher(receiver_engine, RECEIVER, FetchConfig(), transport, bandwidth_bytes_per_s=1e8)
    assert unmeasured.fetch_prices() == {"fetch_token_cost": 0.0, "fetch_overhead_tokens": 0.0}

    async def main():
        await receiver_engine.generate(tokens(80), GREEDY)  # measures the prefill rate
        s_per_token = receiver_engine.prefill_s_per_token
        breakeven = receiver_engine.engine.bytes_per_token / s_per_token
        for bandwidth, overhead_s, speedup in ((breakeven * 2, 0.0, 1.0), (breakeven / 2, 0.0, 1.0),
                                               (breakeven * 4, 30 * s_per_token, 1.0),
                                               (breakeven * 4, 30 * s_per_token, 3.0)):
            fetcher = PrefixFetcher(receiver_engine, RECEIVER,
                                    FetchConfig(prior_overhead_s=overhead_s, min_speedup=speedup), transport,
                                    bandwidth_bytes_per_s=bandwidth)
            prices = fetcher.fetch_prices()
            # rounded to 3 significant digits for the wire (cache.summary.rounded_rate)
            assert prices["fetch_token_cost"] == pytest.approx(breakeven / bandwidth * speedup, rel=5e-3)
            assert prices["fetch_overhead_tokens"] == pytest.approx(overhead_s / s_per_token * speedup, rel=5e-3)
            for n in (8, 64, 512):
                cost = n * prices["fetch_token_cost"] + prices["fetch_overhead_tokens"]
                if abs(cost - n) > 1e-2 * n:  # off the break-even point
                    assert (cost < n) == fetcher.should_fetch(n, n), (bandwidth, overhead_s, speedup, n)
        for config in (FetchConfig(enabled=False), FetchConfig(min_speedup=0.0)):
            fetcher = PrefixFetcher(receiver_engine, RECEIVER, config, transport, bandwidth_bytes_per_s=1e8)
            assert fetcher.fetch_prices() == {"fetch_token_cost": 0.0, "fetch_overhead_tokens": 0.0}

    asyncio.run(main())


class ByTarget:
    """Each ``target_replica``'s transport; records who was asked, in order."""

    def __init__(self, **transports) -> None:
        self.transports = transports
        self.asked = []

    async def fetch(self, request):
        self.asked.append(request.target_replica)
        return await self.transports[request.target_replica].fetch(request)


def test_an_owner_that_evicted_the_prefix_hands_over_to_the_alternates_in_turn(pair, tokens):
    """The router's index lags evictions: the hint's owner may have evicted
    what a second holder still has. The receiver asks the alternates in
    order, imports from the first that sends a bundle, and counts it; when
    every replica named fails it recomputes, counted once by the last
    reason; a timeout ends the asking (it spent what a second ask needs)."""
    owner_engine, receiver_engine = pair
    prompt = tokens(70)

    async def main():
        await owner_engine.generate(prompt, GREEDY)
        holder = PrefixFetcher(owner_engine, "holder", FetchConfig(), Answers(None))
        transport = ByTarget(gone=Answers(ExportReply("gone", None)), failed=Fails(), holder=Direct(holder))
        receiver = PrefixFetcher(receiver_engine, RECEIVER, FetchConfig(min_speedup=0.0), transport)
        hint = FetchHint("gone", 64, ("failed", "holder"))
        assert await receiver.prepare(prompt, None, hint) == 69
        assert transport.asked == ["gone", "failed", "holder"] and fallbacks(receiver) == {}
        stats = receiver.stats()
        assert (stats["fetch_count"], stats["fetch_alternate_asks"], stats["fetch_from_alternate"]) == (1, 2, 1)
        fetched = await receiver_engine.generate(prompt, GREEDY)

        evicted = ByTarget(a=Answers(ExportReply("a", None)), b=Answers(ExportReply("b", None)))
        other = PrefixFetcher(receiver_engine, "other", FetchConfig(min_speedup=0.0), evicted)
        assert await other.prepare(tokens(70), None, FetchHint("a", 64, ("b",))) == 0
        assert evicted.asked == ["a", "b"] and fallbacks(other) == {"evicted": 1}
        assert other.stats()["fetch_from_alternate"] == 0 and other.stats()["fetch_alternate_asks"] == 1

        slow = ByTarget(a=Hangs(), b=Direct(holder))
        patient = PrefixFetcher(receiver_engine, "third", FetchConfig(min_speedup=0.0, timeout_s=0.2), slow)
        assert await patient.prepare(tokens(70), None, FetchHint("a", 64, ("b",))) == 0
        assert slow.asked == ["a"] and fallbacks(patient) == {"timeout": 1}

        itself = PrefixFetcher(receiver_engine, "b", FetchConfig(min_speedup=0.0), ByTarget(a=Answers(ExportReply("a", None))))
        assert await itself.prepare(tokens(70), None, FetchHint("a", 64, ("b",))) == 0  # never asks itself
        assert fallbacks(itself) == {"evicted": 1} and itself.stats()["fetch_alternate_asks"] == 0
        return fetched

    result = asyncio.run(main())
    assert result.cached_tokens == 69
    assert_reference(result, receiver_engine, prompt)
    assert_clean(owner_engine, receiver_engine)
