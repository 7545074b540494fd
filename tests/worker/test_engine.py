"""The engine's contract on the issue's seed scenarios, with exact prefill ceilings."""

import dataclasses

import pytest

from worker import EngineConfig, SamplingParams, reference


def prefilled(engine, fn):
    """Run ``fn()``; return (its result, tokens prefilled meanwhile)."""
    before = engine.stats["prefill_tokens"]
    result = fn()
    return result, engine.stats["prefill_tokens"] - before


def test_same_prompt_twice_prefills_one_token_the_second_time(make_engine, tokens):
    engine = make_engine()
    prompt = tokens(50)
    first, cost1 = prefilled(engine, lambda: engine.generate(prompt, 8, logprobs=True))
    second, cost2 = prefilled(engine, lambda: engine.generate(prompt, 8, logprobs=True))
    assert (cost1, cost2) == (50, 1)
    assert first == second == reference.generate(engine, prompt, 8, logprobs=True)
    stats = engine.stats
    assert (stats["hits"], stats["misses"], stats["tokens_saved"]) == (1, 1, 49)
    assert "cached_tokens" not in stats  # a per-request figure, never a second name for tokens_saved
    assert isinstance(type(engine).stats, property)
    engine.check_invariants()


def test_cached_prompt_plus_suffix_prefills_at_most_the_suffix(make_engine, tokens):
    engine = make_engine()
    prompt, suffix = tokens(40), tokens(7)
    engine.generate(prompt, 4)
    _, cost = prefilled(engine, lambda: engine.generate(prompt + suffix, 4))
    assert cost <= len(suffix)


def test_shared_system_prompt_plus_new_question_prefills_at_most_the_question(make_engine, tokens):
    engine = make_engine()
    system = tokens(45)
    engine.generate(system + tokens(9), 4)
    question = tokens(11)
    out, cost = prefilled(engine, lambda: engine.generate(system + question, 4, logprobs=True))
    assert cost <= len(question)
    assert out == reference.generate(engine, system + question, 4, logprobs=True)


def test_budget_evicts_exactly_in_lru_order(make_engine, rng):
    engine = make_engine(cache_budget_tokens=64, kv_pool_tokens=1024)
    a, b, c, d, e = ([first] + [rng.randrange(3, 259) for _ in range(19)] for first in (10, 20, 30, 40, 50))

    def cached(prompt):
        return engine.cache.match(prompt, touch=False).num_tokens

    for prompt in (a, b, c):
        engine.generate(prompt, 1)  # caches the 20-token prompt (the sampled token has no KV yet)
    assert [cached(p) for p in (a, b, c)] == [20, 20, 20] and engine.cache.num_tokens == 60
    engine.generate(a, 1)  # touch a: b is now the least recently used
    engine.generate(d, 1)
    assert [cached(p) for p in (a, b, c, d)] == [20, 0, 20, 20]
    engine.generate(e, 1)
    assert [cached(p) for p in (a, b, c, d, e)] == [20, 0, 0, 20, 20]
    engine.check_invariants()


def test_a_reused_system_prompt_outlives_a_burst_of_one_off_prompts(make_engine, tokens):
    """Segmented LRU (the default ``cache_protected_share``): a prefix a request reused is evicted only after
    every entry cached once; plain LRU (0) lets newer one-off prompts push it out."""
    for share, expected_saved in ((EngineConfig().cache_protected_share, 48), (0.0, 0)):
        engine = make_engine(cache_budget_tokens=128, kv_pool_tokens=1024, cache_protected_share=share)
        system = tokens(48)
        engine.generate(system + tokens(8), 1)
        engine.generate(system + tokens(8), 1)  # reuses the system prompt
        for _ in range(6):
            engine.generate(tokens(40), 1)  # 240 tokens of one-off prompts through a 128-token budget
        prompt = system + tokens(8)
        saved_before = engine.stats["tokens_saved"]
        out = engine.generate(prompt, 4, logprobs=True)
        assert engine.stats["tokens_saved"] - saved_before == expected_saved
        assert engine.stats["cache_protected_tokens"] == (48 if share else 0)
        assert out == reference.generate(engine, prompt, 4, logprobs=True)
        engine.check_invariants()


def test_prompt_longer_than_the_budget_is_not_cached_and_flushes_nothing(make_engine, tokens):
    engine = make_engine(cache_budget_tokens=64, kv_pool_tokens=1024, max_batch_tokens=32)
    small = tokens(20)
    engine.generate(small, 1)
    long_prompt = tokens(100)
    out = engine.generate(long_prompt, 3)  # prefilled in 32-token chunks
    assert engine.cache.match(small, touch=False).num_tokens == 20
    assert engine.cache.match(long_prompt, touch=False).num_tokens == 0
    assert engine.cache.num_tokens == 20
    assert out == reference.generate(engine, long_prompt, 3)


