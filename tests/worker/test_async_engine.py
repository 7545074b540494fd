"""The asyncio interface: many concurrent callers, streaming, cancellation,
overload, shutdown. Each test runs its own event loop."""

import asyncio
import random
import threading
import time

import pytest

from cache.summary import cached_block_hashes
from worker import EngineOverloaded, GenerationResult, SamplingParams, TokenEvent, reference

def prompts(seed: int, count: int, shared: int = 40):
    rng = random.Random(seed)
    system = [rng.randrange(3, 259) for _ in range(shared)]
    return [system + [rng.randrange(3, 259) for _ in range(rng.randrange(1, 20))] for _ in range(count)]


def test_many_concurrent_callers_get_the_plain_servers_outputs(make_async_engine):
    async def main():
        engine = make_async_engine(max_batch_tokens=64, max_num_seqs=8)
        batch = prompts(0, 40)
        params = SamplingParams(max_new_tokens=6, logprobs=True)
        results = await asyncio.gather(*(engine.generate(p, params) for p in batch))
        for prompt, result in zip(batch, results):
            assert isinstance(result, GenerationResult)
            assert (list(result.token_ids), list(result.logprobs)) == reference.generate(engine.engine, prompt, 6, logprobs=True)
        stats = engine.stats
        assert stats["hits"] >= 30 and stats["num_finished"] == 40
        engine.check_invariants()
        await engine.shutdown()

    asyncio.run(main())


def test_stream_yields_tokens_then_the_result(make_async_engine):
    async def main():
        engine = make_async_engine()
        prompt = prompts(1, 1)[0]
        items = [item async for item in engine.stream(prompt, SamplingParams(max_new_tokens=5), request_id="s1")]
        *events, result = items
        assert all(isinstance(e, TokenEvent) and e.request_id == "s1" and e.logprob is None for e in events)
        assert [e.index for e in events] == [0, 1, 2, 3, 4] and events[-1].result == result
        assert isinstance(result, GenerationResult) and result.done
        assert tuple(e.token_id for e in events) == result.token_ids
        assert list(result.token_ids) == reference.generate(engine.engine, prompt, 5)
        assert events[0].to_dict() == {"request_id": "s1", "token_id": events[0].token_id, "logprob": None, "index": 0}
        await engine.shutdown()

    asyncio.run(main())


def test_stream_chunks_carry_the_streams_items_spaced_by_the_interval(make_async_engine):
    """Lists of the per-token stream's items, in order, never empty; the first
    token comes alone and at once; after it, at most one list per interval,
    so with the engine faster than the interval tokens arrive several a list."""
    async def main():
        engine = make_async_engine()
        prompt = prompts(1, 1)[0]
        params = SamplingParams(max_new_tokens=40, ignore_eos=True)
        plain = [item async for item in engine.stream(prompt, params, request_id="p")]
        for interval_s in (0.0, 0.1):
            loop = asyncio.get_running_loop()
            chunks, times = [], []
            async for chunk in engine.stream_chunks(prompt, params, request_id=f"c{interval_s}", interval_s=interval_s):
                chunks.append(chunk)
                times.append(loop.time())
            items = [item for chunk in chunks for item in chunk]
            assert all(chunks) and isinstance(items[-1], GenerationResult) and items[-1].done
            assert [(e.index, e.token_id) for e in items[:-1]] == [(e.index, e.token_id) for e in plain[:-1]]
            assert items[-1].token_ids == plain[-1].token_ids
            assert len(chunks[0]) == 1 and chunks[0][0].index == 0
            if interval_s:
                gaps = [later - earlier for earlier, later in zip(times[1:], times[2:])]
                assert all(gap >= interval_s * 0.9 for gap in gaps[:-1]), gaps  # the result may come sooner
                assert len(chunks) < len(items) / 2  # 40 tokens at a few ms each: many per list
        await engine.shutdown()

    asyncio.run(main())


def test_stream_chunks_send_the_result_without_waiting_out_the_interval(make_async_engine):
    async def main():
        engine = make_async_engine()
        started = time.monotonic()
        chunks = [c async for c in engine.stream_chunks(prompts(5, 1)[0], SamplingParams(max_new_tokens=4, ignore_eos=True),
                                                         interval_s=30.0)]
        assert time.monotonic() - started < 10.0  # not the 30-s interval
        assert [len(c) for c in chunks] == [1, 4]  # the first token at once; the rest with the result
        with pytest.raises(ValueError, match="interval_s"):
            [c async for c in engine.stream_chunks([5, 6], interval_s=-1.0)]
        await engine.shutdown()

    asyncio.run(main())


