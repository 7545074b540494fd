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


def test_another_routers_decision_is_foreign_work_until_the_next_report():
    loads = LoadTracker()
    loads.on_routed("q1", "a", 100.0, now=0.0)
    loads.on_report("a", 150.0)  # 50 from elsewhere
    loads.add_foreign("a", 30.0)  # a shared decision since
    loads.add_foreign("gone", 30.0)  # a replica it does not know: nothing
    assert (loads.load("a"), loads.foreign("a"), loads.total) == (180.0, 80.0, 180.0)
    loads.check_invariants()
    loads.on_report("a", 120.0)  # the report carries what still waits: it replaces the guess
    assert (loads.load("a"), loads.total) == (120.0, 120.0)
    loads.check_invariants()
    with pytest.raises(ValueError, match="num_tokens"):
        loads.add_foreign("a", -1.0)


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


def test_a_reservation_counts_at_once_and_confirming_it_counts_nothing_more():
    loads = LoadTracker(window_s=10.0)
    loads.add_replica("b")
    loads.reserve("q1", "a", 100.0, now=0.0)
    assert (loads.load("a"), loads.recent_work("a", 0.0), loads.num_reserved()) == (100.0, pytest.approx(100.0), 1)
    assert loads.least_loaded_replica() == "b"
    assert not loads.confirm("q1", "b") and not loads.confirm("q2", "a")  # elsewhere / unknown: no change
    assert loads.confirm("q1", "a") and not loads.confirm("q1", "a")
    loads.check_invariants()
    assert (loads.load("a"), loads.num_reserved(), loads.num_in_flight()) == (100.0, 0, 1)
    assert loads.recent_work("a", 0.0) == pytest.approx(100.0)
    assert loads.on_completed("q1") and loads.load("a") == 0.0


def test_routed_elsewhere_replaces_the_reservation_queued_and_recent_work():
    loads = LoadTracker(window_s=10.0)
    loads.reserve("q1", "a", 100.0, now=0.0)
    loads.on_routed("q1", "b", 60.0, now=1.0)
    loads.check_invariants()
    assert (loads.load("a"), loads.load("b"), loads.num_reserved()) == (0.0, 60.0, 0)
    assert loads.recent_work("a", 1.0) == pytest.approx(0.0, abs=1e-9)
    assert loads.recent_work("b", 1.0) == pytest.approx(60.0)
    assert loads.recent_total(1.0) == pytest.approx(60.0)


def test_an_unconfirmed_reservation_is_forgotten_after_its_timeout():
    loads = LoadTracker(window_s=10.0, reservation_timeout_s=5.0)
    loads.reserve("cancelled", "a", 100.0, now=0.0)
    loads.reserve("sent", "a", 30.0, now=0.0)
    assert loads.confirm("sent", "a")
    loads.reserve("waiting", "b", 20.0, now=0.0)
    assert loads.refresh("waiting", "b", now=4.0)  # asked again: its timeout restarts
    assert not loads.refresh("sent", "a", now=4.0)  # confirmed: nothing to refresh
    loads.on_routed("q", "c", 1.0, now=6.0)  # any update expires what is due
    loads.check_invariants()
    assert loads.load("a") == 30.0 and loads.recent_work("a", 6.0) == pytest.approx(30.0 * math.exp(-0.6))
    assert loads.load("b") == 20.0 and loads.num_reserved() == 1
    loads.on_routed("q2", "c", 1.0, now=9.5)
    assert loads.load("b") == 0.0 and loads.recent_work("b", 9.5) == pytest.approx(0.0, abs=1e-9)
    assert not loads.on_completed("waiting")
    loads.check_invariants()


def test_chance_sd_is_the_spread_of_a_uniformly_random_assignment():
    loads = LoadTracker(window_s=10.0)
    assert loads.chance_sd(0.0) == 0.0
    loads.on_routed("q1", "a", 300.0, now=0.0)
    assert loads.chance_sd(0.0) == 0.0  # one replica: nothing to compare
    loads.add_replica("b")
    loads.on_routed("q2", "b", 400.0, now=0.0)
    # Var = sum(w^2) * (1/N) * (1 - 1/N) with N = 2: (9e4 + 16e4) / 4
    assert loads.chance_sd(0.0) == pytest.approx(250.0)
    assert loads.chance_sd(10.0) == pytest.approx(250.0 / math.e)  # weights decay: d^2 w^2
    loads.add_replica("c")
    assert loads.chance_sd(0.0) == pytest.approx(math.sqrt(25e4 * 2) / 3)
    loads.remove_replica("b")
    loads.check_invariants()
    assert loads.chance_sd(0.0) == pytest.approx(300.0 / 2)


