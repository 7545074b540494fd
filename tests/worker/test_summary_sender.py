"""worker.summary_sender: what a Worker returns from record_routing_stats."""

import json

import pytest

from cache.summary import BASE_REF_KEY, CacheSummary, unpack_block_hashes
from router import PolicyConfig, PrefixAffinityPolicy
from worker.summary_sender import REF_WIRE_BYTES, SummarySender

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


def test_stream_mode_puts_each_base_once_and_every_delta_names_it():
    store = Store()
    sender = SummarySender("r0", put=store.put, max_periods=4)
    states = list(_states(20))
    wires = [sender.encode(full(v, s)) for v, s in enumerate(states, start=1)]
    assert BASE_REF_KEY not in wires[0] and not CacheSummary.from_dict(wires[0]).is_delta
    for wire in wires[1:]:
        base = int(wire[BASE_REF_KEY].split("-")[1])
        assert unpack_block_hashes(store.objects[base]) == states[wire["bv"] - 1]
    stats = sender.stats()
    assert stats["summary_messages"] == 20 and stats["summary_snapshots"] == 1
    assert stats["summary_bases_put"] == len(store.objects) == len({w["bv"] for w in wires[1:]}) <= 6
    full_bytes = sum(len(json.dumps(full(v, s).to_dict(), separators=(",", ":"))) for v, s in enumerate(states, 1))
    assert stats["summary_bytes"] * 10 < full_bytes  # >= 10x fewer bytes on a slowly changing 2,000-block cache
    assert stats["summary_bytes"] > 19 * REF_WIRE_BYTES


def test_a_router_seeing_only_the_latest_stats_rebuilds_each_state():
    store = Store()
    sender = SummarySender("r0", put=store.put, max_periods=3)
    for version, state in enumerate(_states(12), start=1):
        wire = sender.encode(full(version, state))
        late = PrefixAffinityPolicy(PolicyConfig(block_size=BLOCK), clock=lambda: 0.0)
        late.set_replicas(["r0"])
        if not late.on_routing_stats("r0", wire):
            epoch, base_version = late.missing_base("r0", wire)
            late.on_base("r0", epoch, base_version, unpack_block_hashes(store.objects[int(wire[BASE_REF_KEY][4:])]))
            assert late.on_routing_stats("r0", wire)
        assert {h for h in range(60_000) if late.index.holds("r0", h)} == state


def test_an_unknown_mode_is_a_value_error():
    with pytest.raises(ValueError, match="summary mode"):
        SummarySender("r0", "delta", put=Store().put)
