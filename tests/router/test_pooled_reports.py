"""PooledReports: each replica's last reports, pooled into medians."""

import statistics

import pytest

from router.pooled_reports import PooledReports


def test_the_medians_pool_every_replicas_last_reports():
    pooled = PooledReports(history=2)
    assert pooled.medians() is None
    pooled.add("a", 1.0, 10.0)
    assert pooled.medians() == (1.0, 10.0)
    pooled.add("b", 3.0, 30.0)
    pooled.add("b", 5.0, 50.0)
    assert pooled.medians() == (3.0, 30.0)  # a: [1], b: [3, 5]
    pooled.add("b", 7.0, 70.0)  # b keeps its last 2: [5, 7]
    assert pooled.medians() == (5.0, 50.0)
    pooled.check_invariants({"a", "b"}, lambda x, y: y == 10 * x, "pairs")


def test_a_removed_replica_no_longer_counts():
    pooled = PooledReports(history=4)
    pooled.add("a", 1.0, 2.0)
    pooled.add("b", 9.0, 8.0)
    assert pooled.remove("b") is True
    assert pooled.remove("b") is False
    assert pooled.medians() == (1.0, 2.0)
    assert pooled.remove("a") is True and pooled.medians() is None


def test_the_medians_match_a_naive_pool():
    pooled, naive = PooledReports(history=3), {}
    for i in range(40):
        replica_id = f"r{i % 4}"
        pooled.add(replica_id, float(i), float(i * i % 7))
        naive[replica_id] = (naive.get(replica_id, []) + [(float(i), float(i * i % 7))])[-3:]
        reports = [r for history in naive.values() for r in history]
        expected = statistics.median(a for a, _ in reports), statistics.median(b for _, b in reports)
        assert pooled.medians() == expected


def test_the_invariant_check_catches_a_replica_off_the_ring_and_a_bad_report():
    pooled = PooledReports(history=2)
    pooled.add("gone", 1.0, 1.0)
    with pytest.raises(AssertionError):
        pooled.check_invariants({"a"}, lambda x, y: True, "pairs")
    with pytest.raises(AssertionError):
        pooled.check_invariants({"gone"}, lambda x, y: x > 1, "pairs")


@pytest.mark.parametrize("history", [0, -1, 1.5, True])
def test_history_must_be_a_positive_int(history):
    with pytest.raises(ValueError):
        PooledReports(history)