@pytest.mark.parametrize("kwargs", [{"in_flight_timeout_s": 0}, {"window_s": -1.0}, {"reservation_timeout_s": 0}])
def test_bad_config(kwargs):
    with pytest.raises(ValueError):
        LoadTracker(**kwargs)


def test_negative_work_is_rejected():
    with pytest.raises(ValueError, match="num_tokens"):
        LoadTracker().on_routed("q", "a", -1.0, now=0.0)
    with pytest.raises(ValueError, match="load_tokens"):
        LoadTracker().on_report("a", float("nan"))


def test_randomized_reservations_against_a_naive_reference():
    """Reserve, confirm, move, complete and let reservations expire at random;
    queued work, recent work and the chance spread match a direct computation."""
    rng = random.Random(5)
    window_s, timeout_s = 5.0, 3.0
    loads = LoadTracker(window_s=window_s, reservation_timeout_s=timeout_s)
    for replica in "abcd":
        loads.add_replica(replica)
    live: dict[str, tuple[str, float, float, float | None]] = {}  # id -> replica, work, at, reserved at
    counted: dict[str, tuple[str, float, float]] = {}  # everything routed and not forgotten
    now = 0.0
    for step in range(600):
        now += rng.random() * 0.5
        action = rng.random()
        request_id = f"q{step}"
        if action < 0.55 or not live:  # route or reserve (both expire due reservations first)
            for old_id, (_, _, _, reserved_at) in list(live.items()):
                if reserved_at is not None and reserved_at <= now - timeout_s:
                    del live[old_id], counted[old_id]
            replica, work = rng.choice("abcd"), float(rng.randrange(1, 1000))
            if action < 0.3:
                loads.reserve(request_id, replica, work, now)
            else:
                loads.on_routed(request_id, replica, work, now)
            live[request_id] = (replica, work, now, now if action < 0.3 else None)
            counted[request_id] = (replica, work, now)
        else:
            request_id = rng.choice(sorted(live))
            replica, work, at, reserved_at = live[request_id]
            if action < 0.7 and reserved_at is not None:
                assert loads.confirm(request_id, replica)
                live[request_id] = (replica, work, at, None)
            elif action < 0.8 and reserved_at is not None:  # it went elsewhere
                for old_id, (_, _, _, old_reserved) in list(live.items()):
                    if old_id != request_id and old_reserved is not None and old_reserved <= now - timeout_s:
                        del live[old_id], counted[old_id]
                other = rng.choice([r for r in "abcd" if r != replica])
                loads.on_routed(request_id, other, work / 2, now)
                live[request_id] = (other, work / 2, now, None)
                counted[request_id] = (other, work / 2, now)
            else:
                loads.on_completed(request_id)
                del live[request_id]
        loads.check_invariants()
        queued = {r: sum(w for (rr, w, _, _) in live.values() if rr == r) for r in "abcd"}
        assert {r: loads.load(r) for r in "abcd"} == pytest.approx(queued, abs=1e-6)
        recent = {r: sum(w * math.exp((t - now) / window_s) for (rr, w, t) in counted.values() if rr == r)
                  for r in "abcd"}
        assert {r: loads.recent_work(r, now) for r in "abcd"} == pytest.approx(recent, rel=1e-6, abs=1e-6)
        squares = sum((w * math.exp((t - now) / window_s)) ** 2 for (_, w, t) in counted.values())
        assert loads.chance_sd(now) == pytest.approx(math.sqrt(squares * 3) / 4, rel=1e-6, abs=1e-6)


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


def test_a_joining_replica_starts_at_the_mean_recent_work():
    loads = LoadTracker(window_s=10.0)
    for replica in ("a", "b"):
        loads.add_replica(replica)
    loads.on_routed("q1", "a", 300.0, now=0.0)
    loads.on_routed("q2", "b", 100.0, now=0.0)
    loads.on_completed("q1")
    loads.on_completed("q2")
    loads.add_replica("c")  # e.g. Serve's replacement for a dead replica
    loads.check_invariants()
    assert loads.recent_work("c", 0.0) == pytest.approx(200.0)
    assert loads.recent_total(0.0) == pytest.approx(600.0)  # the mean is unchanged: 200
    assert loads.least_loaded_replica() == "b"  # all idle: b did less than the newcomer's share
    assert loads.chance_sd(0.0) == pytest.approx(math.sqrt((300.0**2 + 100.0**2) * 2) / 3)


