"""The policy prices an output token at what the replicas measure (router.token_prices)."""

import dataclasses

import pytest

from cache.summary import CacheSummary
from router.token_prices import ReportedTokenPrices
from tests.router.test_policy import (REPLICAS, book_decode_heavy_and_prefill_heavy, make_policy, prompt, request,
                                      summary)


def test_priors_hold_until_a_replica_reports_a_measurement():
    prices = ReportedTokenPrices(40.0, 40.0)
    assert (prices.decode_token_cost, prices.queue_token_cost) == (40.0, 40.0)
    assert not prices.report("a", 0.0, 0.0)  # not measured yet
    assert (prices.decode_token_cost, prices.queue_token_cost) == (40.0, 40.0)
    assert prices.report("a", 209.0, 5.0)
    assert (prices.decode_token_cost, prices.queue_token_cost) == (209.0, 5.0)


def test_the_prices_in_force_are_the_median_of_the_replicas_latest_reports():
    prices = ReportedTokenPrices(40.0, 40.0, history=1)
    prices.report("a", 200.0, 5.0)
    prices.report("b", 300.0, 9.0)
    prices.report("c", 1000.0, 2.0)  # one outlier does not set the price
    assert (prices.decode_token_cost, prices.queue_token_cost) == (300.0, 5.0)
    prices.report("c", 250.0, 6.0)  # a replica counts once: its latest report
    assert (prices.decode_token_cost, prices.queue_token_cost) == (250.0, 6.0)
    assert prices.report("c", 0.0, 0.0) is False  # "not measured" leaves its last report standing
    assert prices.decode_token_cost == 250.0
    assert prices.remove("c")
    assert (prices.decode_token_cost, prices.queue_token_cost) == (250.0, 7.0)
    assert not prices.remove("unknown")


def test_a_drift_within_the_tolerance_does_not_reprice():
    prices = ReportedTokenPrices(200.0, 5.0, tolerance=0.1, history=1)
    assert not prices.report("a", 215.0, 5.4)  # within 10 % (the queue price: of at least 1 token)
    assert (prices.decode_token_cost, prices.queue_token_cost) == (200.0, 5.0)
    assert prices.report("a", 230.0, 5.0)
    assert prices.decode_token_cost == 230.0


def test_a_history_of_reports_keeps_the_prices_steady_through_noisy_fits():
    """What the CPU Workers reported live within minutes (busy 30-68,
    queued 0-10): with each replica's latest report alone the prices in
    force swing over that whole range; with a history they stay near the
    pooled median, and one report far off it moves nothing."""
    noisy = [(41.0, 3.2), (60.7, 1.7), (39.8, 0.0), (67.9, 10.5), (54.5, 0.4), (48.9, 3.4), (40.9, 2.1), (58.9, 2.9)]
    latest, steady = ReportedTokenPrices(40.0, 40.0, history=1), ReportedTokenPrices(40.0, 40.0, history=16)
    in_force = {id(latest): [], id(steady): []}
    for round_number in range(4):
        for number, (decode, queue) in enumerate(noisy):
            for prices in (latest, steady):
                prices.report("ab"[number % 2], decode, queue)
                if round_number:  # after the first reports
                    in_force[id(prices)].append((prices.decode_token_cost, prices.queue_token_cost))

    def spread(which):
        return (max(d for d, _ in which) - min(d for d, _ in which), max(q for _, q in which) - min(q for _, q in which))
    busy_spread, queue_spread = spread(in_force[id(latest)])
    assert busy_spread >= 15.0 and queue_spread >= 4.0  # the mean of the two latest: 44.9-61.2, 0.85-5.45
    busy_spread, queue_spread = spread(in_force[id(steady)])
    assert busy_spread <= 6.0 and queue_spread <= 1.0  # 48.9-54.5, 2.1-2.9
    assert (steady.decode_token_cost, steady.queue_token_cost) == pytest.approx((51.7, 2.5), rel=0.1)
    assert not steady.report("a", 135.0, 9.0)  # one far-off fit does not move the pooled median
    steady.check_invariants({"a", "b"})
    with pytest.raises(ValueError, match="history"):
        ReportedTokenPrices(40.0, 40.0, history=0)


def test_the_last_prices_stay_when_every_reporting_replica_leaves():
    prices = ReportedTokenPrices(40.0, 40.0)
    assert not prices.is_measured
    prices.report("a", 200.0, 5.0)
    assert not prices.remove("a")
    assert (prices.decode_token_cost, prices.queue_token_cost) == (200.0, 5.0)
    assert prices.is_measured  # the prices in force are still measured ones, not the priors


def _measured(replica_id, decode_token_cost, queue_token_cost, version=1):
    return dataclasses.replace(summary(replica_id, version, []), decode_token_cost=decode_token_cost,
                               queue_token_cost=queue_token_cost)


def test_a_summary_carries_the_measured_prices_in_both_wire_formats():
    measured = _measured("replica-0", 209.5, 5.25)
    for compact in (True, False):
        wire = measured.to_dict(compact=compact)
        assert CacheSummary.from_dict(wire) == dataclasses.replace(measured, timestamp_s=0.0)
    assert {"dc", "qc"} <= measured.to_dict().keys()
    assert "dc" not in summary("replica-0", 1, []).to_dict()  # not measured: left out, reads as 0
    with pytest.raises(ValueError, match="queue_token_cost"):
        dataclasses.replace(measured, queue_token_cost=-1.0)


