"""router.reported_busy.ReportedBusy: each replica's recent busy time from the
busy-time counter its summaries carry, topped up with this router's own
spans since; and how the policy reads it with several routers."""

import json
import math
import random

import pytest

from cache.summary import CacheSummary
from router import PolicyConfig
from router.reported_busy import ReportedBusy
from tests.router.fake_clock import Clock
from tests.router.test_cold_home import BLOCK, REPLICAS, make_policy, request

W = 10.0


def d(age):
    return math.exp(-age / W)


def value(tracker, replica_id, now, own):
    """The tracker's figure for one replica, given this router's own figures now."""
    return tracker.view(now, lambda r: own[r], sum(own.values()) / len(own))[0](replica_id)


def test_the_first_report_seeds_with_this_routers_own_figure():
    tracker = ReportedBusy(W)
    tracker.report("a", "e", 100.0, now=0.0, own_busy_s=2.0)  # a counter alone says nothing recent
    assert value(tracker, "a", 0.0, {"a": 2.0}) == pytest.approx(2.0)
    # until the next report it moves with this router's own figure: decayed, plus what it added since
    assert value(tracker, "a", 5.0, {"a": 2.0 * d(5) + 0.7}) == pytest.approx(2.0 * d(5) + 0.7)
    tracker.check_invariants()


def test_a_report_adds_the_counters_increment_and_replaces_own_spans_since():
    tracker = ReportedBusy(W)
    tracker.report("a", "e", 100.0, now=0.0, own_busy_s=2.0)
    tracker.report("a", "e", 104.0, now=5.0, own_busy_s=2.5)  # 4 s busy in 5 s; this router saw 1 s of it
    reported = 2.0 * d(5) + 4.0
    assert value(tracker, "a", 5.0, {"a": 2.5}) == pytest.approx(reported)
    # 2 s later this router saw it busy 0.5 s more: the report decayed, plus that
    own_later = 2.5 * d(2) + 0.5
    assert value(tracker, "a", 7.0, {"a": own_later}) == pytest.approx(reported * d(2) + 0.5)
    tracker.check_invariants()


@pytest.mark.parametrize("epoch, total", [("restarted", 500.0), ("e", 50.0)])
def test_a_new_epoch_or_a_counter_that_went_back_seeds_again(epoch, total):
    tracker = ReportedBusy(W)
    tracker.report("a", "e", 100.0, now=0.0, own_busy_s=2.0)
    tracker.report("a", "e", 104.0, now=5.0, own_busy_s=2.5)
    tracker.report("a", epoch, total, now=6.0, own_busy_s=1.5)  # no increment to count: own figure
    assert value(tracker, "a", 6.0, {"a": 1.5}) == pytest.approx(1.5)
    tracker.report("a", epoch, total + 3.0, now=8.0, own_busy_s=1.5)  # then increments again
    assert value(tracker, "a", 8.0, {"a": 1.5}) == pytest.approx(1.5 * d(2) + 3.0)


def test_a_counter_a_hair_lower_adds_nothing_and_keeps_the_replicas_figure():
    """A counter read 1e-12 s below its last report (float noise, under
    ``COUNTER_SLACK_S``) is the same run: no increment, no reseeding with this
    router's own figure, which would make a busy replica look idle."""
    tracker = ReportedBusy(W)
    tracker.report("a", "e", 100.0, now=0.0, own_busy_s=2.0)
    tracker.report("a", "e", 104.0, now=5.0, own_busy_s=0.5)
    reported = 2.0 * d(5) + 4.0
    tracker.report("a", "e", 104.0 - 1e-12, now=6.0, own_busy_s=0.4)
    assert value(tracker, "a", 6.0, {"a": 0.4}) == pytest.approx(reported * d(1))  # not 0.4
    tracker.report("a", "e", 105.0, now=7.0, own_busy_s=0.3)  # the increment from the higher count
    assert value(tracker, "a", 7.0, {"a": 0.3}) == pytest.approx(reported * d(2) + 1.0)
    tracker.check_invariants()


