"""Summary streams: snapshots + deltas on the wire, applied by the policy; restarts."""

import pytest

from cache.summary import CacheSummary, SummaryStream
from router import PolicyConfig, PrefixAffinityPolicy, RoutingRequest

BLOCK = 4


def full(version, hashes, replica_id="r0"):
    return CacheSummary(replica_id, version, float(version), BLOCK, frozenset(hashes))


def make_policy(clock):
    policy = PrefixAffinityPolicy(PolicyConfig(block_size=BLOCK, learned_grace_s=5.0), clock=clock)
    policy.set_replicas(["r0", "r1"])
    return policy


@pytest.mark.parametrize("cumulative", [False, True])
def test_deltas_rebuild_the_full_set_through_the_wire(cumulative):
    stream = SummaryStream("r0@1", max_periods=10, cumulative=cumulative)
    states = [set(range(100)), set(range(5, 103)), set(range(5, 103)) - {50}, set(range(10, 110))]
    sent = [CacheSummary.from_dict(stream.encode(full(v + 1, s)).to_dict()) for v, s in enumerate(states)]
    assert not sent[0].is_delta and all(s.is_delta for s in sent[1:])
    assert sum(len(s.block_hashes) + len(s.removed_hashes) for s in sent[1:]) < 60
    now = [0.0]
    policy = make_policy(lambda: now[0])
    for summary, state in zip(sent, states):
        assert policy.on_summary(summary)
        assert {h for h in range(200) if policy.index.holds("r0", h)} == state
        policy.check_invariants()


def test_a_router_that_missed_a_chained_delta_waits_for_the_next_snapshot():
    stream = SummaryStream("r0@1", max_periods=3)
    sent = [stream.encode(full(v, range(v, v + 50))) for v in range(1, 6)]  # snapshot, 3 deltas, snapshot
    policy = make_policy(lambda: 0.0)
    assert policy.on_summary(sent[0])
    assert not policy.on_summary(sent[2])  # sent[1] was lost: the gap is seen, nothing applied
    assert policy.index.holds("r0", 1) and not policy.index.holds("r0", 52)
    assert policy.on_summary(sent[4]) and not sent[4].is_delta
    assert {h for h in range(100) if policy.index.holds("r0", h)} == set(range(5, 55))


def test_a_restarted_replica_drops_everything_at_its_first_snapshot():
    now = [100.0]
    policy = make_policy(lambda: now[0])
    old = SummaryStream("r0@1")
    policy.on_summary(old.encode(full(40, range(50))))
    request = RoutingRequest(tuple(range(1000, 1004)), 16)
    policy.on_routed(request, "r0", "q1")  # learned just now: within the grace period
    now[0] += 1.0
    restarted = SummaryStream("r0@2")  # versions start again at 1
    assert policy.on_summary(restarted.encode(full(1, [7])))
    assert [h for h in list(range(50)) + list(range(1000, 1004)) if policy.index.holds("r0", h)] == [7]
    policy.check_invariants()


def test_stats_of_a_new_epoch_are_not_skipped_as_seen():
    policy = make_policy(lambda: 0.0)
    assert policy.on_routing_stats("r0", SummaryStream("r0@1").encode(full(9, [1, 2])).to_dict())
    assert policy.on_routing_stats("r0", SummaryStream("r0@2").encode(full(1, [3])).to_dict())
    assert policy.index.holds("r0", 3) and not policy.index.holds("r0", 1)
