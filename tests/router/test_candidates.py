"""``gather``'s candidates: each once, every ring node it ranks among them
(what ``scoring._sorted`` relies on to skip looking for ties), and cold
exactly when no live replica holds the prompt's first block."""

import random

import pytest

from router.candidates import gather
from router.load import LoadTracker
from router.prefix_index import PrefixIndex
from router.request import RoutingRequest
from router.ring import HashRing


@pytest.mark.parametrize("seed", range(4))
def test_candidates_are_distinct_and_include_every_ranked_ring_node(seed):
    rng = random.Random(seed)
    names = [f"replica-{i}" for i in range(12)]
    ring, index, loads = HashRing(), PrefixIndex(), LoadTracker()
    for name in names:
        ring.add(name)
        loads.add_replica(name)
    chains = [tuple(rng.getrandbits(64) for _ in range(8)) for _ in range(5)]
    for step in range(300):
        chain = rng.choice(chains)[: rng.randint(1, 8)] + tuple(rng.getrandbits(64) for _ in range(rng.randint(0, 3)))
        live = set(rng.sample(names, rng.randint(1, len(names))))
        request = RoutingRequest(chain, 4 * len(chain), None, "", 8)
        found = gather(request, live, index, ring, loads, None, 4, rng.randint(1, 4), rng.randint(1, 3),
                       num_cold_candidates=rng.choice([None, 8]))
        assert len(set(found.replica_ids)) == len(found.replica_ids), step
        assert set(found.ring_rank) <= set(found.replica_ids) and set(found.ring_rank) <= live, step
        assert sorted(found.ring_rank.values()) == list(range(len(found.ring_rank))), step
        assert found.is_cold == (not any(index.holds(r, chain[0]) for r in live)), step  # no live holder
        index.learn(rng.choice(names), chain, float(step))
        loads.on_routed(f"q{step}", rng.choice(names), float(rng.randint(1, 50)), float(step))
