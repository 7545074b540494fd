"""router.LoadTracker: own in-flight work, foreign work from reports, recent work, least loaded."""

import math
import random

import pytest

from router import LoadTracker


def test_in_flight_work_counts_until_completed():
    loads = LoadTracker()
    loads.on_routed("q1", "a", 100.0, now=0.0)
    loads.on_routed("q2", "a", 50.0, now=0.0)
    loads.on_routed("q3", "b", 10.0, now=0.0)
    loads.check_invariants()
    assert (loads.load("a"), loads.load("b"), loads.total) == (150.0, 10.0, 160.0)
    assert loads.on_completed("q1") and not loads.on_completed("q1")
    loads.check_invariants()
    assert (loads.load("a"), loads.total) == (50.0, 60.0)


def test_reports_add_only_what_other_routers_put_there():
    loads = LoadTracker()
    loads.on_routed("q1", "a", 100.0, now=0.0)
    loads.on_report("a", 250.0)  # 150 from elsewhere
    assert loads.load("a") == 250.0
    loads.on_report("a", 80.0)  # less than ours in flight: nothing foreign
    assert loads.load("a") == 100.0
    loads.check_invariants()


def test_least_loaded_prefers_the_least_recent_work_among_equal_loads():
    loads = LoadTracker(window_s=10.0)
    for replica in ("a", "b", "c"):
        loads.add_replica(replica)
    loads.on_routed("q1", "a", 100.0, now=0.0)
    loads.on_routed("q2", "b", 40.0, now=0.0)
    loads.on_completed("q1")
    loads.on_completed("q2")
    assert loads.least_loaded_replica() == "c"  # all idle; c did the least lately
    loads.on_routed("q3", "c", 500.0, now=1.0)
    assert loads.least_loaded_replica() == "b"  # idle, and less recent work than a
    loads.on_completed("q3")
    assert loads.least_loaded_replica() == "b"  # c is idle again but did 500 lately
    loads.check_invariants()


def test_recent_work_decays_with_the_window():
    loads = LoadTracker(window_s=10.0)
    loads.on_routed("q1", "a", 100.0, now=0.0)
    assert loads.recent_work("a", 0.0) == pytest.approx(100.0)
    assert loads.recent_work("a", 10.0) == pytest.approx(100.0 / math.e)
    assert loads.recent_total(10.0) == pytest.approx(100.0 / math.e)
    assert loads.recent_work("unknown", 10.0) == 0.0


def test_recent_work_survives_a_rebase():
    loads = LoadTracker(window_s=1.0)
    loads.on_routed("q1", "a", 100.0, now=0.0)
    loads.on_routed("q2", "b", 100.0, now=60.0)  # past 50 windows: rescaled
    loads.check_invariants()
    assert loads.recent_work("b", 61.0) == pytest.approx(100.0 / math.e)
    assert loads.recent_work("a", 61.0) == pytest.approx(100.0 * math.exp(-61.0), abs=1e-12)


def test_lost_completions_expire():
    loads = LoadTracker(in_flight_timeout_s=30.0)
    loads.on_routed("q1", "a", 100.0, now=0.0)
    loads.on_routed("q2", "a", 5.0, now=40.0)  # q1 is older than 30 s: dropped
    assert loads.load("a") == 5.0 and loads.num_in_flight() == 1
    loads.check_invariants()


def test_remove_replica_drops_its_work():
    loads = LoadTracker()
    loads.on_routed("q1", "a", 100.0, now=0.0)
    loads.on_routed("q2", "b", 7.0, now=0.0)
    loads.remove_replica("a")
    loads.check_invariants()
    assert loads.total == 7.0 and "a" not in loads and loads.least_loaded_replica() == "b"
    assert not loads.on_completed("q1")


@pytest.mark.parametrize("kwargs", [{"in_flight_timeout_s": 0}, {"window_s": -1.0}])
def test_bad_config(kwargs):
    with pytest.raises(ValueError):
        LoadTracker(**kwargs)


def test_negative_work_is_rejected():
    with pytest.raises(ValueError, match="num_tokens"):
        LoadTracker().on_routed("q", "a", -1.0, now=0.0)
    with pytest.raises(ValueError, match="load_tokens"):
        LoadTracker().on_report("a", float("nan"))


def test_randomized_against_a_naive_reference():
    rng = random.Random(3)
    loads = LoadTracker(window_s=5.0)
    in_flight: dict[str, tuple[str, float]] = {}
    now = 0.0
    for step in range(500):
        now += rng.random()
        if rng.random() < 0.6 or not in_flight:
            replica = rng.choice("abcde")
            work = float(rng.randrange(1, 1000))
            loads.on_routed(f"q{step}", replica, work, now)
            in_flight[f"q{step}"] = (replica, work)
        else:
            request_id = rng.choice(sorted(in_flight))
            loads.on_completed(request_id)
            del in_flight[request_id]
        loads.check_invariants()
        expected = {r: 0.0 for r in loads.replica_ids}
        for replica, work in in_flight.values():
            expected[replica] += work
        assert {r: loads.load(r) for r in expected} == pytest.approx(expected)
        lowest = min(expected.values())
        assert expected[loads.least_loaded_replica()] == pytest.approx(lowest)
