"""Deterministic mode: random workloads give tokens AND logprobs equal (==) to the
plain server's, whatever the cache hits, chunk sizes, batch mix or arrival order."""

import random

import pytest

from worker import SamplingParams, reference


def random_workload(rng: random.Random, num_requests: int):
    prefixes = [[rng.randrange(3, 259) for _ in range(rng.randrange(5, 80))] for _ in range(4)]
    requests = []
    for _ in range(num_requests):
        kind = rng.random()
        if kind < 0.6:
            prompt = rng.choice(prefixes) + [rng.randrange(3, 259) for _ in range(rng.randrange(1, 30))]
        elif kind < 0.8 and requests:
            prompt = list(rng.choice(requests)[0])  # an exact repeat
        else:
            prompt = [rng.randrange(3, 259) for _ in range(rng.randrange(1, 60))]
        requests.append((prompt, rng.randrange(1, 12), rng.choice([None, None, "tenant-b"])))
    return requests


@pytest.mark.parametrize(
    ("seed", "block_size", "max_batch_tokens", "max_num_seqs", "kv_pool_tokens", "attention_kernel"),
    [(0, 16, 64, 8, 1600, "auto"), (1, 4, 16, 3, 1600, "auto"), (2, 32, 37, 5, 1600, "auto"),
     (3, 8, 128, 16, 1600, "auto"), (4, 16, 96, 12, 320, "auto"),
     # the tiled torch kernel, where the native one cannot run
     (1, 4, 16, 3, 1600, "torch"), (4, 16, 96, 12, 320, "torch")],
)
def test_random_workloads_equal_the_reference(make_engine, seed, block_size, max_batch_tokens, max_num_seqs,
                                              kv_pool_tokens, attention_kernel):
    rng = random.Random(seed)
    engine = make_engine(
        block_size=block_size, max_batch_tokens=max_batch_tokens, max_num_seqs=max_num_seqs,
        cache_budget_tokens=min(600, kv_pool_tokens // 4), kv_pool_tokens=kv_pool_tokens,
        attention_kernel=attention_kernel,
    )
    assert engine.runner.attention_path in (("tiled",) if attention_kernel == "torch" else ("native", "tiled"))
    pending = random_workload(rng, 24)
    expected = {}
    results = {}
    ids = []
    while pending or engine.has_work():
        for _ in range(rng.randrange(0, 4)):  # requests arrive between steps
            if pending:
                prompt, max_new, salt = pending.pop(0)
                request_id = engine.add_request(prompt, SamplingParams(max_new_tokens=max_new, logprobs=True), salt=salt)
                ids.append(request_id)
                expected[request_id] = (prompt, max_new)
        for event in engine.step():
            if event.result is not None:
                results[event.request_id] = event.result
        engine.check_invariants()
    memo = {}
    for request_id in ids:
        prompt, max_new = expected[request_id]
        key = (tuple(prompt), max_new)
        if key not in memo:
            memo[key] = reference.generate(engine, prompt, max_new, logprobs=True)
        result = results[request_id]
        assert (list(result.token_ids), list(result.logprobs)) == memo[key], request_id
    stats = engine.stats
    assert stats["hits"] > 0 and stats["num_finished"] == len(ids)
    if kv_pool_tokens < 1000:
        assert stats["preemptions"] > 0  # the tiny pool forced recomputation, outputs unchanged


def test_multi_turn_chats_equal_the_reference(make_engine, rng):
    engine = make_engine(max_batch_tokens=24)
    chats = [[rng.randrange(3, 259) for _ in range(rng.randrange(10, 30))] for _ in range(3)]
    for _ in range(3):
        outputs = engine.generate_batch(chats, 6, logprobs=True)
        for chat, output in zip(chats, outputs):
            assert output == reference.generate(engine, chat, 6, logprobs=True)
        chats = [chat + out[0] + [rng.randrange(3, 259) for _ in range(5)] for chat, out in zip(chats, outputs)]
    assert engine.stats["hits"] >= 6


def test_default_mode_agrees_closely_but_not_bitwise(make_engine):
    """Default mode's kernels depend on the batch: tokens nearly always agree with
    the plain server, logprobs to float32 rounding (this measures it; no ==)."""
    rng = random.Random(5)
    engine = make_engine(deterministic=False, max_batch_tokens=48)
    requests = random_workload(rng, 16)
    outputs = engine.generate_batch([p for p, _, _ in requests], 8, logprobs=True)
    same_tokens = 0
    for (prompt, _, _), (toks, logprobs) in zip(requests, outputs):
        ref_tokens, ref_logprobs = reference.generate(engine, prompt, 8, logprobs=True)
        same_tokens += toks == ref_tokens
        agree = 0
        while agree < min(len(toks), len(ref_tokens)) and toks[agree] == ref_tokens[agree]:
            agree += 1
        for a, b in zip(logprobs[:agree], ref_logprobs[:agree]):
            assert abs(a - b) < 1e-3
    assert same_tokens >= 0.8 * len(requests)
