"""Consistent hash ring with virtual nodes: where a cold prefix lives.

Several ingress replicas each run their own router; because the ring is a
pure function of the replica set, they agree on every key's home without
talking to each other.
"""

from __future__ import annotations

import bisect
import struct
from collections.abc import Iterable, Iterator

import xxhash

_U64 = struct.Struct("<Q")
_MASK_64 = (1 << 64) - 1


def _point(node: str, index: int) -> int:
    return xxhash.xxh3_64_intdigest(f"{node}\x00{index}".encode())


def ring_position(key: int) -> int:
    """Where ``key`` falls on the ring. Keys are mixed once more so that small
    or structured ints (test keys, counters) spread like real block hashes."""
    return xxhash.xxh3_64_intdigest(_U64.pack(key & _MASK_64))


class HashRing:
    """Nodes placed at ``virtual_nodes`` pseudo-random points each on a 64-bit circle.

    ``lookup(key)`` is the owner of the first point clockwise from the key's
    position; ``walk(key)`` continues clockwise and yields each distinct node
    once (the bounded-load fallback order).

    Invariants (checked by :meth:`check_invariants`):

    1. ``_points`` is sorted by (point, node) and holds exactly
       ``virtual_nodes`` points per node; ``_owners[i]`` owns ``_points[i]``.
    2. The layout depends only on the node set, not on the order of
       ``add``/``remove`` calls (points are ``xxh3(node, i)``; equal points are
       ordered by node name).
    3. Adding or removing a node moves only the keys whose owner is that node
       (a key's owner changes only if the new node's point falls before it).

    Cost: ``lookup`` O(log(V·N)); ``walk`` O(V·N) in the worst case, usually a
    few points per distinct node; ``add``/``remove`` O(V·N).
    """

    def __init__(self, nodes: Iterable[str] = (), virtual_nodes: int = 128) -> None:
        if type(virtual_nodes) is not int or virtual_nodes <= 0:
            raise ValueError(f"virtual_nodes must be a positive int, got {virtual_nodes!r}")
        self.virtual_nodes = virtual_nodes
        self._nodes: frozenset[str] = frozenset()
        self._points: list[int] = []
        self._owners: list[str] = []
        for node in nodes:
            self.add(node)

    @property
    def nodes(self) -> frozenset[str]:
        return self._nodes

    def __len__(self) -> int:
        return len(self._nodes)

    def __contains__(self, node: object) -> bool:
        return node in self._nodes

    def add(self, node: str) -> bool:
        """Place ``node``; returns False if it was already on the ring."""
        if not isinstance(node, str) or not node:
            raise ValueError(f"ring node must be a non-empty str, got {node!r}")
        if node in self._nodes:
            return False
        self._nodes = self._nodes | {node}
        merged = sorted(
            list(zip(self._points, self._owners)) + [(_point(node, i), node) for i in range(self.virtual_nodes)]
        )
        self._points = [p for p, _ in merged]
        self._owners = [n for _, n in merged]
        return True

    def remove(self, node: str) -> bool:
        """Take ``node`` off the ring; returns False if it was not on it."""
        if node not in self._nodes:
            return False
        self._nodes = self._nodes - {node}
        kept = [(p, n) for p, n in zip(self._points, self._owners) if n != node]
        self._points = [p for p, _ in kept]
        self._owners = [n for _, n in kept]
        return True

    def lookup(self, key: int) -> str:
        """The home of ``key``. Raises ``LookupError`` on an empty ring."""
        if not self._points:
            raise LookupError("hash ring is empty")
        index = bisect.bisect_left(self._points, ring_position(key))
        return self._owners[index % len(self._owners)]

    def walk(self, key: int) -> Iterator[str]:
        """Distinct nodes clockwise from ``key``'s position, home first."""
        if not self._points:
            return
        start = bisect.bisect_left(self._points, ring_position(key))
        num_points, num_nodes = len(self._points), len(self._nodes)
        seen: set[str] = set()
        for offset in range(num_points):
            owner = self._owners[(start + offset) % num_points]
            if owner not in seen:
                seen.add(owner)
                yield owner
                if len(seen) == num_nodes:
                    return

    def check_invariants(self) -> None:
        assert len(self._points) == len(self._owners) == self.virtual_nodes * len(self._nodes)
        pairs = list(zip(self._points, self._owners))
        assert pairs == sorted(pairs), "ring points out of order"
        assert set(self._owners) == self._nodes
        for node in self._nodes:
            assert self._owners.count(node) == self.virtual_nodes, node
