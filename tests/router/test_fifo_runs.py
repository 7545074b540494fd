"""The PrefixIndex recency FIFO's runs: splitting, and popping the least recent current items."""

import random
from collections import deque

import pytest

from router.fifo_runs import RUN_LIMIT, fifo_items, fifo_runs, pop_least_recent, reported_runs


def test_reported_runs_keep_the_order_in_runs_of_at_most_the_limit():
    hashes = list(range(1000, 1000 + 2 * RUN_LIMIT + 3))
    runs = reported_runs(hashes)
    assert [len(run) for _, run in runs] == [RUN_LIMIT, RUN_LIMIT, 3]
    assert all(tick == 0 for tick, _ in runs)
    assert [h for _, h in fifo_items(runs)] == hashes


def test_fifo_runs_split_at_the_limit_and_where_the_tick_changes():
    items = [(0, 7), (0, 8), (0, 9), (5, 1), (5, 2), (5, 3), (6, 4), (9, 5)]
    assert list(fifo_runs(items)) == [(0, (7, 8, 9)), (5, (1, 2, 3)), (6, (4,)), (9, (5,))]
    assert list(fifo_runs(items, max_length=2)) == [(0, (7, 8)), (0, (9,)), (5, (1, 2)), (5, (3,)), (6, (4,)),
                                                    (9, (5,))]
    assert list(fifo_items(fifo_runs(items, max_length=2))) == items


def _naive_pop(items: list[tuple[int, int]], entries: dict[int, int], count: int):
    """The reference: walk the items, take each current entry once (at its
    first current item) until ``count``, drop stale ones on the way."""
    taken, position = [], 0
    while len(taken) < count:
        tick, block_hash = items[position]
        position += 1
        if entries.get(block_hash) == tick and block_hash not in taken:
            taken.append(block_hash)
    rest = items[position:]
    return taken, rest


@pytest.mark.parametrize("seed", range(30))
def test_pop_least_recent_matches_a_walk_over_the_items(seed):
    """Random FIFOs of learned runs (one tick each, ascending) and reported runs
    (tick 0, a hash sometimes in several: deleted by a summary, reported
    again), with entries that moved on (stale items): the hashes taken, the
    entries left, the items left and the popped count all match a plain walk."""
    rng = random.Random(seed)
    runs, entries, tick = [], {}, 1
    for _ in range(rng.randrange(1, 12)):
        hashes = rng.sample(range(200), rng.randrange(1, 20))
        if rng.random() < 0.3:
            runs.append((0, tuple(hashes)))
            for block_hash in hashes:
                entries[block_hash] = 0
        else:
            runs.append((tick, tuple(hashes)))
            for block_hash in hashes:
                entries[block_hash] = tick
            tick += 1
    for block_hash in rng.sample(sorted(entries), len(entries) // 5):  # some entries left the index
        del entries[block_hash]
    items = list(fifo_items(runs))
    num_current = len({h for t, h in items if entries.get(h) == t})
    if not num_current:
        return
    count = rng.randrange(1, num_current + 1)
    expected_taken, expected_rest = _naive_pop(items, entries, count)
    expected_entries = {h: t for h, t in entries.items() if h not in expected_taken}
    fifo = deque(runs)
    taken, num_popped = pop_least_recent(fifo, entries, count)
    assert taken == expected_taken
    assert entries == expected_entries  # each taken entry deleted, once
    assert list(fifo_items(fifo)) == expected_rest  # from just after the count-th current item on
    assert num_popped == len(items) - len(expected_rest)
    assert all(run for _, run in fifo)


def test_pop_least_recent_takes_a_hash_with_two_current_looking_items_once():
    """A reported block deleted by a summary keeps its queued item; reported
    again, it gets a second tick-0 item: both look current. It is taken once."""
    entries = {13: 0, 12: 0, 11: 0}
    fifo = deque([(0, (13,)), (0, (13, 12, 11))])
    taken, num_popped = pop_least_recent(fifo, entries, 2)
    assert taken == [13, 12]
    assert entries == {11: 0}
    assert list(fifo_items(fifo)) == [(0, 11)]
    assert num_popped == 3
