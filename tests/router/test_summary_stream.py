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


# ---------------------------------------------------------------- by reference


def _states(n, seed=0):
    """A replica's block sets over ``n`` periods: a slow churn."""
    import random

    rng = random.Random(seed)
    state = set(range(200))
    out = []
    for _ in range(n):
        state -= set(rng.sample(sorted(state), 3))
        state |= {rng.randrange(10_000, 20_000) for _ in range(4)}
        out.append(frozenset(state))
    return out


def test_a_stream_by_reference_rebases_on_a_state_it_sent_and_never_snapshots_again():
    stream = SummaryStream("r0@1", max_periods=4, cumulative=True, by_reference=True)
    states = _states(30)
    sent_versions = []
    for version, state in enumerate(states, start=1):
        sent = stream.encode(full(version, state))
        if version == 1:
            assert not sent.is_delta
        else:
            assert sent.is_delta and sent.base_version == stream.base_version
            assert sent.base_version in sent_versions  # a state this stream sent before
            assert stream.base_hashes == states[sent.base_version - 1]
            assert version - sent.base_version <= 4
        sent_versions.append(version)


def test_by_reference_needs_cumulative_deltas():
    with pytest.raises(ValueError, match="cumulative"):
        SummaryStream("r0@1", by_reference=True)


def test_a_router_following_a_stream_by_reference_never_needs_a_base():
    stream = SummaryStream("r0@1", max_periods=3, cumulative=True, by_reference=True)
    policy = make_policy(lambda: 0.0)
    for version, state in enumerate(_states(20), start=1):
        wire = stream.encode(full(version, state)).to_dict()
        assert policy.on_routing_stats("r0", wire)
        assert policy.missing_base("r0", wire) is None
        assert {h for h in range(20_000) if policy.index.holds("r0", h)} == state
        policy.check_invariants()


def test_a_router_that_missed_the_base_applies_the_next_delta_once_it_has_the_base():
    stream = SummaryStream("r0@1", max_periods=3, cumulative=True, by_reference=True)
    states = _states(9)
    wires = [stream.encode(full(v, s)).to_dict() for v, s in enumerate(states, start=1)]
    late = make_policy(lambda: 0.0)  # a router that sees only the last summary
    assert not late.on_routing_stats("r0", wires[-1])
    epoch, base_version = late.missing_base("r0", wires[-1])
    assert (epoch, base_version) == ("r0@1", stream.base_version)
    assert late.on_base("r0", epoch, base_version, states[base_version - 1])
    assert late.on_routing_stats("r0", wires[-1])
    assert {h for h in range(20_000) if late.index.holds("r0", h)} == states[-1]
    assert late.missing_base("r0", wires[-1]) is None  # seen: nothing to fetch
    late.check_invariants()


def test_a_fetched_base_of_another_epoch_or_version_applies_nothing():
    stream = SummaryStream("r0@1", max_periods=3, cumulative=True, by_reference=True)
    states = _states(5)
    wires = [stream.encode(full(v, s)).to_dict() for v, s in enumerate(states, start=1)]
    policy = make_policy(lambda: 0.0)
    policy.on_base("r0", "r0@0", stream.base_version, states[stream.base_version - 1])  # an older process
    assert not policy.on_routing_stats("r0", wires[-1])
    policy.on_base("r0", "r0@1", stream.base_version + 1, states[0])  # a version it is not against
    assert not policy.on_routing_stats("r0", wires[-1])
    assert not policy.on_base("r9", "r0@1", 1, states[0])  # not on the ring
    policy.check_invariants()


def test_a_restarted_replica_streaming_by_reference_replaces_its_entries_from_a_fetched_base():
    now = [0.0]
    policy = make_policy(lambda: now[0])
    old = SummaryStream("r0@1", cumulative=True, by_reference=True)
    policy.on_routing_stats("r0", old.encode(full(50, range(100))).to_dict())
    restarted = SummaryStream("r0@2", cumulative=True, by_reference=True)
    wires = [restarted.encode(full(v, {7, 8, v + 1000})).to_dict() for v in (1, 2, 3)]
    assert not policy.on_routing_stats("r0", wires[-1])  # the new epoch's snapshot was missed
    assert policy.missing_base("r0", wires[-1]) == ("r0@2", 1)
    policy.on_base("r0", "r0@2", 1, {7, 8, 1001})
    assert policy.on_routing_stats("r0", wires[-1])
    assert {h for h in range(2000) if policy.index.holds("r0", h)} == {7, 8, 1003}
    policy.check_invariants()


def test_a_restart_whose_snapshot_was_missed_drops_the_old_entries_at_its_first_delta():
    """Serve's channel may skip a restarted replica's snapshot: its next summary is
    a delta of the new epoch that this router cannot rebuild (no base named yet);
    the entries from before the restart leave the index at once all the same."""
    now = [0.0]
    policy = make_policy(lambda: now[0])
    policy.on_routing_stats("r0", SummaryStream("r0@1").encode(full(50, range(100))).to_dict())
    policy.on_routed(RoutingRequest(tuple(range(1000, 1004)), 16), "r0", "q1")  # learned within the grace period
    restarted = SummaryStream("r0@2", cumulative=True, by_reference=True)
    wires = [restarted.encode(full(v, {7, 8, v + 1000})).to_dict() for v in (1, 2)]
    assert not policy.on_routing_stats("r0", wires[1])
    assert not any(policy.index.holds("r0", h) for h in range(2000))
    policy.check_invariants()


def test_by_reference_a_growing_cache_gets_deltas_and_a_wholesale_change_a_snapshot():
    stream = SummaryStream("r0@1", cumulative=True, by_reference=True, max_periods=1)
    sent = [stream.encode(full(v, range(100 * v))) for v in range(1, 8)]  # +100 blocks a period: +100 %, +50 %, ...
    assert [s.is_delta for s in sent] == [False] + [True] * 6
    replaced = stream.encode(full(8, range(5000, 5050)))  # 700 dropped + 50 added > the 50 it holds
    assert not replaced.is_delta and replaced.block_hashes == frozenset(range(5000, 5050))
