"""Which replica holds which chained block hash, as far as one router knows."""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Collection, Iterable, Iterator, Sequence
from itertools import chain, islice, repeat

from router.chain_search import last_true
from router.fifo_runs import RUN_LIMIT, fifo_items, fifo_runs, pop_least_recent, reported_runs

# a replica's trimmed entries kept for its next summary, in caches' worth: past that (an index churning its
# whole cache many times between two summaries), a delta puts back fewer than a full summary would
TRIMMED_KEPT = 8


class PrefixIndex:
    """Chained block hash → the replicas believed to cache that prefix.

    Two sources:

    * :meth:`learn` — the router's own decisions, applied at once: routing a
      prompt to ``r`` means ``r`` will hold all of its blocks.
    * :meth:`apply_summary` — a replica's report of what it really holds. A
      fresh summary *replaces* that replica's entries (evictions the router
      could not see disappear), except entries learned within the last
      ``learned_grace_s``, which the summary may predate. :meth:`apply_delta`
      does the same from what changed since the summary before.

    Memory: each replica keeps at most ``capacity_blocks(r)`` entries
    (``max_blocks_per_replica``, lowered to the replica's own budget in
    blocks once a summary reports it), least recently used out first, so the
    index mirrors the replica's own LRU instead of growing with the traffic.
    A learn may leave up to ``learn_slack(r)`` (``learn_slack_share`` of the
    capacity) entries more: the next summary trims them, off the decision
    path, and a learn trims only what passes that slack. Between summaries
    the index then also names the few least recent blocks the replica's
    own LRU has just pushed out, until its summary says so.

    Layout (chosen so that the hot path runs mostly in C and the garbage
    collector never walks the index): ``_holders`` maps a hash to a bit mask
    of replica slots; ``_entries[r]`` maps each hash ``r`` holds to its
    recency tick (ints only): one tick per learn, shared by its blocks.
    ``_fifo[r]`` lists ``(tick, hash)`` items in eviction order, stored as
    runs ``(tick, hashes)`` — one per learn, its path deepest block first,
    so a learn allocates one tuple and no int per block. Ancestors are
    therefore always evicted after their descendants, as in the radix tree.
    An item is current iff the entry still has that tick, so eviction pops
    from its left. Blocks only a summary reported get tick 0 and sit at the
    FIFO's head (least recent). ``_fifo_size[r]`` counts the items.

    Invariants (checked by :meth:`check_invariants`):

    1. ``_holders[h] & bit(r)`` iff ``h in _entries[r]``; no zero masks.
    2. ``len(_entries[r]) <= capacity_blocks(r) + learn_slack(r)``, and
       ``<= capacity_blocks(r)`` right after a summary.
    3. Every entry has its current ``(tick, hash)`` in ``_fifo[r]``; items
       with a tick > 0 are in non-decreasing tick order; ``_fifo_size[r]`` is
       the number of items; no run is empty, and no run of tick 0 is longer
       than ``RUN_LIMIT``.
    4. ``_trimmed[r]`` (the entries trimmed since the last summary, for
       :meth:`apply_delta` to put back) holds at most ``TRIMMED_KEPT ×
       capacity_blocks(r)`` hashes.
    5. ``_prompt_ends`` (learned prompts' last blocks) holds only held hashes.

    Cost: :meth:`deepest_holders` and :meth:`depth` are O(log n) lookups per
    depth returned (binary search: whoever holds block ``j`` of a chain holds
    ``0..j``), independent of how many blocks or replicas the index knows;
    :meth:`learn` O(n) mostly in C, and no eviction while within the slack
    (trimming costs ~1 µs a block: a decision with a full cache would pay it
    for every block it adds); :meth:`apply_summary` set operations in C plus
    O(changed blocks) in Python; :meth:`apply_delta` O(changed blocks +
    blocks learned since the last summary), independent of the cache size.
    Reported blocks sit in FIFO runs of at most ``RUN_LIMIT``, so trimming a
    few never copies a whole cache's run.
    """

    def __init__(self, max_blocks_per_replica: int = 1 << 18, learned_grace_s: float = 5.0,
                 learn_slack_share: float = 0.125) -> None:
        if type(max_blocks_per_replica) is not int or max_blocks_per_replica <= 0:
            raise ValueError(f"max_blocks_per_replica must be a positive int, got {max_blocks_per_replica!r}")
        if not learned_grace_s >= 0:
            raise ValueError(f"learned_grace_s must be >= 0, got {learned_grace_s!r}")
        if not 0 <= learn_slack_share <= 1:
            raise ValueError(f"learn_slack_share must be in [0, 1], got {learn_slack_share!r}")
        self.max_blocks_per_replica = max_blocks_per_replica
        self.learn_slack_share = float(learn_slack_share)
        self.learned_grace_s = float(learned_grace_s)
        self._holders: dict[int, int] = {}
        self._entries: dict[str, dict[int, int]] = {}
        self._fifo: dict[str, deque[tuple[int, Sequence[int]]]] = {}  # runs of (tick, hash) items
        self._fifo_size: dict[str, int] = {}  # items in _fifo[r]
        self._capacity: dict[str, int] = {}
        self._slot: dict[str, int] = {}  # replica -> bit position
        self._replica_at: list[str | None] = []
        self._tick = 1
        self._tick_times: list[tuple[float, int]] = []  # (time, a learn's tick), ascending
        # per replica, for apply_delta: learned entries the last summary did not report (kept within the
        # grace period), and the tick when that summary was applied (later learns come after it)
        self._unreported: dict[str, set[int]] = {}
        self._applied_tick: dict[str, int] = {}
        # per replica: entries trimmed for capacity since the last summary was applied (bounded: TRIMMED_KEPT);
        # those it reported go back as least recent at the next one (apply_summary re-adds them anyway;
        # apply_delta from here)
        self._trimmed: dict[str, set[int]] = {}
        self._prompt_ends: set[int] = set()  # the last block of a prompt learned (is_branch_point)

    # ------------------------------------------------------------------ queries
    @property
    def replica_ids(self) -> list[str]:
        return list(self._entries)

    def capacity_blocks(self, replica_id: str) -> int:
        return self._capacity.get(replica_id, self.max_blocks_per_replica)

    def learn_slack(self, replica_id: str) -> int:
        """Entries a learn may leave past the capacity until the next summary trims them."""
        return int(self.capacity_blocks(replica_id) * self.learn_slack_share)

    def num_blocks(self, replica_id: str) -> int:
        entries = self._entries.get(replica_id)
        return len(entries) if entries is not None else 0

    def num_holders(self, block_hash: int) -> int:
        """How many replicas are believed to hold ``block_hash`` (and so its whole chain). O(1)."""
        return self._holders.get(block_hash, 0).bit_count()

    def holds(self, replica_id: str, block_hash: int) -> bool:
        slot = self._slot.get(replica_id)
        return slot is not None and bool(self._holders.get(block_hash, 0) >> slot & 1)

    def deepest_holders(
        self, block_hashes: Sequence[int], max_replicas: int, live: Collection[str] | None = None,
        levels: list[tuple[int, int]] | None = None,
    ) -> tuple[int, dict[str, int]]:
        """``(num_known_blocks, {replica: num_matched_blocks})``.

        ``num_known_blocks``: how many leading blocks some replica holds.
        The dict names at most ``max_replicas`` replicas (in ``live`` if
        given), deepest match first; equal depths in slot order.

        ``levels``, when given, gets ``(depth, num_holders)`` for every run
        of the known blocks, deepest first: ``num_holders`` replicas (live or
        not) hold block ``depth - 1`` and, the chain being held prefix by
        prefix, every block down to the next entry's depth; ``num_holders``
        grows from entry to entry. The walk goes on to block 0 for it, one
        binary search per distinct holder count.
        """
        holders = self._holders
        num_known = last_true(len(block_hashes), lambda d: block_hashes[d - 1] in holders)
        found: dict[str, int] = {}
        depth = num_known
        while depth > 0:
            mask = holders.get(block_hashes[depth - 1], 0)
            count = mask.bit_count()
            if levels is not None:
                levels.append((depth, count))
            remaining = mask if len(found) < max_replicas else 0
            while remaining:
                low = remaining & -remaining
                remaining ^= low
                replica_id = self._replica_at[low.bit_length() - 1]
                if replica_id not in found and (live is None or replica_id in live):
                    found[replica_id] = depth
                    if len(found) >= max_replicas:
                        if levels is None:
                            return num_known, found
                        break
            # Next: the deepest block that more replicas hold.
            depth = last_true(depth - 1, lambda d: holders.get(block_hashes[d - 1], 0).bit_count() > count)
        return num_known, found

    def is_branch_point(self, block_hash: int) -> bool:
        """Whether prompts branch at ``block_hash``: :meth:`learn` took it inside
        a prompt's chain (a holder's entry has a learn's tick), never as a
        prompt's last block. A system prompt continued by several prompts is
        one; a chat's history is not: its next turn continues from the last
        turn's prompt's end, or from answer blocks only summaries reported."""
        mask = 0 if block_hash in self._prompt_ends else self._holders.get(block_hash, 0)
        while mask:
            low = mask & -mask
            mask ^= low
            if self._entries[self._replica_at[low.bit_length() - 1]][block_hash] > 0:
                return True
        return False

    def depth(self, replica_id: str, block_hashes: Sequence[int]) -> int:
        """How many leading blocks of ``block_hashes`` ``replica_id`` holds. O(log n)."""
        slot = self._slot.get(replica_id)
        if slot is None:
            return 0
        holders = self._holders
        return last_true(len(block_hashes), lambda d: holders.get(block_hashes[d - 1], 0) >> slot & 1 == 1)

    # ------------------------------------------------------------------ updates
    def learn(self, replica_id: str, block_hashes: Sequence[int], now: float) -> None:
        """``replica_id`` now holds every block of ``block_hashes`` (a prompt's chain)."""
        num_blocks = len(block_hashes)
        if not num_blocks:
            return
        bit = 1 << self._slot_of(replica_id)
        entries = self._entries[replica_id]
        num_known = len(entries)
        tick = self._tick  # one per learn: its run's FIFO order puts the deepest block first out
        self._tick += 1
        deepest_first = block_hashes[::-1]
        entries.update(zip(deepest_first, repeat(tick)))
        if len(entries) > num_known:  # new keys went last: only they lack the bit (1.)
            holders = self._holders
            for block_hash in islice(reversed(entries), len(entries) - num_known):
                holders[block_hash] = holders.get(block_hash, 0) | bit
        self._prompt_ends.add(deepest_first[0])
        self._fifo[replica_id].append((tick, deepest_first))
        self._fifo_size[replica_id] += num_blocks
        self._tick_times.append((now, tick))
        if len(self._tick_times) > 4096:
            self._first_tick_after(now - self.learned_grace_s)  # prunes
        self._maybe_trim(replica_id, self.learn_slack(replica_id))

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

    def remove_replica(self, replica_id: str) -> None:
        """Forget everything about ``replica_id`` (it died or left)."""
        slot = self._slot.pop(replica_id, None)
        if slot is None:
            return
        bit = 1 << slot
        for block_hash in self._entries.pop(replica_id):
            self._clear_bit(block_hash, bit)
        del self._fifo[replica_id], self._fifo_size[replica_id], self._trimmed[replica_id]
        self._capacity.pop(replica_id, None)
        self._unreported.pop(replica_id, None)
        self._applied_tick.pop(replica_id, None)
        self._replica_at[slot] = None

    # ----------------------------------------------------------------- private
    def _slot_of(self, replica_id: str) -> int:
        slot = self._slot.get(replica_id)
        if slot is None:
            free = [i for i, r in enumerate(self._replica_at) if r is None]
            slot = free[0] if free else len(self._replica_at)
            if slot == len(self._replica_at):
                self._replica_at.append(replica_id)
            else:
                self._replica_at[slot] = replica_id
            self._slot[replica_id] = slot
            self._entries[replica_id] = {}
            self._fifo[replica_id] = deque()
            self._fifo_size[replica_id] = 0
            self._trimmed[replica_id] = set()
        return slot

    def _first_tick_after(self, time_s: float) -> int:
        """The first tick learned after ``time_s``; older learn records are dropped."""
        times = self._tick_times
        position = bisect.bisect_right(times, (time_s, float("inf")))
        if position:
            del times[:position]
        return times[0][1] if times else self._tick

    def _clear_bit(self, block_hash: int, bit: int) -> None:
        mask = self._holders.get(block_hash, 0) & ~bit
        if mask:
            self._holders[block_hash] = mask
        else:
            self._holders.pop(block_hash, None)
            self._prompt_ends.discard(block_hash)

    def _maybe_trim(self, replica_id: str, slack: int = 0) -> None:
        """Evict least recent entries down to capacity + ``slack``; rebuild a mostly stale FIFO."""
        entries = self._entries[replica_id]
        excess = len(entries) - self.capacity_blocks(replica_id) - slack
        if excess > 0:
            evicted, num_popped = pop_least_recent(self._fifo[replica_id], entries, excess)
            self._fifo_size[replica_id] -= num_popped
            bit = 1 << self._slot[replica_id]
            for block_hash in evicted:  # pop_least_recent deleted their entries
                self._clear_bit(block_hash, bit)
            if replica_id in self._applied_tick:  # kept for the next summary, at most TRIMMED_KEPT caches' worth
                trimmed = self._trimmed[replica_id]
                room = TRIMMED_KEPT * self.capacity_blocks(replica_id) - len(trimmed)
                if room > 0:
                    trimmed.update(evicted[:room])
        if self._fifo_size[replica_id] > 8 * len(entries) + 4096:
            self._fifo[replica_id] = deque(fifo_runs(self._current_items(replica_id), RUN_LIMIT))
            self._fifo_size[replica_id] = len(entries)

    def _current_items(self, replica_id: str) -> list[tuple[int, int]]:
        """``replica_id``'s current FIFO items, each entry once: reported blocks in hash
        order, then learned ones in FIFO order (deepest blocks before their ancestors)."""
        entries = self._entries[replica_id]
        learned = dict.fromkeys((t, h) for t, h in fifo_items(self._fifo[replica_id]) if t and entries.get(h) == t)
        return [(0, h) for h in sorted(h for h, t in entries.items() if not t)] + list(learned)

    def check_invariants(self) -> None:
        pairs_from_entries = {(h, r) for r, entries in self._entries.items() for h in entries}
        pairs_from_holders = {
            (h, self._replica_at[slot]) for h, mask in self._holders.items()
            for slot in range(mask.bit_length()) if mask >> slot & 1
        }
        assert pairs_from_entries == pairs_from_holders, "holders and entries disagree"
        assert all(self._holders.values()), "zero holder mask"
        assert self._prompt_ends <= self._holders.keys(), "a prompt end nobody holds"
        assert set(self._slot) == set(self._entries) == set(self._fifo) == set(self._fifo_size) == set(self._trimmed)
        assert set(self._unreported) == set(self._applied_tick) <= set(self._entries)
        for replica_id, entries in self._entries.items():
            assert self._replica_at[self._slot[replica_id]] == replica_id
            assert len(entries) <= self.capacity_blocks(replica_id) + self.learn_slack(replica_id), replica_id
            assert len(self._trimmed[replica_id]) <= TRIMMED_KEPT * self.capacity_blocks(replica_id), replica_id
            assert all(run for _, run in self._fifo[replica_id]), "empty FIFO run"
            fifo = list(fifo_items(self._fifo[replica_id]))
            assert len(fifo) == self._fifo_size[replica_id], replica_id
            queued = set(fifo)
            assert all((t, h) in queued for h, t in entries.items()), replica_id
            ticks = [t for t, _ in fifo if t > 0]
            assert ticks == sorted(ticks), replica_id
            assert all(len(run) <= RUN_LIMIT for t, run in self._fifo[replica_id] if not t), replica_id