def test_closing_a_chunk_stream_mid_interval_aborts_the_request(make_async_engine):
    async def main():
        engine = make_async_engine()
        chunks = engine.stream_chunks(prompts(6, 1)[0], SamplingParams(max_new_tokens=500, ignore_eos=True),
                                      request_id="gone", interval_s=30.0)
        first = await chunks.__anext__()
        waiting = asyncio.ensure_future(chunks.__anext__())  # held for the interval
        await asyncio.sleep(0.05)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await chunks.aclose()
        await engine.wait_idle()
        engine.check_invariants()
        assert first[0].index == 0 and engine.stats["num_aborted"] == 1
        assert engine.load()["num_running"] == 0
        await engine.shutdown()

    asyncio.run(main())


def test_a_failure_after_tokens_comes_after_them_in_chunks(make_async_engine):
    async def main():
        engine = make_async_engine(max_num_seqs=1, max_batch_tokens=16)
        seen = []
        async def read():
            async for chunk in engine.stream_chunks(prompts(7, 1)[0], SamplingParams(max_new_tokens=400, ignore_eos=True),
                                                    interval_s=0.05):
                seen.extend(chunk)
        reader = asyncio.ensure_future(read())
        deadline = time.monotonic() + 30
        while len(seen) < 3:
            assert time.monotonic() < deadline, "no tokens"
            await asyncio.sleep(0.005)
        await engine.shutdown()
        with pytest.raises(RuntimeError, match="shut down"):
            await reader
        assert [e.index for e in seen] == list(range(len(seen)))  # every token before the failure, in order

    asyncio.run(main())


def test_cancellation_leaks_no_blocks_and_disturbs_nobody(make_async_engine):
    async def main():
        engine = make_async_engine(max_batch_tokens=32, max_num_seqs=6)
        rng = random.Random(2)
        batch = prompts(2, 24)
        params = SamplingParams(max_new_tokens=30, ignore_eos=True)
        tasks = [asyncio.create_task(engine.generate(p, params)) for p in batch]
        streams = [engine.stream(p, params) for p in batch[:6]]

        async def read_some(stream, count):
            seen = 0
            async for _ in stream:
                seen += 1
                if seen == count:
                    break
            await stream.aclose()

        readers = [asyncio.create_task(read_some(s, rng.randrange(1, 10))) for s in streams]
        await asyncio.sleep(0.05)
        cancelled = set(rng.sample(range(len(tasks)), 12))
        for index in cancelled:
            tasks[index].cancel()
            await asyncio.sleep(rng.random() * 0.01)
        outcomes = await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*readers)
        await engine.wait_idle()
        engine.check_invariants()
        for index, (prompt, outcome) in enumerate(zip(batch, outcomes)):
            if isinstance(outcome, asyncio.CancelledError):
                assert index in cancelled
                continue
            assert list(outcome.token_ids)[:5] == reference.generate(engine.engine, prompt, 5)
        with engine.locked() as inner:
            assert inner.stats["num_running"] == 0 and inner.stats["num_waiting"] == 0
            inner.cache.clear()
            assert inner.allocator.num_free_blocks == inner.allocator.num_blocks
        assert engine.stats["num_aborted"] >= 1
        await engine.shutdown()

    asyncio.run(main())


def test_bounded_queue_raises_engine_overloaded(make_async_engine):
    async def main():
        engine = make_async_engine(max_queued_requests=3, max_num_seqs=1, max_batch_tokens=16)
        params = SamplingParams(max_new_tokens=20, ignore_eos=True)
        accepted, rejected = [], 0
        for prompt in prompts(3, 8):
            try:
                accepted.append(asyncio.ensure_future(engine.generate(prompt, params)))
                await asyncio.sleep(0)
            except EngineOverloaded:
                rejected += 1
        results = await asyncio.gather(*accepted, return_exceptions=True)
        overloaded = [r for r in results if isinstance(r, EngineOverloaded)]
        finished = [r for r in results if isinstance(r, GenerationResult)]
        assert len(overloaded) + rejected >= 4 and len(finished) >= 3
        assert all(len(r.token_ids) == 20 for r in finished)
        await engine.shutdown()

    asyncio.run(main())


