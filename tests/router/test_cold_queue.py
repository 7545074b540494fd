"""Step 3's cold-queue weight: a cold request at a FIFO server waits for all of its queue."""

import random

from cache.summary import CacheSummary
from router.policy import PolicyConfig, PrefixAffinityPolicy
from tests.router.fake_clock import Clock
from tests.router.test_fetch import BLOCK, request

BUSY, QUEUED = "replica-0", "replica-1"


def fleet(cold_queue_weight: float, *, waiting: int = 2, running: int = 1) -> PrefixAffinityPolicy:
    """Two replicas, both candidates for every prompt. ``BUSY`` did 12 of
    this router's last 20 requests, ``QUEUED`` 8 (all completed: nothing of
    them queued), within the load bound both; ``QUEUED`` reports ``running``
    requests running, ``waiting`` waiting and 1,000 tokens queued. The balance
    term credits ``QUEUED`` for its lower share of the work; its queue is
    what a cold prompt sent there would wait for."""
    clock = Clock()
    config = PolicyConfig(block_size=BLOCK, cold_queue_weight=cold_queue_weight, num_ring_candidates=2,
                          turnover_weight=0.0)
    policy = PrefixAffinityPolicy(config, clock=clock)
    policy.set_replicas([BUSY, QUEUED])
    rng = random.Random(7)
    for i in range(20):
        clock.now += 0.05
        sent = request([rng.randrange(10**6) for _ in range(200)])
        policy.on_routed(sent, QUEUED if i % 5 in (1, 3) else BUSY, f"w{i}")
        clock.now += 0.05
        policy.on_completed(f"w{i}")
    for version in (1, 2):
        clock.now += 0.5
        assert policy.on_summary(CacheSummary(BUSY, version, clock.now, BLOCK, frozenset(), num_running=0))
        assert policy.on_summary(CacheSummary(QUEUED, version, clock.now, BLOCK, frozenset(), num_queued_tokens=1000,
                                              num_running=running, num_waiting=waiting))
    return policy


def cold_choices(policy_of) -> list[str]:
    """Each of 12 cold prompts' first choice, on a fresh fleet each."""
    rng = random.Random(0)
    return [policy_of().rank(request([rng.randrange(10**6) for _ in range(40)]))[0] for _ in range(12)]


def test_a_cold_prompt_does_not_queue_at_a_fifo_server_for_the_balance_credit():
    """Off (weight 0), the balance credit outweighs ``QUEUED``'s queue and
    every cold prompt goes to wait there; at the default weight (2: the
    queue weighs three times) each goes to ``BUSY``, which is idle."""
    assert PolicyConfig().cold_queue_weight == 2.0
    assert set(cold_choices(lambda: fleet(0.0))) == {QUEUED}
    assert set(cold_choices(lambda: fleet(2.0))) == {BUSY}


def test_the_weight_acts_only_at_a_server_seen_serving_one_at_a_time():
    """A batching engine (seen running two) admits a queued request into its
    next steps, so its queue is not all waited for: the weight stays off
    there, and as off where nothing was seen waiting behind one request."""
    before = cold_choices(lambda: fleet(0.0))
    assert cold_choices(lambda: fleet(2.0, running=2)) == before
    assert cold_choices(lambda: fleet(2.0, waiting=0)) == before


def test_a_warm_prompt_still_trades_its_wait_for_its_cache():
    """A prompt ``QUEUED`` holds part of is not cold: its queue weighs once,
    against the prefill its cache saves, and it goes to its holder, even at
    weight 4 (weighed five times, the queue would send it to ``BUSY``)."""
    policy = fleet(4.0)
    held = [4242 + i for i in range(160)]
    assert policy.on_summary(CacheSummary(QUEUED, 3, 10.0, BLOCK, frozenset(request(held).block_hashes),
                                          num_queued_tokens=1000, num_running=1, num_waiting=2))
    assert policy.rank(request(held + [7 + i for i in range(40)]))[0] == QUEUED
    policy.check_invariants()