def test_the_mean_matches_the_replicas_and_removal_drops_one():
    tracker = ReportedBusy(W)
    own = {"a": 1.0, "b": 0.0, "c": 3.0}
    for total_a, total_b, total_c, now in ((10.0, 0.0, 5.0, 0.0), (13.0, 0.5, 5.0, 2.0)):
        tracker.report("a", "e", total_a, now, own["a"])
        tracker.report("b", "e", total_b, now, own["b"])
        tracker.report("c", "e", total_c, now, own["c"])
    own_now = {"a": 1.2, "b": 0.4, "c": 2.9}
    busy, mean = tracker.view(3.0, lambda r: own_now[r], sum(own_now.values()) / 3)
    assert mean == pytest.approx(sum(busy(r) for r in "abc") / 3)
    assert len(tracker) == 3 and "a" in tracker
    assert tracker.num_counting == 3  # b's counter moved at its second report
    tracker.remove("b")
    assert len(tracker) == 2 and "b" not in tracker and tracker.num_counting == 2
    tracker.check_invariants()


def test_it_agrees_with_the_formula_over_a_long_random_run():
    """Reports and reads at random over 300 windows (several rebases): every
    read equals ``(R - own(t_r))·d(now - t_r) + own(now)`` computed directly."""
    rng = random.Random(3)
    tracker = ReportedBusy(W)
    replicas = ["a", "b", "c", "d"]
    own = {r: 0.0 for r in replicas}
    totals = {r: 0.0 for r in replicas}
    reference = {}  # r -> (t_r, R, own then)
    now = 0.0
    for _ in range(2_000):
        step = rng.expovariate(1.0 / (1.5 * W))
        for r in replicas:  # own spans: decayed, plus a little busy time at the end of the step
            own[r] = own[r] * d(step) + rng.random() * min(step, 1.0)
        now += step
        r = rng.choice(replicas)
        totals[r] += rng.random() * step
        before = reference.get(r)
        reported = own[r] if before is None else before[1] * d(now - before[0]) + (totals[r] - tracker._last[r][1])
        tracker.report(r, "e", totals[r], now, own[r])
        reference[r] = (now, reported, own[r])
        busy, mean = tracker.view(now, lambda x: own[x], sum(own.values()) / len(own))
        expected = {x: (ref[1] - ref[2]) * d(now - ref[0]) + own[x] for x, ref in reference.items()}
        for x, figure in expected.items():
            assert busy(x) == pytest.approx(figure, rel=1e-6, abs=1e-9)
        if len(reference) == len(replicas):
            assert mean == pytest.approx(sum(expected.values()) / len(replicas), rel=1e-6, abs=1e-9)
    tracker.check_invariants()


# ---------------------------------------------------------------- the policy
def summaries(policy, version, busy, outputs):
    for replica_id in REPLICAS:
        policy.on_summary(CacheSummary(replica_id, version, 0.0, BLOCK, frozenset(), 0, 10_000,
                                       mean_output_tokens=16.0, num_output_tokens_total=outputs,
                                       busy_s_total=busy.get(replica_id, 0.0)))


def with_history(clock, policy, outputs_per_replica):
    """This router routes and completes 32 requests (a replica each, by its
    own rule) while the fleet's counters say ``outputs_per_replica`` output
    tokens each; every replica reports 1 s busy over the 3.2 s."""
    summaries(policy, 1, {}, 0)
    for number in range(32):
        clock.now += 0.1
        req = request(number)
        policy.on_routed(req, policy.rank(req)[0], str(number))
        policy.on_completed(str(number))
    summaries(policy, 2, {r: 1.0 for r in REPLICAS}, outputs_per_replica)