def test_same_prompt_after_long_decodes_gives_the_same_output(make_engine, tokens):
    engine = make_engine()
    prompt = tokens(30)
    first = engine.generate(prompt, 300, logprobs=True)
    others = engine.generate_batch([prompt + tokens(5), prompt], 200)  # decode over the cached prompt
    second = engine.generate(prompt, 300, logprobs=True)
    assert first == second == reference.generate(engine, prompt, 300, logprobs=True)
    assert others[1] == first[0][: len(others[1])]
    # continuing from a prefix of its own output reuses the cached decode KV and agrees bit for bit
    tokens_out, logprobs_out = first
    k = len(tokens_out) // 2
    rest = engine.generate(prompt + tokens_out[:k], len(tokens_out) - k, logprobs=True)
    assert rest == (tokens_out[k:], logprobs_out[k:])
    assert engine.stats["cow_copies"] > 0
    engine.check_invariants()


def test_multi_turn_conversation_hits_the_previous_turn(make_engine, tokens):
    engine = make_engine()
    turn1 = tokens(25)
    answer1 = engine.generate(turn1, 12)
    turn2 = turn1 + answer1 + tokens(6)
    request_id = engine.add_request(turn2, SamplingParams(max_new_tokens=5))
    result = engine.run([request_id])[request_id]
    assert result.cached_tokens == len(turn1) + len(answer1) - 1  # the last answer token had no KV yet
    assert list(result.token_ids) == reference.generate(engine, turn2, 5)


def test_different_salts_never_share(make_engine, tokens):
    engine = make_engine()
    prompt = tokens(40)

    def cached(salt):
        request_id = engine.add_request(prompt, SamplingParams(max_new_tokens=2), salt=salt)
        return engine.run([request_id])[request_id].cached_tokens

    assert [cached("a"), cached("b"), cached("a"), cached(None), cached("b")] == [0, 0, 39, 0, 39]


def test_batch_results_in_input_order_equal_single_requests(make_engine, tokens):
    engine = make_engine(max_batch_tokens=64)
    system = tokens(70)
    prompts = [system + tokens(3 + i) for i in range(5)] + [tokens(9)]
    batch = engine.generate_batch(prompts, 6, logprobs=True)
    for prompt, out in zip(prompts, batch):
        assert out == reference.generate(engine, prompt, 6, logprobs=True)


def test_inflight_sharing_computes_a_common_prefix_once(make_engine, tokens):
    for max_batch_tokens in (512, 48):
        engine = make_engine(max_batch_tokens=max_batch_tokens)
        system = tokens(100)
        questions = [tokens(10 + i) for i in range(6)]
        _, cost = prefilled(engine, lambda: engine.generate_batch([system + q for q in questions], 3))
        assert cost == len(system) + sum(map(len, questions)), max_batch_tokens
        assert engine.stats["hits"] == 5


def test_stop_tokens_and_eos(make_engine, tokens):
    engine = make_engine()
    prompt = tokens(20)
    free = engine.generate(prompt, 10)
    stop = free[3]
    first = free.index(stop)

    def run(**kwargs):
        request_id = engine.add_request(prompt, SamplingParams(max_new_tokens=10, **kwargs))
        return engine.run([request_id])[request_id]

    stopped = run(stop_token_ids=(stop,))
    assert list(stopped.token_ids) == free[: first + 1] and stopped.finish_reason == "stop"
    engine.scheduler.eos_token_ids = frozenset({stop})  # pretend the model's EOS is that token
    assert list(run().token_ids) == free[: first + 1]
    ignoring = run(ignore_eos=True)
    assert list(ignoring.token_ids) == free and ignoring.finish_reason == "length"


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ([], SamplingParams(), "empty"),
        ([5, 259], SamplingParams(), "token 1"),
        ([5, -1], SamplingParams(), "token 1"),
        ([5, True], SamplingParams(), "token 1"),
        ([5, 6.0], SamplingParams(), "token 1"),
        ("hello", SamplingParams(), "list of ints"),
        ([5] * 1000, SamplingParams(max_new_tokens=30), "max_model_len"),
        ([5], SamplingParams(stop_token_ids=(300,)), "stop token"),
        ([5], {"max_new_tokens": 3}, "SamplingParams"),
    ],
)
def test_bad_input_raises_value_error_before_anything_is_queued(make_engine, prompt, params, message):
    engine = make_engine()
    with pytest.raises(ValueError, match=message):
        engine.add_request(prompt, params)
    assert not engine.has_work() and engine.stats["num_waiting"] == 0


