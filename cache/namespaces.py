"""The radix tree's live tenant namespaces, least recently used first, capped."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator

from cache.radix_node import Root, SaltKey


class Namespaces:
    """The roots of a :class:`cache.RadixCache`, one per live salt.

    1. Order is recency of use: :meth:`touch` (every counted lookup and every
       insert in the namespace) moves a root to the back; the front is the
       least recently used. Clock values play no part here.
    2. At most ``max_namespaces`` roots are held; the tree makes room with
       :meth:`least_recent_unlocked` before it :meth:`add` s one more.

    Cost: O(1) per get / add / touch / drop; :meth:`least_recent_unlocked`
    skips the locked roots in front of the first unlocked one.
    """

    def __init__(self, max_namespaces: int) -> None:
        if type(max_namespaces) is not int or max_namespaces < 1:
            raise ValueError(f"max_namespaces must be a positive int, got {max_namespaces!r}")
        self.max_namespaces = max_namespaces
        self._roots: OrderedDict[SaltKey, Root] = OrderedDict()

    def __len__(self) -> int:
        return len(self._roots)

    def __iter__(self) -> Iterator[Root]:
        """The roots, least recently used first."""
        return iter(self._roots.values())

    @property
    def is_full(self) -> bool:
        return len(self._roots) >= self.max_namespaces

    def get(self, namespace: SaltKey) -> Root | None:
        return self._roots.get(namespace)

    def holds(self, root: Root) -> bool:
        """``root`` is the live root of its namespace (not a dropped or never-added one)."""
        return self._roots.get(root.namespace) is root

    def add(self, root: Root) -> None:
        assert root.namespace not in self._roots and not self.is_full, root.namespace
        self._roots[root.namespace] = root

    def touch(self, root: Root) -> None:
        if self.holds(root):
            self._roots.move_to_end(root.namespace)

    def drop(self, root: Root) -> None:
        assert self.holds(root), root.namespace
        del self._roots[root.namespace]

    def least_recent_unlocked(self) -> Root | None:
        """The least recently used root with no lock below it (only its permanent one), or None."""
        for root in self._roots.values():
            if root.lock_ref == 1:
                return root
        return None