def test_bad_input_raises_before_queueing(make_async_engine):
    async def main():
        engine = make_async_engine()
        for bad in ([], [5, 400], [5] * 2000):
            with pytest.raises(ValueError):
                await engine.generate(bad, SamplingParams(max_new_tokens=4))
            with pytest.raises(ValueError):
                engine.validate(bad, SamplingParams(max_new_tokens=4))
        with pytest.raises(ValueError, match="in flight"):
            first = asyncio.ensure_future(engine.generate([5, 6], request_id="dup"))
            await asyncio.sleep(0)
            await engine.generate([5, 6], request_id="dup")
        await first
        assert engine.load()["num_waiting"] == 0 and engine.stats["num_finished"] == 1
        await engine.shutdown()

    asyncio.run(main())


def test_shutdown_fails_what_is_in_flight_and_refuses_new_work(make_async_engine):
    async def main():
        engine = make_async_engine(max_num_seqs=1, max_batch_tokens=16)
        tasks = [asyncio.ensure_future(engine.generate(p, SamplingParams(max_new_tokens=200, ignore_eos=True))) for p in prompts(4, 3)]
        deadline = time.monotonic() + 30
        while engine.load()["num_running"] == 0:  # shut down only once a request is running
            assert time.monotonic() < deadline, "no request started"
            await asyncio.sleep(0.005)
        await engine.shutdown()
        outcomes = await asyncio.gather(*tasks, return_exceptions=True)
        assert all(isinstance(o, RuntimeError) for o in outcomes)
        with pytest.raises(RuntimeError):
            await engine.generate([5, 6])
        with pytest.raises(RuntimeError):
            engine.check_health()

    asyncio.run(main())


def test_callers_on_several_event_loops(make_async_engine):
    engine = make_async_engine()
    outputs = {}

    def worker(index):
        async def main():
            batch = prompts(10 + index, 4)
            results = await asyncio.gather(*(engine.generate(p, SamplingParams(max_new_tokens=4)) for p in batch))
            outputs[index] = [(p, list(r.token_ids)) for p, r in zip(batch, results)]

        asyncio.run(main())

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert sorted(outputs) == [0, 1, 2]
    for pairs in outputs.values():
        for prompt, token_ids in pairs:
            assert token_ids == reference.generate(engine.engine, prompt, 4)
    engine.check_health()
    asyncio.run(engine.shutdown())



def test_a_summary_taken_mid_prefill_reports_what_the_chunked_prefill_has_left(make_async_engine):
    """``num_prefilling_tokens``: a 600-token prompt prefilled 16 tokens a
    step is seen, between steps, with part of its prompt still to compute;
    the count only falls, and reads 0 once the request is done."""
    async def main():
        engine = make_async_engine(max_batch_tokens=16, max_num_seqs=1)
        prompt = prompts(5, 1, shared=600)[0]
        task = asyncio.ensure_future(engine.generate(prompt, SamplingParams(max_new_tokens=2)))
        seen = []
        while not task.done():
            summary = engine.cache_summary(16, replica_id="r1", version=len(seen) + 1, timestamp_s=0.0)
            if summary.num_prefilling_tokens:
                seen.append(summary.num_prefilling_tokens)
            await asyncio.sleep(0.001)
        await task
        assert seen and 0 < min(seen) <= max(seen) < len(prompt)
        assert seen == sorted(seen, reverse=True)  # what is left only falls
        assert engine.cache_summary(16, replica_id="r1", version=10**6, timestamp_s=0.0).num_prefilling_tokens == 0
        await engine.shutdown()

    asyncio.run(main())