@pytest.mark.parametrize("learn", [True, False])
def test_a_router_given_one_price_learns_the_batching_engines_two(learn):
    """Configured with the FIFO price alone (40 and 40, what the live app
    had), the router reads each replica's measured prices from its summary:
    a batching engine's output token keeps it busy 40 prefill tokens' worth
    but delays a queued prefill only 4. With the two prices in force the
    balance term weighs the decode-heavy replica's recent work at the queue
    price, and a cold prompt goes there instead of to its ring home, which
    computed long prompts (the rule `test_the_balance_term_prices_an_output_
    token_at_its_queue_price` pins with configured prices)."""
    policy = make_policy(replicas=REPLICAS[:2], decode_token_cost=40.0, learn_token_costs=learn)
    for replica_id in REPLICAS[:2]:
        policy.on_summary(_measured(replica_id, 40.0, 4.0))
    policy.check_invariants()
    decoder, prefiller, cold = book_decode_heavy_and_prefill_heavy(policy)
    if learn:
        assert (policy.config.decode_token_cost, policy.config.queue_token_cost) == (40.0, 4.0)
        assert policy.rank(cold)[0] == decoder
    else:
        assert (policy.config.decode_token_cost, policy.config.queue_token_cost) == (40.0, 40.0)
        assert policy.rank(cold)[0] == prefiller


def test_the_busy_price_learned_sets_the_work_a_request_is_booked_at():
    policy = make_policy(replicas=REPLICAS[:2], decode_token_cost=40.0)
    tokens = prompt(7, 32)
    policy.on_routed(request(tokens, num_output_tokens=10), REPLICAS[0], "before")
    before = policy.loads.recent_work(REPLICAS[0], 0.0)
    for replica_id in REPLICAS[:2]:
        policy.on_summary(_measured(replica_id, 200.0, 5.0))
    policy.on_routed(request(prompt(8, 32), num_output_tokens=10), REPLICAS[1], "after")
    after = policy.loads.recent_work(REPLICAS[1], 0.0)
    # the prior expected output is min(max_tokens, 256) = 10 tokens either way
    assert before == pytest.approx(32 + 40.0 * 10)
    assert after == pytest.approx(32 + 200.0 * 10)
    policy.remove_replica(REPLICAS[0])  # one report left: the median is its own
    assert policy.config.decode_token_cost == 200.0
    policy.check_invariants()


def test_work_booked_before_the_prices_moved_is_read_at_the_prices_in_force():
    """The balance term reads a booking's output tokens at the queue price
    in force when it *reads* them: booked while the replicas measured one
    price (40 and 40), the decode-heavy replica looks light once they
    report 40 / 4, and a cold prompt goes there (at the booking-time price
    the two looked alike for the whole load window and the ring home, the
    prefill-heavy one, took it)."""
    policy = make_policy(replicas=REPLICAS[:2], decode_token_cost=40.0, price_history=1)
    for replica_id in REPLICAS[:2]:
        policy.on_summary(_measured(replica_id, 40.0, 40.0))
    decoder, prefiller, cold = book_decode_heavy_and_prefill_heavy(policy)  # booked at 40 / 40
    assert policy.rank(cold)[0] == prefiller  # one price: the balance term reads recent work, equal, ring decides
    for replica_id in REPLICAS[:2]:
        policy.on_summary(_measured(replica_id, 40.0, 4.0, version=2))
    assert (policy.config.decode_token_cost, policy.config.queue_token_cost) == (40.0, 4.0)
    assert policy.rank(cold)[0] == decoder
    policy.check_invariants()


def test_the_first_measurement_clears_the_recent_work_booked_at_the_priors():
    """Busy time booked at the prior (40) before any replica measured is off
    by up to 3x live; the first report clears that window once, later
    reports (prices moving within the history) clear nothing."""
    policy = make_policy(replicas=REPLICAS[:2], decode_token_cost=40.0)
    policy.on_routed(request(prompt(7, 32), num_output_tokens=10), REPLICAS[0], "at-the-prior")
    assert policy.loads.recent_work(REPLICAS[0], 0.0) == pytest.approx(32 + 40.0 * 10)
    policy.on_summary(_measured(REPLICAS[0], 120.0, 4.0))
    assert policy.loads.recent_work(REPLICAS[0], 0.0) == 0.0
    assert policy.loads.load(REPLICAS[0]) > 0  # still in flight: its queued work stays
    policy.on_routed(request(prompt(8, 32), num_output_tokens=10), REPLICAS[1], "measured")
    policy.on_summary(_measured(REPLICAS[1], 60.0, 2.0, version=1))  # the median moves: 90 / 3
    assert policy.config.decode_token_cost == pytest.approx(90.0)
    assert policy.loads.recent_work(REPLICAS[1], 0.0) == pytest.approx(32 + 120.0 * 10)
    policy.on_completed("at-the-prior")
    policy.check_invariants()
