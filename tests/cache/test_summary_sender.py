"""cache.summary_sender: what a Worker returns from record_routing_stats."""

import json

import pytest

from cache.summary import BASE_REF_KEY, CacheSummary, unpack_block_hashes
from router import PolicyConfig, PrefixAffinityPolicy
from cache.summary_sender import REF_WIRE_BYTES, SummarySender

BLOCK = 4


def full(version, hashes):
    return CacheSummary("r0", version, float(version), BLOCK, frozenset(hashes), num_queued_tokens=version)


class Store:
    """Stands in for ray.put: keeps what was put, returns a handle naming it."""

    def __init__(self):
        self.objects = []

    def put(self, data):
        self.objects.append(data)
        return f"ref-{len(self.objects) - 1}"


def _states(n):
    state = set(range(2000))
    for step in range(n):
        state = (state - {step * 5 + i for i in range(5)}) | {50_000 + step * 5 + i for i in range(5)}
        yield frozenset(state)


def test_full_mode_sends_every_block_each_period():
    store = Store()
    sender = SummarySender("r0", "full", put=store.put)
    wires = [sender.encode(full(v, s)) for v, s in enumerate(_states(3), start=1)]
    assert all(CacheSummary.from_dict(w).block_hashes == s for w, s in zip(wires, _states(3)))
    assert store.objects == [] and sender.stats()["summary_snapshots"] == 3


def test_stream_mode_sends_deltas_and_names_a_base_every_ref_every_th_delta():
    store = Store()
    sender = SummarySender("r0", put=store.put, max_periods=1, ref_every=4)
    states = list(_states(21))
    wires = [sender.encode(full(v, s)) for v, s in enumerate(states, start=1)]
    assert BASE_REF_KEY not in wires[0] and not CacheSummary.from_dict(wires[0]).is_delta
    assert [BASE_REF_KEY in w for w in wires[1:]] == [True, False, False, False] * 5
    for version, wire in enumerate(wires[1:], start=2):
        assert wire["bv"] == version - 1  # max_periods=1: each delta against the summary sent just before
        if BASE_REF_KEY in wire:
            assert unpack_block_hashes(store.objects[int(wire[BASE_REF_KEY][4:])]) == states[version - 2]
    stats = sender.stats()
    assert stats["summary_messages"] == 21 and stats["summary_snapshots"] == 1
    assert stats["summary_bases_put"] == len(store.objects) == 5  # only the bases a delta named
    full_bytes = sum(len(json.dumps(full(v, s).to_dict(), separators=(",", ":"))) for v, s in enumerate(states, 1))
    assert stats["summary_bytes"] * 10 < full_bytes  # >= 10x fewer bytes on a slowly changing 2,000-block cache
    assert stats["summary_bytes"] > 5 * REF_WIRE_BYTES


def test_cumulative_deltas_put_a_base_once_for_every_delta_against_it():
    store = Store()
    sender = SummarySender("r0", put=store.put, max_periods=4, ref_every=1)
    wires = [sender.encode(full(v, s)) for v, s in enumerate(_states(12), start=1)]
    assert all(BASE_REF_KEY in w for w in wires[1:])
    assert len(store.objects) == len({w["bv"] for w in wires[1:]}) <= 4
    assert len({w[BASE_REF_KEY] for w in wires[1:]}) == len(store.objects)


@pytest.mark.parametrize("ref_every", [1, 3])
def test_a_router_seeing_only_the_latest_stats_is_whole_at_each_delta_naming_its_base(ref_every):
    store = Store()
    sender = SummarySender("r0", put=store.put, ref_every=ref_every)
    for version, state in enumerate(_states(12), start=1):
        wire = sender.encode(full(version, state))
        late = PrefixAffinityPolicy(PolicyConfig(block_size=BLOCK), clock=lambda: 0.0)
        late.set_replicas(["r0"])
        if not late.on_routing_stats("r0", wire):
            epoch, base_version = late.missing_base("r0", wire)
            if BASE_REF_KEY not in wire:
                continue  # it waits for a delta that names its base
            late.on_base("r0", epoch, base_version, unpack_block_hashes(store.objects[int(wire[BASE_REF_KEY][4:])]))
            assert late.on_routing_stats("r0", wire)
        assert {h for h in range(60_000) if late.index.holds("r0", h)} == state


def test_an_unknown_mode_or_a_bad_ref_every_is_a_value_error():
    with pytest.raises(ValueError, match="summary mode"):
        SummarySender("r0", "delta", put=Store().put)
    with pytest.raises(ValueError, match="ref_every"):
        SummarySender("r0", put=Store().put, ref_every=0)