def test_with_several_routers_a_replica_its_counter_shows_busy_loses_cold_requests():
    """Four routers' worth of outputs: this router reads the replicas'
    busy-time counters. A replica that reports 10 s busy in the next 2 s
    (the other routers loaded it; this router's own spans show it idle)
    stops being a cold request's first choice; a router that reads only its
    own spans keeps sending there."""
    firsts = {}
    for from_reports in (True, False):
        clock = Clock()
        policy = make_policy(clock, busy_from_reports=from_reports)
        with_history(clock, policy, 4 * 32 * 16 // len(REPLICAS))
        assert policy._routers_seen(clock.now) == pytest.approx(4.0, rel=0.05)  # noqa: SLF001
        cold = [request(100 + seed) for seed in range(40)]
        homes = {policy.rank(req)[0] for req in cold}
        clock.now += 2.0
        busy = {r: 1.0 + 0.2 for r in REPLICAS}  # 0.2 s busy each in 2 s, one replica 10 s
        busy[REPLICAS[3]] = 11.0
        summaries(policy, 3, busy, 4 * 32 * 16 // len(REPLICAS))
        firsts[from_reports] = [policy.rank(req)[0] for req in cold]
        assert REPLICAS[3] in homes  # it was some cold prompt's first choice before
        policy.check_invariants()
    assert REPLICAS[3] not in firsts[True]
    assert REPLICAS[3] in firsts[False]


def test_a_replica_whose_counter_never_moved_keeps_every_router_on_its_own_spans():
    """A worker from before busy_s_total reports 0 for ever: read as a
    counter it would look idle, so with one such replica in the fleet the
    several-router decisions are those of a router reading its own spans."""
    firsts = {}
    for from_reports in (True, False):
        clock = Clock()
        policy = make_policy(clock, busy_from_reports=from_reports)
        with_history(clock, policy, 4 * 32 * 16 // len(REPLICAS))
        clock.now += 2.0
        busy = {r: 1.2 for r in REPLICAS}
        busy[REPLICAS[3]] = 11.0
        busy[REPLICAS[5]] = 0.0  # the old worker
        summaries(policy, 3, busy, 4 * 32 * 16 // len(REPLICAS))
        assert policy._busy_reports.num_counting == (len(REPLICAS) - 1 if from_reports else 0)  # noqa: SLF001
        firsts[from_reports] = [policy.rank(request(100 + seed))[0] for seed in range(40)]
    assert firsts[True] == firsts[False]


def test_one_router_reads_its_own_spans_whatever_the_counters_say():
    """RouterShare reads one router: decisions are those of a router that
    never reads the counters, even when the counters disagree with it."""
    chosen = {}
    for from_reports in (True, False):
        clock = Clock()
        policy = make_policy(clock, busy_from_reports=from_reports)
        with_history(clock, policy, 32 * 16 // len(REPLICAS))
        assert policy._routers_seen(clock.now) == 1.0  # noqa: SLF001
        clock.now += 2.0
        summaries(policy, 3, {r: 1.0 + 3.0 * i for i, r in enumerate(REPLICAS)}, 32 * 16 // len(REPLICAS))
        chosen[from_reports] = [policy.rank(request(100 + seed))[0] for seed in range(40)]
    assert chosen[True] == chosen[False]


def test_routing_status_says_what_the_router_reads():
    """The operator's view (the Ingress's /stats): before any report the
    router reads one router and its own spans; with four routers' worth of
    outputs and every counter moved it reads the replicas' counters; with
    the busy share off it says so."""
    clock = Clock()
    policy = make_policy(clock)
    status = policy.routing_status()
    assert status["replicas"] == len(REPLICAS) and status["replicas_reporting"] == 0
    assert status["routers_seen"] == 1.0 and status["balance_busy_source"] == "own_spans"
    assert status["index_blocks"] == 0 and status["in_flight"] == 0 and status["token_costs_measured"] is False
    with_history(clock, policy, 4 * 32 * 16 // len(REPLICAS))
    req = request(999)
    policy.on_routed(req, policy.rank(req)[0], "999")  # in flight, its blocks learned
    status = policy.routing_status()
    assert status["replicas_reporting"] == len(REPLICAS) and status["in_flight"] == 1
    assert status["index_blocks"] >= len(req.block_hashes)
    assert status["routers_seen"] == pytest.approx(4.0, rel=0.05)
    assert status["balance_busy_source"] == "replica_counters"
    assert status == json.loads(json.dumps(status))  # plain JSON values
    assert make_policy(Clock(), balance_busy_share=0.0).routing_status()["balance_busy_source"] == "off"


def test_config_checks_the_reported_busy_knobs():
    with pytest.raises(ValueError):
        PolicyConfig(busy_from_reports=1)
    with pytest.raises(ValueError):
        PolicyConfig(reported_busy_share=1.5)
    with pytest.raises(ValueError):
        ReportedBusy(0.0)
