"""Which replica holds which chained block hash, as far as one router knows."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable, Sequence


class PrefixIndex:
    """Chained block hash → the replicas believed to cache that prefix.

    Two sources:

    * :meth:`learn` — the router's own decisions, applied at once: routing a
      prompt to ``r`` means ``r`` will hold all of its blocks.
    * :meth:`apply_summary` — a replica's report of what it really holds. A
      fresh summary *replaces* that replica's entries (evictions the router
      could not see disappear), except entries learned within the last
      ``learned_grace_s``, which the summary may predate.

    Memory: each replica keeps at most ``capacity_blocks(r)`` entries in LRU
    order (``max_blocks_per_replica``, lowered to the replica's own budget in
    blocks once a summary reports it), so the index mirrors the replica's own
    LRU instead of growing with the traffic. A path is touched deepest block
    first, so ancestors are always more recent than descendants and are
    evicted after them, as in the radix tree.

    Invariants (checked by :meth:`check_invariants`):

    1. ``r in _holders[h]`` iff ``h in _entries[r]``; no empty holder sets.
    2. ``len(_entries[r]) <= capacity_blocks(r)``.

    Cost: :meth:`deepest_holders` is O(prompt blocks + replicas it returns),
    independent of how many blocks or replicas the index knows;
    :meth:`learn` O(blocks learned); :meth:`apply_summary` O(summary + the
    replica's entries).
    """

    def __init__(self, max_blocks_per_replica: int = 1 << 18, learned_grace_s: float = 5.0) -> None:
        if type(max_blocks_per_replica) is not int or max_blocks_per_replica <= 0:
            raise ValueError(f"max_blocks_per_replica must be a positive int, got {max_blocks_per_replica!r}")
        if not learned_grace_s >= 0:
            raise ValueError(f"learned_grace_s must be >= 0, got {learned_grace_s!r}")
        self.max_blocks_per_replica = max_blocks_per_replica
        self.learned_grace_s = float(learned_grace_s)
        # hash -> {replica_id: None}; a dict (not a set) so iteration order is
        # the same in every router process (str hashing is randomised per process).
        self._holders: dict[int, dict[str, None]] = {}
        # replica_id -> hash -> learned_at (router clock) or None (from a summary); oldest first.
        self._entries: dict[str, OrderedDict[int, float | None]] = {}
        self._capacity: dict[str, int] = {}

    # ------------------------------------------------------------------ queries
    @property
    def replica_ids(self) -> list[str]:
        return list(self._entries)

    def capacity_blocks(self, replica_id: str) -> int:
        return self._capacity.get(replica_id, self.max_blocks_per_replica)

    def num_blocks(self, replica_id: str) -> int:
        entries = self._entries.get(replica_id)
        return len(entries) if entries is not None else 0

    def holds(self, replica_id: str, block_hash: int) -> bool:
        holders = self._holders.get(block_hash)
        return holders is not None and replica_id in holders

    def deepest_holders(
        self, block_hashes: Sequence[int], max_replicas: int, live: Collection[str] | None = None
    ) -> tuple[int, dict[str, int]]:
        """``(num_known_blocks, {replica: num_matched_blocks})``.

        ``num_known_blocks``: how many leading blocks some replica holds.
        The dict names at most ``max_replicas`` replicas (in ``live`` if given),
        deepest match first; ties in holder order.
        """
        holders_index = self._holders
        num_known = 0
        for block_hash in block_hashes:
            if block_hash not in holders_index:
                break
            num_known += 1
        found: dict[str, int] = {}
        for depth in range(num_known, 0, -1):
            for replica_id in holders_index[block_hashes[depth - 1]]:
                if replica_id not in found and (live is None or replica_id in live):
                    found[replica_id] = depth
                    if len(found) >= max_replicas:
                        return num_known, found
        return num_known, found

    # ------------------------------------------------------------------ updates
    def learn(self, replica_id: str, block_hashes: Sequence[int], now: float) -> None:
        """``replica_id`` now holds every block of ``block_hashes`` (a prompt's chain)."""
        entries = self._entries.get(replica_id)
        if entries is None:
            entries = self._entries[replica_id] = OrderedDict()
        holders_index = self._holders
        for block_hash in reversed(block_hashes):  # deepest first: ancestors end most recent
            if block_hash in entries:
                entries.move_to_end(block_hash)
            else:
                holders = holders_index.get(block_hash)
                if holders is None:
                    holders_index[block_hash] = {replica_id: None}
                else:
                    holders[replica_id] = None
            entries[block_hash] = now
        self._trim(replica_id)

    def apply_summary(
        self, replica_id: str, block_hashes: Iterable[int], now: float, capacity_blocks: int | None = None
    ) -> None:
        """Replace ``replica_id``'s entries with what it reports holding.

        Entries learned after ``now - learned_grace_s`` survive even if the
        summary lacks them (it may have been taken before those requests ran).
        Reported blocks the router did not know are added as least recent.
        """
        if capacity_blocks is not None:
            if type(capacity_blocks) is not int or capacity_blocks <= 0:
                raise ValueError(f"capacity_blocks must be a positive int, got {capacity_blocks!r}")
            self._capacity[replica_id] = min(capacity_blocks, self.max_blocks_per_replica)
        reported = block_hashes if isinstance(block_hashes, (set, frozenset)) else set(block_hashes)
        old = self._entries.get(replica_id, OrderedDict())
        fresh_after = now - self.learned_grace_s
        merged: OrderedDict[int, float | None] = OrderedDict()
        for block_hash in reported:
            if block_hash not in old:
                merged[block_hash] = None
        holders_index = self._holders
        for block_hash, learned_at in old.items():
            if block_hash in reported:
                merged[block_hash] = None
            elif learned_at is not None and learned_at > fresh_after:
                merged[block_hash] = learned_at
            else:
                self._drop_holder(block_hash, replica_id)
        for block_hash in merged:
            if block_hash not in old:
                holders = holders_index.get(block_hash)
                if holders is None:
                    holders_index[block_hash] = {replica_id: None}
                else:
                    holders[replica_id] = None
        self._entries[replica_id] = merged
        self._trim(replica_id)

    def remove_replica(self, replica_id: str) -> None:
        """Forget everything about ``replica_id`` (it died or left)."""
        for block_hash in self._entries.pop(replica_id, ()):
            self._drop_holder(block_hash, replica_id)
        self._capacity.pop(replica_id, None)

    # ----------------------------------------------------------------- private
    def _trim(self, replica_id: str) -> None:
        entries = self._entries[replica_id]
        capacity = self.capacity_blocks(replica_id)
        while len(entries) > capacity:
            block_hash, _ = entries.popitem(last=False)
            self._drop_holder(block_hash, replica_id)

    def _drop_holder(self, block_hash: int, replica_id: str) -> None:
        holders = self._holders.get(block_hash)
        if holders is not None:
            holders.pop(replica_id, None)
            if not holders:
                del self._holders[block_hash]

    def check_invariants(self) -> None:
        pairs_from_entries = {(h, r) for r, entries in self._entries.items() for h in entries}
        pairs_from_holders = {(h, r) for h, holders in self._holders.items() for r in holders}
        assert pairs_from_entries == pairs_from_holders, "holders and entries disagree"
        assert all(self._holders.values()), "empty holder set"
        for replica_id, entries in self._entries.items():
            assert len(entries) <= self.capacity_blocks(replica_id), replica_id
