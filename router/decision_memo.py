"""A decision's memo of one per-replica figure."""

from __future__ import annotations

from collections.abc import Callable


class PerReplica(dict):
    """``replica_id -> compute(replica_id)``, each computed once: the first
    ask calls ``compute`` (``__missing__``), later ones are a dict lookup in
    C. For one decision, which asks a replica's figure several times (its
    score, the fetch plan, the bound) while nothing it reads changes; a new
    decision takes a new memo. ``PerReplica(compute).__getitem__`` is the
    memoised function."""

    __slots__ = ("_compute",)

    def __init__(self, compute: Callable[[str], object]) -> None:
        super().__init__()
        self._compute = compute

    def __missing__(self, replica_id: str) -> object:
        value = self[replica_id] = self._compute(replica_id)
        return value
