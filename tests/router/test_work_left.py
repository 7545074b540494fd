"""What a FIFO replica's running request has left (``router.work_left``,
``PolicyConfig.fifo_work_left``): from when it started, the replicas' work
rate and their output-length quantiles, never its real length."""

import pytest

from cache.summary import CacheSummary
from router.policy import PolicyConfig, PrefixAffinityPolicy
from router.request import RoutingRequest
from router.work_left import WorkLeft
from tests.router.fake_clock import Clock

A, B = "replica-0", "replica-1"
BLOCK = 4
RATE_COUNTERS = dict(busy_s_total=10.0, num_prefill_tokens_total=100_000, num_output_tokens_total=2_500)  # 20k/s


def report(replica_id, version=1, *, quantiles=(2, 4, 6, 8), budget=1_000_000, running=1, waiting=1, **counters):
    return CacheSummary(replica_id, version, 0.0, BLOCK, frozenset(), num_cached_tokens=0, budget_tokens=budget,
                        num_running=running, num_waiting=waiting, mean_output_tokens=5.0, output_quantiles=quantiles,
                        **(counters or RATE_COUNTERS))


def test_the_rest_of_an_output_is_the_mean_residual_of_the_pooled_points():
    left = WorkLeft()
    assert left.residual_output(0) == 0.0 and not left.is_ready
    left.report(report(A, quantiles=(10, 10, 100, 500)), decode_token_cost=40.0)
    left.report(report(B, quantiles=(10, 20, 30, 40)), decode_token_cost=40.0)
    assert left.is_ready
    assert left.residual_output(0) == pytest.approx(720 / 8)
    assert left.residual_output(50) == pytest.approx(300 - 50)  # past the short ones, the long ones' rest
    assert left.residual_output(600) == pytest.approx(720 / 8)  # past every point: the pooled mean
    left.remove(B)
    assert left.residual_output(50) == pytest.approx(250)
    left.check_invariants([A])


def test_the_running_request_pays_down_its_prefill_then_decodes():
    """Rate 20,000 work tokens/s (the counters), outputs at 40 tokens of
    work each, quantiles 2..8 (mean 5): a 4,000-token prefill sent at 0."""
    left = WorkLeft()
    assert left.head_left(A, 4200.0, 4000.0, 0.0, 0.1, 40.0, 40.0) == 4200.0  # nothing reported: as booked
    left.report(report(A), decode_token_cost=40.0)
    assert left.head_left(A, 4200.0, 4000.0, 0.0, 0.1, 40.0, 40.0) == pytest.approx(2000 + 40 * 5)
    # 5 tokens decoded: of the points above 5 (6 and 8) the mean is 7, so 2 more to come
    assert left.head_left(A, 4200.0, 4000.0, 0.0, 0.2 + 40 * 5 / 20_000, 40.0, 40.0) == pytest.approx(40 * 2)
    # it started when the replica last finished one of this router's requests, if that is later
    left.on_completed(A, 0.05)
    assert left.head_left(A, 4200.0, 4000.0, 0.0, 0.1, 40.0, 40.0) == pytest.approx(3000 + 40 * 5)


def test_the_rate_is_the_median_of_the_replicas_latest_as_they_report_and_leave():
    """Every report moves the rate to the median of the replicas' latest
    (the mean of the middle two when even)."""
    left = WorkLeft()
    rates = {}
    for replica_id, busy_s in [(A, 10.0), (B, 5.0), ("replica-2", 20.0), (A, 2.0), ("replica-3", 4.0)]:
        left.report(report(replica_id, **{**RATE_COUNTERS, "busy_s_total": busy_s}), decode_token_cost=40.0)
        rates[replica_id] = 200_000 / busy_s  # 100k prefill + 40 x 2.5k output tokens of work
        left.check_invariants(rates)
    assert sorted(rates.values()) == [10_000, 40_000, 50_000, 100_000]
    assert left.view(0.0, 40.0, 40.0)  # is ready: a view reads the rate
    assert left._rate == pytest.approx((40_000 + 50_000) / 2)
    left.remove(A)  # 100k out: the middle one of three
    assert left._rate == pytest.approx(40_000)
    for replica_id in (B, "replica-2", "replica-3"):
        left.remove(replica_id)
    assert left._rate is None and not left.is_ready
    left.check_invariants([])


def test_a_rate_needs_a_replica_busy_long_enough():
    left = WorkLeft()
    left.report(report(A, busy_s_total=0.5, num_prefill_tokens_total=10_000, num_output_tokens_total=0), 40.0)
    assert not left.is_ready
    left.report(report(A, 2, **RATE_COUNTERS), 40.0)
    assert left.is_ready


def fleet(**config):
    """A and B report serving one request at a time, with room, short
    outputs (2..8 tokens) and a 20k tokens/s rate. At 10.0 s this router
    sends a 4,000-token prompt to A, at 10.45 s a 2,000-token one to B."""
    clock = Clock()
    policy = PrefixAffinityPolicy(PolicyConfig(block_size=BLOCK, balance_weight=0.0, turnover_weight=0.0, **config),
                                  clock=clock)
    policy.set_replicas([A, B])
    policy.on_summary(report(A))
    policy.on_summary(report(B))
    for replica_id, at, size in ((A, 10.0, 4000), (B, 10.45, 2000)):
        clock.now = at
        first = int(at * 100_000)
        sent = RoutingRequest(tuple(range(first, first + size // BLOCK)), size, None, "", 8)
        policy.on_routed(sent, replica_id, f"{replica_id}@{at}")
    clock.now = 10.5
    return policy


def cold(size=1000):
    return RoutingRequest(tuple(range(9_000_000, 9_000_000 + size // BLOCK)), size, None, "", 8)


def test_a_cold_prompt_goes_where_the_running_request_is_nearly_done():
    """Booked, A holds 4,000 + output and B 2,000 + output: B looks lighter.
    By 10.5 s A has decoded past every output seen (its rest: the mean),
    while B is still in its prefill: A is the shorter wait."""
    assert fleet().rank(cold())[0] == A
    assert fleet(fifo_work_left=False).rank(cold())[0] == B
    fleet().check_invariants()


def test_the_rest_is_read_only_where_caches_have_room_and_servers_queue():
    """With a cache short of room for two copies of the prompt (a placement
    may evict), or replicas seen running two at once (batching), the
    booked work stands."""
    tight = fleet()
    tight.on_summary(CacheSummary(B, 2, 10.5, BLOCK, frozenset(), num_cached_tokens=9_000, budget_tokens=10_000,
                                  num_running=1, num_waiting=1, output_quantiles=(2, 4, 6, 8), **RATE_COUNTERS))
    assert tight.rank(cold())[0] == B
    batching = fleet()
    for version, replica_id in enumerate((A, B), start=2):
        batching.on_summary(report(replica_id, version, running=2))
    assert batching.rank(cold())[0] == B


def test_the_rest_is_read_with_every_other_reader_of_the_caches_fill_off():
    """``fifo_work_left`` reads the fleet's cache fill itself (room for two
    copies of the prompt): with every other reader of the fill off, the
    summaries still feed it."""
    alone = dict(premium_needs_completion=False, replicate_hot_prefixes=False, queue_copy_requests=0)
    assert fleet(**alone).rank(cold())[0] == A
    assert fleet(fifo_work_left=False, **alone).rank(cold())[0] == B
