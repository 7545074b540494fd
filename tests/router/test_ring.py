"""router.HashRing: a pure function of the node set; minimal key movement."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router import HashRing

KEYS = range(0, 20_000, 7)
node_names = st.lists(st.text(alphabet="abcdefgh0123456789", min_size=1, max_size=6), min_size=1, max_size=8, unique=True)


def owners(ring):
    return {k: ring.lookup(k) for k in KEYS}


@settings(max_examples=30, deadline=None)
@given(node_names, st.randoms(use_true_random=False))
def test_layout_depends_only_on_the_node_set(nodes, rnd):
    shuffled = list(nodes)
    rnd.shuffle(shuffled)
    a = HashRing(nodes, virtual_nodes=16)
    b = HashRing(virtual_nodes=16)
    for node in shuffled + ["zz-temporary"]:
        b.add(node)
    b.remove("zz-temporary")
    a.check_invariants()
    b.check_invariants()
    assert owners(a) == owners(b)
    assert all(list(a.walk(k)) == list(b.walk(k)) for k in range(0, 500, 37))


@settings(max_examples=30, deadline=None)
@given(node_names, st.text(alphabet="xyz", min_size=1, max_size=4))
def test_adding_a_node_moves_only_keys_to_it(nodes, new):
    ring = HashRing(nodes, virtual_nodes=16)
    before = owners(ring)
    ring.add("new-" + new)
    ring.check_invariants()
    after = owners(ring)
    moved = {k for k in KEYS if before[k] != after[k]}
    assert all(after[k] == "new-" + new for k in moved)


@settings(max_examples=30, deadline=None)
@given(node_names)
def test_removing_a_node_moves_only_its_keys(nodes):
    ring = HashRing(nodes, virtual_nodes=16)
    before = owners(ring)
    gone = nodes[0]
    ring.remove(gone)
    ring.check_invariants()
    if not len(ring):
        return
    after = owners(ring)
    assert all(after[k] == before[k] for k in KEYS if before[k] != gone)
    assert all(after[k] != gone for k in KEYS)


def test_walk_yields_every_node_once_home_first():
    ring = HashRing([f"r{i}" for i in range(8)], virtual_nodes=32)
    for key in range(200):
        walk = list(ring.walk(key))
        assert walk[0] == ring.lookup(key)
        assert sorted(walk) == sorted(ring.nodes)


def test_walk_order_is_the_next_owner_after_removing_the_home():
    ring = HashRing([f"r{i}" for i in range(6)], virtual_nodes=32)
    for key in range(100):
        home, second = list(ring.walk(key))[:2]
        smaller = HashRing(ring.nodes - {home}, virtual_nodes=32)
        assert smaller.lookup(key) == second


def test_keys_spread_roughly_evenly():
    ring = HashRing([f"replica-{i}" for i in range(8)], virtual_nodes=128)
    counts = {}
    for key in range(40_000):
        home = ring.lookup(key * 2654435761)
        counts[home] = counts.get(home, 0) + 1
    assert max(counts.values()) / min(counts.values()) < 1.35


def test_add_and_remove_report_whether_anything_changed():
    ring = HashRing(virtual_nodes=4)
    assert ring.add("a") and not ring.add("a")
    assert ring.remove("a") and not ring.remove("a")
    assert len(ring) == 0 and list(ring.walk(1)) == []


def test_empty_ring_lookup_raises_lookup_error():
    with pytest.raises(LookupError):
        HashRing().lookup(1)


@pytest.mark.parametrize("bad", ["", None, 3])
def test_bad_node_names_raise_value_error(bad):
    with pytest.raises(ValueError, match="ring node"):
        HashRing().add(bad)


@pytest.mark.parametrize("bad", [0, -1, 1.5, "8"])
def test_bad_virtual_nodes(bad):
    with pytest.raises(ValueError, match="virtual_nodes"):
        HashRing(virtual_nodes=bad)
