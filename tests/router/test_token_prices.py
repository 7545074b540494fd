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
    prices = ReportedTokenPrices(40.0, 40.0)
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
    prices = ReportedTokenPrices(200.0, 5.0, tolerance=0.1)
    assert not prices.report("a", 215.0, 5.4)  # within 10 % (the queue price: of at least 1 token)
    assert (prices.decode_token_cost, prices.queue_token_cost) == (200.0, 5.0)
    assert prices.report("a", 230.0, 5.0)
    assert prices.decode_token_cost == 230.0


def test_the_last_prices_stay_when_every_reporting_replica_leaves():
    prices = ReportedTokenPrices(40.0, 40.0)
    prices.report("a", 200.0, 5.0)
    assert not prices.remove("a")
    assert (prices.decode_token_cost, prices.queue_token_cost) == (200.0, 5.0)


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
