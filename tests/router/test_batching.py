"""router.batching: the continuous-batching replica model and step profiles."""

import json

import pytest

from router.batching import H100_LLAMA_8B, BatchingReplica, StepProfile
from router.workload import SimRequest

PROFILE = StepProfile(base_s=0.01, prefill_token_s=0.001, decode_seq_s=0.002, context_token_s=0.0,
                      max_batch_tokens=100, kv_capacity_tokens=10_000)


def request(arrival_s, num_prompt, num_output, base=0):
    units = tuple(range(base, base + num_prompt))
    return SimRequest(arrival_s, units, 1, num_prompt, num_output, (), units)


def test_prefill_is_chunked_and_the_first_token_comes_at_the_end_of_its_step():
    replica = BatchingReplica("r", 10_000, PROFILE)
    replica.submit(0, request(0.0, 250, 1), 0.0)
    done = replica.advance(float("inf"))
    # chunks of 100, 100, 50 tokens: 3 steps of 0.01 + 0.001 x tokens
    assert replica.outcomes[0].ttft_s == pytest.approx(3 * 0.01 + 0.250)
    assert [c.number for c in done] == [0] and done[0].finish_s == pytest.approx(0.28)
    assert replica.num_steps == 3


def test_a_prompt_sharing_a_prefix_still_computed_waits_for_it_and_the_rest_go_ahead():
    """As the engine's scheduler (``Scheduler._should_wait``): a request
    whose prompt shares a prefix a running sequence is still prefilling is
    admitted once that prefix is computed, then reuses it; a request queued
    behind it with nothing to share is admitted meanwhile."""
    replica = BatchingReplica("r", 10_000, PROFILE)
    shared = tuple(range(80))
    replica.submit(0, SimRequest(0.0, shared + (9001,), 1, 81, 1, (), shared + (9001,)), 0.0)
    replica.submit(1, SimRequest(0.0, shared + (9002, 9003), 1, 82, 1, (), shared + (9002, 9003)), 0.0)
    replica.submit(2, request(0.0, 10, 1, base=5000), 0.0)
    replica.advance(float("inf"))
    # step 1: request 0's 81 tokens and request 2's 10 (request 1 deferred): 0.01 + 0.091 s;
    # step 2: request 1's 2 tokens past the 80 it reuses: 0.01 + 0.002 s
    assert replica.outcomes[2].ttft_s == pytest.approx(0.101)
    assert replica.outcomes[0].ttft_s == pytest.approx(0.101)
    assert replica.outcomes[1].ttft_s == pytest.approx(0.101 + 0.012)
    assert replica.outcomes[1].cached_tokens == 80
    replica.check_invariants()


def test_decodes_share_a_step_with_the_next_prefill():
    replica = BatchingReplica("r", 10_000, PROFILE)
    replica.submit(0, request(0.0, 50, 3), 0.0)
    replica.advance(0.0601)  # step 1: prefill 50 (0.06 s) -> first token of 0
    replica.submit(1, request(0.0601, 50, 1, base=1000), 0.0601)
    replica.advance(float("inf"))
    # step 2 starts at 0.06 (before the arrival): decode only, 0.012 s; step 3: decode + 50 prefill
    assert replica.outcomes[1].ttft_s == pytest.approx(0.06 + 0.012 + (0.01 + 0.002 + 0.05) - 0.0601)
    replica.check_invariants()


def test_closed_form_decode_equals_step_by_step():
    profile = StepProfile(0.004, 50e-6, 20e-6, 40e-9, 8192, 100_000)
    fast = BatchingReplica("a", 10_000, profile)
    for i in range(3):
        fast.submit(i, request(0.0, 100 * (i + 1), 50 + 10 * i, base=1000 * i), 0.0)
    finishes = {c.number: c.finish_s for c in fast.advance(float("inf"))}
    slow = BatchingReplica("b", 10_000, profile)
    for i in range(3):
        slow.submit(i, request(0.0, 100 * (i + 1), 50 + 10 * i, base=1000 * i), 0.0)
    stepped, t = {}, 0.0
    while len(stepped) < 3:  # tiny horizons force one step per advance
        t += 1e-4
        stepped.update({c.number: c.finish_s for c in slow.advance(t)})
    assert stepped == pytest.approx(finishes)
    assert fast.busy_s == pytest.approx(slow.busy_s)


def test_a_full_kv_pool_queues_and_preempts():
    tight = StepProfile(0.01, 0.001, 0.0, 0.0, max_batch_tokens=1000, kv_capacity_tokens=120)
    replica = BatchingReplica("r", 10_000, tight)
    replica.submit(0, request(0.0, 60, 30), 0.0)
    replica.submit(1, request(0.0, 50, 30, base=1000), 0.0)
    replica.submit(2, request(0.0, 50, 5, base=2000), 0.0)  # does not fit beside the first two
    replica.advance(0.0001)
    assert replica.summary(1, 0.0, 1, 4).num_waiting == 1
    done = replica.advance(float("inf"))
    assert sorted(c.number for c in done) == [0, 1, 2]
    assert replica.num_preemptions >= 1  # 110 prompt tokens + 2 x 30 outputs exceed 120
    replica.check_invariants()


def test_a_readmitted_request_does_not_protect_its_own_prompt():
    tight = StepProfile(0.01, 0.001, 0.0, 0.0, max_batch_tokens=1000, kv_capacity_tokens=120)
    replica = BatchingReplica("r", 10_000, tight, protected_share=0.8)
    replica.submit(0, request(0.0, 60, 30), 0.0)
    replica.submit(1, request(0.0, 50, 30, base=1000), 0.0)
    replica.advance(float("inf"))
    assert replica.num_preemptions >= 1
    assert replica.radix.num_protected_tokens == 0  # two distinct prompts: nothing was reused
    assert replica.radix.stats.hits == 0
    replica.check_invariants()


def test_the_prefix_of_an_admitted_request_is_shared_at_once():
    replica = BatchingReplica("r", 10_000, PROFILE)
    replica.submit(0, request(0.0, 200, 1), 0.0)
    replica.submit(1, request(0.0, 200, 1), 0.0)
    replica.advance(float("inf"))
    assert replica.outcomes[1].cached_tokens == 199  # at most T - 1


def test_profile_round_trips_through_json(tmp_path):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(H100_LLAMA_8B.to_dict()))
    assert StepProfile.load(path) == H100_LLAMA_8B
    assert H100_LLAMA_8B.prefill_s(8192) == pytest.approx(0.004 + 8192 * 50e-6 + 8192 * 40e-9)
    with pytest.raises(ValueError, match="max_batch_tokens"):
        StepProfile(0.0, 1e-6, 0.0, 0.0, 0, 10)


@pytest.mark.parametrize("name", ["tiny_llama_cpu.json", "llama_125m_cpu.json", "llama8b_h100.json"])
def test_the_shipped_profiles_load_with_positive_step_times(name):
    """Every profile in router/profiles/ loads (the calibration's extra
    samples ignored) and prices a step above its base."""
    from pathlib import Path

    profile = StepProfile.load(Path(__file__).parents[2] / "router" / "profiles" / name)
    assert profile.max_batch_tokens > 0 and profile.kv_capacity_tokens > 0
    assert profile.prefill_s(512) > profile.base_s >= 0