def test_stats_load_model_info_and_cache_summary(make_async_engine):
    async def main():
        engine = make_async_engine()
        assert engine.model_info() == {
            "model_id": "tiny-llama", "vocab_size": 259, "max_model_len": 1024, "eos_token_id": 1,
            "eos_token_ids": [1], "block_size": 16, "deterministic": True,
        }
        prompt = prompts(5, 1, shared=50)[0]
        assert engine.cache_summary(16, replica_id="r1", version=1, timestamp_s=0.0).busy_s_total == 0.0
        started = time.perf_counter()
        finished = await engine.generate(prompt, SamplingParams(max_new_tokens=3))
        await engine.wait_idle()
        wall_s = time.perf_counter() - started
        load = engine.load()
        assert set(load) == {"num_running", "num_waiting", "queued_tokens", "running_tokens", "kv_blocks_free"}
        stats = engine.stats
        for key in ("hits", "misses", "tokens_saved", "prefill_tokens", "decode_tokens", "preemptions",
                    "kv_blocks_free", "kv_blocks_total", "cache_num_tokens", "num_running", "num_waiting"):
            assert key in stats
        assert "cached_tokens" not in stats
        assert stats["attention_path"] == engine.engine.runner.attention_path in ("native", "tiled", "torch")
        assert stats["forward_path"] == engine.engine.runner.forward_path in ("lean", "transformers")
        assert stats["prefill_tokens"] == len(prompt) and stats["misses"] == 1
        hashes = engine.cache_block_hashes(16)
        assert hashes == cached_block_hashes(engine.cache, 16) and len(hashes) == (len(prompt) + 2) // 16
        summary = engine.cache_summary(16, replica_id="r1", version=3, timestamp_s=1.5)
        assert summary.block_hashes == frozenset(hashes) and summary.num_cached_tokens == engine.cache.num_tokens
        assert (summary.replica_id, summary.version, summary.num_running, summary.num_waiting) == ("r1", 3, 0, 0)
        assert 0.0 < summary.busy_s_total <= wall_s + 1e-3  # its steps' time, to the millisecond
        assert summary.num_prefilling_tokens == 0  # idle
        assert summary.output_quantiles == (len(finished.token_ids),) * 16  # its finished outputs' tail
        await asyncio.sleep(0.05)  # idle time is not busy
        assert engine.cache_summary(16, replica_id="r1", version=4, timestamp_s=2.0).busy_s_total == \
            summary.busy_s_total
        assert engine.vocab_size == 259 and engine.max_model_len == 1024 and engine.model_id == "tiny-llama"
        assert engine.tokenizer.decode(engine.tokenizer.encode("ok")) == "ok"
        await engine.shutdown()

    asyncio.run(main())


def test_cache_summary_carries_the_token_costs_its_steps_measure(make_async_engine):
    """Rounds of 1-4 concurrent requests, prompts of 16-200 tokens, 8-24 output
    tokens each: prefill steps of sizes far apart (a lone short prompt, then
    several prompts packed into one step) and decode-only steps of 1-4
    sequences, enough of both for :class:`worker.step_costs.StepCosts` to fit
    (it needs 8 of each, the prefill sizes at least 2x apart).

    A lone decode step costs the step's fixed cost (~2 ms on this model, on
    CPU) plus one sequence's row, some hundred prefill tokens' time; the
    queue price is that row alone. On CPU a row is some tens of µs against
    step-time noise of that size or more (a shared machine), so the fit can
    clamp it to 0 (NNLS): only ``>= 0`` is asserted for it."""
    async def main():
        engine = make_async_engine()
        assert engine.token_costs() == (0.0, 0.0)  # nothing timed yet: not measured
        rng = random.Random(7)
        for prompt_lengths in ((24,), (60, 150), (16, 90, 200), (40, 120, 180, 70), (200, 30, 100, 160),
                               (50, 190, 80, 140)):  # a lone 24-token step, steps of up to 256: sizes > 2x apart
            batch = [([rng.randrange(3, 259) for _ in range(length)],
                      SamplingParams(max_new_tokens=rng.randrange(8, 25), ignore_eos=True)) for length in prompt_lengths]
            await asyncio.gather(*(engine.generate(prompt, params) for prompt, params in batch))
        summary = engine.cache_summary(16, replica_id="r1", version=1, timestamp_s=0.0)
        assert (summary.decode_token_cost, summary.queue_token_cost) == engine.token_costs()  # idle: no step since
        assert summary.decode_token_cost > summary.queue_token_cost >= 0
        assert summary.decode_token_cost > 10  # the fixed cost alone is worth far more than 10 prefill tokens
        await engine.shutdown()

    asyncio.run(main())
