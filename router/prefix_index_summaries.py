"""Applying a replica's summary to :class:`router.prefix_index.PrefixIndex`:
a full one (:meth:`apply_summary`) or the changes since the one before
(:meth:`apply_delta`), off the decision path."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator
from itertools import chain

from router.fifo_runs import reported_runs


class SummaryApplyMixin:
    """The summary half of :class:`router.prefix_index.PrefixIndex` (mixed
    into it, never used alone): replaces a replica's entries with what it
    reports, under the index's invariants (its class docstring), through
    the index's private helpers (``_fold``, ``_slot_of``, ``_first_tick_after``,
    ``_clear_bit``, ``_maybe_trim``)."""

    def apply_summary(
        self, replica_id: str, block_hashes: Iterable[int], now: float, capacity_blocks: int | None = None,
        keep_learned: bool = True,
    ) -> None:
        """Replace ``replica_id``'s entries with what it reports holding.

        Entries learned after ``now - learned_grace_s`` survive even if the
        summary lacks them (it may have been taken before those requests ran),
        unless ``keep_learned`` is False (the replica restarted: nothing it
        was sent before is cached there).
        Reported blocks the router did not know are added as least recent.
        """
        self._set_capacity(replica_id, capacity_blocks)
        reported = block_hashes if isinstance(block_hashes, (set, frozenset)) else frozenset(block_hashes)
        bit = 1 << self._slot_of(replica_id)
        self._fold(replica_id)
        entries = self._entries[replica_id]
        fresh_tick = self._first_tick_after(now - self.learned_grace_s) if keep_learned else self._tick
        self._trimmed[replica_id] = set()
        survivors = set()
        for block_hash in entries.keys() - reported:
            if entries[block_hash] < fresh_tick:
                del entries[block_hash]
                self._clear_bit(block_hash, bit)
            else:
                survivors.add(block_hash)
        self._add_reported(replica_id, reported - entries.keys(), bit)
        self._unreported[replica_id] = survivors
        self._applied_tick[replica_id] = self._tick
        self._maybe_trim(replica_id)

    def apply_delta(self, replica_id: str, added: Collection[int], removed: Collection[int],
                    reported: Collection[int], now: float, capacity_blocks: int | None = None) -> None:
        """:meth:`apply_summary` of ``reported`` (what the replica holds now),
        given that the summary applied to this replica just before reported
        ``reported - added | removed``: O(changes + blocks learned since then),
        not O(cached blocks).

        The same entries, ticks and least-recent order as :meth:`apply_summary`
        would leave (while the index trims at most ``TRIMMED_KEPT`` caches'
        worth of blocks between two summaries). Blocks the index trimmed for
        capacity since the summary before and ``reported`` still names go
        back as least recent, as a full summary would put them: a delta
        names only what changed, and without them an index that dropped a
        held block for a learned one would lack it until the next snapshot,
        though the replica reports it every period. Learned entries are
        always kept within the grace period (a restart comes as a full
        summary).
        """
        if replica_id not in self._applied_tick:  # no summary applied yet (or the replica left since)
            self.apply_summary(replica_id, reported, now, capacity_blocks)
            return
        self._set_capacity(replica_id, capacity_blocks)
        bit = 1 << self._slot[replica_id]
        self._fold(replica_id)
        entries = self._entries[replica_id]
        fresh_tick = self._first_tick_after(now - self.learned_grace_s)
        candidates = {h for h in chain(removed, self._unreported.get(replica_id, ()), self._learned_since(replica_id))
                      if h not in reported}  # entries the replica may not hold (what apply_summary checks)
        survivors = set()
        for block_hash in candidates:
            tick = entries.get(block_hash)
            if tick is None:
                continue
            if tick < fresh_tick:
                del entries[block_hash]
                self._clear_bit(block_hash, bit)
            else:
                survivors.add(block_hash)
        trimmed, self._trimmed[replica_id] = self._trimmed[replica_id], set()
        restored = {h for h in trimmed if h in reported}  # trimmed, and the replica still holds them
        self._add_reported(replica_id, {h for h in added if h not in entries} | (restored - entries.keys()), bit)
        self._unreported[replica_id] = survivors
        self._applied_tick[replica_id] = self._tick
        self._maybe_trim(replica_id)

    def _set_capacity(self, replica_id: str, capacity_blocks: int | None) -> None:
        """Lower ``replica_id``'s capacity to what its summary reports (None: unchanged)."""
        if capacity_blocks is not None:
            if type(capacity_blocks) is not int or capacity_blocks <= 0:
                raise ValueError(f"capacity_blocks must be a positive int, got {capacity_blocks!r}")
            self._capacity[replica_id] = min(capacity_blocks, self.max_blocks_per_replica)

    def _learned_since(self, replica_id: str) -> Iterator[int]:
        """Hashes of the FIFO runs learned since the last summary applied to ``replica_id``."""
        since = self._applied_tick[replica_id]
        for tick, run in reversed(self._fifo[replica_id]):
            if tick < since:  # reported (0), or learned before
                return
            yield from run

    def _add_reported(self, replica_id: str, added: Collection[int], bit: int) -> None:
        """Blocks a summary reported that the index did not know, as least
        recent, in hash order (so a full summary and a delta reporting the
        same set leave the same FIFO, whatever order their sets iterate in)."""
        if not added:
            return
        added = sorted(added)
        self._entries[replica_id].update(dict.fromkeys(added, 0))
        self._fifo[replica_id].extendleft(reversed(reported_runs(added[::-1])))  # each pushed on the left in turn
        self._fifo_size[replica_id] += len(added)
        holders = self._holders
        for block_hash in added:
            holders[block_hash] = holders.get(block_hash, 0) | bit