def test_a_replica_that_leaves_and_joins_again_has_no_stale_least_loaded_entry():
    loads = LoadTracker()
    for replica in ("a", "b"):
        loads.add_replica(replica)
    assert loads.least_loaded_replica() == "a"  # the least-loaded entries are kept from here on
    loads.on_routed("q1", "a", 50.0, now=0.0)
    loads.on_routed("q2", "b", 10.0, now=0.0)
    loads.on_completed("q2")
    loads.remove_replica("a")  # a's entries had versions 1 and 2
    loads.add_replica("a")  # version 1 again: an old (50 tokens, version 1) entry must not look current
    loads.on_routed("q3", "a", 5.0, now=0.0)  # version 2 again
    loads.check_invariants()
    assert loads.load("a") == 5.0 and loads.least_loaded_replica() == "b"
    loads.on_routed("q4", "b", 20.0, now=0.0)
    assert loads.least_loaded_replica() == "a"


@pytest.mark.parametrize("first_ask", [0, 37, 150, 299])
def test_least_loaded_entries_built_at_the_first_ask_answer_as_ones_kept_all_along(first_ask):
    """Invariant 4: a tracker that keeps no least-loaded entries until asked (as the
    queue-priced trackers, never asked) answers from then on exactly as one
    asked at every step, ties between equal loads and equal recent work
    included, through joins, leaves, rebases and forgotten windows."""
    rng = random.Random(first_ask)
    always, lazy = LoadTracker(window_s=10.0), LoadTracker(window_s=10.0)
    replicas = list("abcdef")
    for replica in replicas:
        always.add_replica(replica)
        lazy.add_replica(replica)
    in_flight: list[str] = []
    now = 0.0
    for step in range(300):
        now += rng.choice([0.0, 0.0, 0.3, 7.0])  # equal times make equal recent work; ~500 s: a rebase
        action, replica = rng.random(), rng.choice(replicas)
        for tracker in (always, lazy):
            if action < 0.5 or not in_flight:
                tracker.on_routed(f"q{step}", replica, float(step % 3) * 10, now)
            elif action < 0.85:
                tracker.on_completed(in_flight[0], now)
            elif action < 0.9:
                tracker.forget_recent()
            elif action < 0.95:
                tracker.remove_replica("f")
            else:
                tracker.add_replica("f")
        if action < 0.5 or not in_flight:
            in_flight.append(f"q{step}")
        elif action < 0.85:
            in_flight.pop(0)
        always.check_invariants()
        lazy.check_invariants()
        expected = always.least_loaded_replica()
        if step < first_ask:
            assert lazy._least is None, "least-loaded entries kept before the first ask"
        else:
            assert lazy.least_loaded_replica() == expected, step


def test_forget_recent_clears_the_window_and_keeps_queued_work():
    tracker = LoadTracker(window_s=10.0)
    for replica_id in ("a", "b"):
        tracker.add_replica(replica_id)
    tracker.reserve("x", "a", 100.0, 0.0)
    tracker.on_routed("y", "b", 50.0, 0.0)
    tracker.on_completed("y")
    tracker.forget_recent()
    assert tracker.recent_work("a", 1.0) == tracker.recent_work("b", 1.0) == 0.0 == tracker.chance_sd(1.0)
    assert tracker.load("a") == 100.0 and tracker.load("b") == 0.0
    tracker.on_routed("z", "b", 30.0, 1.0)
    tracker.expire(100.0)  # "x" was never confirmed: forgetting it subtracts nothing from what came after
    assert tracker.recent_work("b", 1.0) == pytest.approx(30.0)
    assert tracker.recent_work("a", 1.0) == 0.0 and tracker.load("a") == 0.0
    tracker.check_invariants()


def test_a_report_never_puts_foreign_work_below_the_peers_work_it_may_undercount():
    loads = LoadTracker()
    loads.add_replica("a")
    loads.on_routed("mine", "a", 30.0, now=0.0)
    loads.on_report("a", 50.0)
    assert loads.foreign("a") == 20.0
    loads.on_report("a", 50.0, peer_tokens=400.0)  # a peer's prefill the report prices at nothing
    assert loads.foreign("a") == 400.0 and loads.load("a") == 430.0 and loads.total == 430.0
    loads.on_report("a", 500.0, peer_tokens=400.0)
    assert loads.foreign("a") == 470.0
    assert loads.num_in_flight_at("a") == 1 and loads.num_in_flight_at("b") == 0
    loads.check_invariants()