def test_other_bad_requests(make_engine):
    engine = make_engine()
    engine.add_request([5, 6], SamplingParams(max_new_tokens=2), request_id="x")
    with pytest.raises(ValueError, match="already in flight"):
        engine.add_request([5, 6], request_id="x")
    with pytest.raises(ValueError, match="salt"):
        engine.add_request([5, 6], salt=3)  # type: ignore[arg-type]
    assert engine.run(["x"])["x"].finish_reason == "length"
    with pytest.raises(ValueError, match="KV blocks"):
        make_engine(kv_pool_tokens=128, cache_budget_tokens=16, max_batch_tokens=64).add_request([5] * 100, SamplingParams(max_new_tokens=100))


def test_preemption_with_a_tiny_pool_recomputes_and_matches_the_reference(make_engine, tokens):
    engine = make_engine(kv_pool_tokens=192, cache_budget_tokens=32, max_batch_tokens=64, max_num_seqs=6)
    prompts = [tokens(20 + 3 * i) for i in range(6)]
    params = SamplingParams(max_new_tokens=40, logprobs=True, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    results = {}
    while engine.has_work():
        for event in engine.step():
            if event.result is not None:
                results[event.request_id] = event.result
        engine.check_invariants()
    assert engine.stats["preemptions"] > 0
    assert sum(r.num_preemptions for r in results.values()) == engine.stats["preemptions"]
    for request_id, prompt in zip(ids, prompts):
        result = results[request_id]
        expected = reference.generate(engine, prompt, 40, logprobs=True)
        n = len(expected[0])  # the reference stops at EOS, the request ignored it
        assert (list(result.token_ids[:n]), list(result.logprobs[:n])) == expected
    engine.cache.clear()
    assert engine.allocator.num_free_blocks == engine.allocator.num_blocks


def test_abort_frees_blocks_at_any_point(make_engine, tokens):
    engine = make_engine(max_batch_tokens=32)
    for steps in range(6):
        request_id = engine.add_request(tokens(90), SamplingParams(max_new_tokens=20))
        for _ in range(steps):
            engine.step()
        assert engine.abort(request_id)
        engine.check_invariants()
        assert not engine.abort(request_id)
    engine.cache.clear()
    assert engine.allocator.num_free_blocks == engine.allocator.num_blocks
    assert engine.stats["num_aborted"] == 6


def test_seeded_sampling_is_reproducible_across_chunkings(make_engine, tokens):
    prompt = tokens(60)
    params = SamplingParams(max_new_tokens=12, temperature=0.9, top_p=0.9, top_k=50, seed=11, logprobs=True)
    outs = []
    for max_batch_tokens in (256, 16):
        engine = make_engine(max_batch_tokens=max_batch_tokens)
        engine.generate(prompt[:30], 2)  # a cache hit in the mix
        request_id = engine.add_request(prompt, params)
        outs.append(engine.run([request_id])[request_id])
    assert outs[0].token_ids == outs[1].token_ids and outs[0].logprobs == outs[1].logprobs
    engine = make_engine()
    request_id = engine.add_request(prompt, dataclasses.replace(params, seed=12))
    assert engine.run([request_id])[request_id].token_ids != outs[0].token_ids


def test_result_fields_and_ttft(make_engine, tokens):
    now = [100.0]
    engine = make_engine()
    engine._clock = lambda: now[0]  # injected clock
    request_id = engine.add_request(tokens(10), SamplingParams(max_new_tokens=3, logprobs=True))
    now[0] = 100.5
    result = engine.run([request_id])[request_id]
    assert result.prompt_tokens == 10 and result.cached_tokens == 0 and result.finish_reason == "length"
    assert result.ttft_s == 0.5 and len(result.logprobs) == 3 and result.request_id == request_id
    assert result.to_dict()["done"] is True and result.to_dict()["token_ids"] == list(result.token_ids)


def test_time_splits_into_queue_prefill_and_decode(make_engine, tokens):
    """With one sequence slot, the second request waits for the first to
    finish: its queue time is the first's whole run. Every request's phases
    add up to its TTFT and to its time in the engine."""
    clock = [0.0]
    engine = make_engine(max_num_seqs=1)

    def tick() -> float:  # every read of the clock is 1 s later
        clock[0] += 1.0
        return clock[0]

    engine._clock = tick
    first = engine.add_request(tokens(10), SamplingParams(max_new_tokens=3))
    second = engine.add_request(tokens(10), SamplingParams(max_new_tokens=1))
    results = engine.run([first, second])
    one, two = results[first], results[second]
    for result in (one, two):
        assert result.queue_s >= 0 and result.prefill_s > 0 and result.decode_s >= 0
        assert result.queue_s + result.prefill_s == result.ttft_s
        assert result.to_dict()["queue_s"] == result.queue_s
    assert one.decode_s > 0  # two more tokens after the first
    assert two.decode_s == 0  # its first token was its last
    assert two.queue_s > one.prefill_s + one.decode_s  # waited out the first's whole run
