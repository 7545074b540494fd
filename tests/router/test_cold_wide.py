"""A cold request where caches have room (``PolicyConfig.num_cold_candidates``,
``cold_balance_share``): its wait is all its placement decides, so the first
``num_cold_candidates`` ring nodes from its key compete, not only the ring's
first two and the least booked replica, and its balance term weighs less."""

import pytest

from cache.summary import CacheSummary
from router.policy import PolicyConfig, PrefixAffinityPolicy
from router.request import RoutingRequest
from tests.router.fake_clock import Clock

BLOCK = 4
NAMES = [f"replica-{i}" for i in range(6)]
RATE_COUNTERS = dict(busy_s_total=10.0, num_prefill_tokens_total=100_000, num_output_tokens_total=2_500)  # 20k/s
COLD = RoutingRequest(tuple(range(9_000_000, 9_000_250)), 1000, None, "", 8)  # 1,000 tokens nobody holds


def report(replica_id, version=1, budget=1_000_000, cached=0):
    """A FIFO replica's summary (one running, one waiting), 20k tokens/s, outputs of 2..8 tokens."""
    return CacheSummary(replica_id, version, 0.0, BLOCK, frozenset(), num_cached_tokens=cached, budget_tokens=budget,
                        num_running=1, num_waiting=1, mean_output_tokens=5.0, output_quantiles=(2, 4, 6, 8),
                        **RATE_COUNTERS)


def fleet(**config):
    """Six FIFO replicas with room. Along the cold key's ring walk ``w``:
    ``w[0]``, ``w[1]``, ``w[3]`` and ``w[5]`` took 3,000-token prompts just
    now, ``w[2]`` a 1,500-token one (the least booked), and ``w[4]`` a
    4,000-token one 0.5 s ago, which it has prefilled and decoded past every
    output seen (at 20k tokens/s): booked the heaviest, it frees first.
    Returns the policy and ``w``."""
    clock = Clock()
    defaults = dict(block_size=BLOCK, balance_weight=0.0, turnover_weight=0.0)
    policy = PrefixAffinityPolicy(PolicyConfig(**(defaults | config)), clock=clock)
    policy.set_replicas(NAMES)
    for name in NAMES:
        policy.on_summary(report(name))
    walk = list(policy.ring.walk(COLD.block_hashes[0]))
    sends = [(walk[4], 10.0, 4000)] + [(walk[i], 10.5, 1500 if i == 2 else 3000) for i in (0, 1, 2, 3, 5)]
    for number, (replica_id, at, size) in enumerate(sends):
        clock.now = at
        first = 1_000_000 * (number + 1)
        sent = RoutingRequest(tuple(range(first, first + size // BLOCK)), size, None, "", 8)
        policy.on_routed(sent, replica_id, f"sent-{number}")
    return policy, walk


def test_a_cold_request_with_room_goes_where_the_queue_frees_first():
    policy, walk = fleet()
    assert policy.loads.least_loaded_replica() == walk[2]  # by booked work
    assert policy.rank(COLD)[0] == walk[4]
    narrow, _ = fleet(num_cold_candidates=2)  # the ring's first two and the least booked, as for a warm request
    assert narrow.rank(COLD)[0] == walk[2]
    policy.check_invariants()


def test_with_a_cache_short_of_room_the_ring_homes_stand():
    """A placement that may evict keeps the ring's two homes (and the least
    booked): homes chosen by load would pile cache footprints up."""
    policy, walk = fleet()
    tight = walk[1]
    policy.on_summary(report(tight, version=2, budget=10_000, cached=9_000))
    assert policy.rank(COLD)[0] == walk[2]


def test_a_warm_request_keeps_its_candidates():
    """A request whose prefix a replica holds is not cold: the rule leaves it alone."""
    policy, walk = fleet()
    warm = RoutingRequest(tuple(range(1_000_000, 1_000_000 + 250)), 1000, None, "", 8)  # sent-0's prefix, at walk[4]
    assert policy.rank(warm)[0] == walk[4]
    assert len(policy.decide(COLD).ranked) == 3


def test_its_balance_term_weighs_the_cold_share_only_where_there_is_room():
    policy, _ = fleet(balance_weight=0.6)
    now = policy._clock()  # noqa: SLF001
    assert policy._scoring(COLD, now, room=True).cold_balance == pytest.approx(0.6 * 0.3)  # noqa: SLF001
    assert policy._scoring(COLD, now, room=False).cold_balance is None  # noqa: SLF001
    assert policy._placement_evicts_nothing(COLD)  # noqa: SLF001


@pytest.mark.parametrize("knob, value", [("num_cold_candidates", 0), ("num_cold_candidates", 2.0),
                                         ("cold_balance_share", -0.1), ("cold_balance_share", float("nan"))])
def test_bad_knobs_are_refused(knob, value):
    with pytest.raises(ValueError, match=knob):
        PolicyConfig(**{knob: value})
