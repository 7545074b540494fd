"""router.busy_spans.BusySpans: each replica's recent busy time, the union of
its in-flight spans, decayed; and LoadTracker's view of it."""

import math
import random

import pytest

from router import LoadTracker
from router.busy_spans import BusySpans

W = 10.0


def _busy_between(start: float, end: float, now: float) -> float:
    """∫ exp(-(now - t) / W) dt over [start, end]."""
    return W * (math.exp((end - now) / W) - math.exp((start - now) / W))


def test_one_span_accrues_and_then_decays():
    spans = BusySpans(W)
    spans.start("a", 0.0)
    assert spans.busy_s("a", 0.0) == 0.0
    assert spans.busy_s("a", 5.0) == pytest.approx(_busy_between(0.0, 5.0, 5.0))
    spans.stop("a", 5.0)
    assert spans.busy_s("a", 15.0) == pytest.approx(_busy_between(0.0, 5.0, 15.0))
    assert spans.busy_s("a", 15.0) == pytest.approx(W * (1 - math.exp(-0.5)) * math.exp(-1.0))
    spans.check_invariants()


def test_overlapping_requests_count_once_and_sequential_ones_twice():
    overlapped, sequential = BusySpans(W), BusySpans(W)
    overlapped.start("a", 0.0)
    overlapped.start("a", 0.0)
    overlapped.stop("a", 2.0)
    overlapped.stop("a", 2.0)
    sequential.start("a", 0.0)
    sequential.stop("a", 2.0)
    sequential.start("a", 2.0)
    sequential.stop("a", 4.0)
    assert overlapped.busy_s("a", 4.0) == pytest.approx(_busy_between(0.0, 2.0, 4.0))
    assert sequential.busy_s("a", 4.0) == pytest.approx(_busy_between(0.0, 4.0, 4.0))
    assert overlapped.num_in_flight("a") == sequential.num_in_flight("a") == 0
    for spans in (overlapped, sequential):
        spans.check_invariants()


def test_the_mean_and_the_view_agree_with_each_replica():
    spans = BusySpans(W)
    for replica in "abc":
        spans.add_replica(replica, 0.0)
    spans.start("a", 0.0)
    spans.start("b", 1.0)
    spans.stop("b", 3.0)
    view, mean = spans.view(6.0)
    values = [spans.busy_s(r, 6.0) for r in "abc"]
    assert [view(r) for r in "abc"] == pytest.approx(values)
    assert values[2] == 0.0 and view("unknown") == 0.0
    assert spans.mean_busy_s(6.0) == pytest.approx(sum(values) / 3) == pytest.approx(mean)
    spans.check_invariants()


def test_a_joining_replica_starts_at_the_mean_and_a_leaving_one_is_forgotten():
    spans = BusySpans(W)
    spans.start("a", 0.0)
    spans.add_replica("b", 0.0)
    spans.stop("a", 4.0)
    spans.add_replica("c", 4.0)  # mean of a and b at 4 s
    expected = (_busy_between(0.0, 4.0, 4.0) + 0.0) / 2
    assert spans.busy_s("c", 4.0) == pytest.approx(expected)
    spans.remove_replica("a")
    assert "a" not in spans and spans.busy_s("a", 4.0) == 0.0
    assert spans.mean_busy_s(4.0) == pytest.approx(expected / 2)
    spans.stop("a", 5.0)  # unknown: ignored
    spans.stop("b", 5.0)  # nothing in flight: ignored
    spans.check_invariants()


def test_values_survive_a_rebase():
    spans = BusySpans(1.0)
    spans.add_replica("b", 0.0)
    spans.start("a", 0.0)
    spans.start("b", 100.0)  # past 50 windows: rescaled
    spans.stop("a", 101.0)
    assert spans.busy_s("a", 101.0) == pytest.approx(1.0)  # busy for 101 windows: saturated at W
    assert spans.busy_s("b", 101.0) == pytest.approx(1 - math.exp(-1.0))
    spans.check_invariants()


def test_bad_window():
    with pytest.raises(ValueError):
        BusySpans(0.0)


def test_randomized_against_a_naive_integral():
    rng = random.Random(7)
    spans = BusySpans(W)
    in_flight = {r: 0 for r in "abcd"}
    intervals: dict[str, list[list[float]]] = {r: [] for r in "abcd"}  # [start, end or None]
    for replica in "abcd":
        spans.add_replica(replica, 0.0)
    now = 0.0
    for _ in range(400):
        now += rng.random()
        replica = rng.choice("abcd")
        if rng.random() < 0.55 or not in_flight[replica]:
            if not in_flight[replica]:
                intervals[replica].append([now, None])
            in_flight[replica] += 1
            spans.start(replica, now)
        else:
            in_flight[replica] -= 1
            if not in_flight[replica]:
                intervals[replica][-1][1] = now
            spans.stop(replica, now)
        spans.check_invariants()
        expected = {r: sum(_busy_between(s, now if e is None else e, now) for s, e in intervals[r]) for r in "abcd"}
        assert {r: spans.busy_s(r, now) for r in "abcd"} == pytest.approx(expected, rel=1e-9, abs=1e-9)
        assert spans.mean_busy_s(now) == pytest.approx(sum(expected.values()) / 4, rel=1e-9, abs=1e-9)


def test_load_tracker_busy_spans_follow_its_in_flight_requests():
    loads = LoadTracker(window_s=W, reservation_timeout_s=5.0, track_busy=True)
    for replica in "ab":
        loads.add_replica(replica)
    loads.reserve("q1", "a", 10.0, now=0.0)
    loads.on_routed("q1", "b", 10.0, now=1.0)  # sent elsewhere: a's span ends, b's begins
    loads.reserve("q2", "a", 10.0, now=2.0)  # never confirmed: its span ends when it lapsed, at 7 s
    loads.on_routed("q3", "b", 10.0, now=9.0)
    assert loads.on_completed("q1", now=10.0)
    loads.check_invariants()
    view, mean = loads.busy_view(12.0)
    a = _busy_between(0.0, 1.0, 12.0) + _busy_between(2.0, 7.0, 12.0)
    b = _busy_between(1.0, 12.0, 12.0)  # q1, then q3 still in flight
    assert (view("a"), view("b")) == pytest.approx((a, b))
    assert mean == pytest.approx((a + b) / 2)
    assert LoadTracker().busy_view(0.0) is None  # not tracked unless asked


def test_a_lost_completion_ends_its_span_at_the_timeout():
    loads = LoadTracker(window_s=W, in_flight_timeout_s=30.0, track_busy=True)
    loads.on_routed("q1", "a", 10.0, now=0.0)
    loads.on_routed("q2", "b", 10.0, now=40.0)  # q1 lost: dropped, busy until 30 s
    loads.check_invariants()
    view, _ = loads.busy_view(40.0)
    assert view("a") == pytest.approx(_busy_between(0.0, 30.0, 40.0))


def test_load_tracker_ends_a_span_without_a_time_at_the_latest_update():
    loads = LoadTracker(window_s=W, track_busy=True)
    loads.on_routed("q1", "a", 10.0, now=0.0)
    loads.on_routed("q2", "b", 10.0, now=3.0)
    loads.on_completed("q1")  # no time given: the latest update's, 3 s
    loads.remove_replica("b")
    loads.check_invariants()
    view, mean = loads.busy_view(3.0)
    assert view("a") == pytest.approx(_busy_between(0.0, 3.0, 3.0)) == pytest.approx(mean)
