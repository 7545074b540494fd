"""A LoadTracker's recent-work parts read exactly what a tracker of their
own, fed the same bookings, would read (what QueuePricedWork kept before:
two trackers mirroring every booking)."""

import random

import pytest

from router.load import LoadTracker
from router.policy_config import PolicyConfig
from router.queue_priced import QueuePricedWork
from router.recent_parts import RecentParts


@pytest.mark.parametrize("seed", range(6))
def test_parts_read_what_trackers_of_their_own_would_read(seed):
    """Reservations (confirmed, refreshed, moved, lapsed), completions, lost
    completions, rebases, a cleared window, joins and leaves: after each step
    every part's total and per-replica view equal, float for float, those of
    a plain tracker booked with that part alone."""
    rng = random.Random(seed)
    window, names = 10.0, ["a", "b", "c", "d"]
    kwargs = dict(in_flight_timeout_s=60.0, window_s=window, reservation_timeout_s=2.0)
    main = LoadTracker(**kwargs, num_parts=2)
    mirrors = [LoadTracker(**kwargs), LoadTracker(**kwargs)]
    trackers = [main, *mirrors]
    for name in names[:3]:
        for tracker in trackers:
            tracker.add_replica(name)
    now, ids = 0.0, []
    for step in range(600):
        now += rng.choice([0.0, 0.1, 0.5, 3.0, 30.0])  # 30 s steps: a rebase within ~17 of them
        action, replica, request_id = rng.random(), rng.choice(names), f"q{rng.randrange(40)}"
        if action < 0.45:
            parts = (float(rng.randint(0, 400)), float(rng.randint(0, 90)))
            reserve = rng.random() < 0.6
            main_add = main.reserve if reserve else main.on_routed
            main_add(request_id, replica, parts[0] + 2 * parts[1], now, parts[0] + 3 * parts[1], parts)
            for mirror, value in zip(mirrors, parts):
                (mirror.reserve if reserve else mirror.on_routed)(request_id, replica, value, now)
            ids.append(request_id)
        elif action < 0.6 and ids:
            request_id = rng.choice(ids)
            for tracker in trackers:
                tracker.confirm(request_id, replica)
                tracker.refresh(request_id, replica, now)
        elif action < 0.85 and ids:
            request_id = ids.pop(rng.randrange(len(ids)))
            main.on_completed(request_id, now)
            for mirror in mirrors:
                mirror.on_completed(request_id)
        elif action < 0.9:
            for tracker in trackers:
                tracker.forget_recent()
        elif action < 0.95:
            for tracker in trackers:
                tracker.remove_replica("d")
        else:
            for tracker in trackers:
                tracker.add_replica("d")
        main.check_invariants()
        decay = main.decay(now)
        for part, mirror in enumerate(mirrors):
            assert main.parts.total(part, decay) == mirror.recent_total(now), (step, part)
            view, mirror_view = main.parts.view(part, decay), mirror.recent_view(now)
            assert [view(r) for r in names] == [mirror_view(r) for r in names], (step, part)


def test_a_booking_with_the_wrong_number_of_parts_is_refused():
    with_parts, without = LoadTracker(num_parts=2), LoadTracker()
    with_parts.on_routed("q1", "a", 10.0, 0.0)  # no parts: they count 0
    assert with_parts.parts.total(0, with_parts.decay(0.0)) == 0.0
    with pytest.raises(ValueError):
        with_parts.on_routed("q2", "a", 10.0, 0.0, parts=(1.0,))
    with pytest.raises(ValueError):
        without.on_routed("q3", "a", 10.0, 0.0, parts=(1.0, 2.0))
    with pytest.raises(ValueError):
        RecentParts(0)


def test_the_queue_priced_measure_needs_a_tracker_with_its_two_parts():
    kept, not_kept = PolicyConfig(), PolicyConfig(balance_output_price="busy")
    assert QueuePricedWork.keeps(kept) and not QueuePricedWork.keeps(not_kept)
    with pytest.raises(ValueError):
        QueuePricedWork(kept, LoadTracker())
    with pytest.raises(ValueError):
        QueuePricedWork(not_kept, LoadTracker(num_parts=2))
    measure = QueuePricedWork(kept, LoadTracker(num_parts=2))
    assert measure.parts(100.0, 7.0) == (100.0, 7.0)
    assert QueuePricedWork(not_kept, LoadTracker()).parts(100.0, 7.0) == ()
