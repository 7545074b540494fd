"""Which replica holds which chained block hash, as far as one router knows."""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Collection, Sequence
from itertools import islice, repeat

from router.chain_search import last_true
from router.fifo_runs import RUN_LIMIT, fifo_items, fifo_runs, pop_least_recent
from router.prefix_index_summaries import SummaryApplyMixin

# a replica's trimmed entries kept for its next summary, in caches' worth: past that (an index churning its
# whole cache many times between two summaries), a delta puts back fewer than a full summary would
TRIMMED_KEPT = 8


class PrefixIndex(SummaryApplyMixin):
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
    A learn writes ``_young[r]`` (hash → tick, the blocks learned at ``r``
    since its last summary; its tick wins over ``_entries[r]``'s) and never
    ``_entries[r]``: a summary (or a trim, or a FIFO rebuild) folds it in, off the decision
    path, so no learn grows a dict a cache's size (a rebuild of one held 64
    of 3,000 decisions at 64 replicas up 120–280 µs: BENCHMARKS.md).
    ``_num_young_new[r]`` counts its hashes ``_entries[r]`` lacks.

    Invariants (checked by :meth:`check_invariants`):

    1. ``_holders[h] & bit(r)`` iff ``h`` is in ``_entries[r]`` or
       ``_young[r]``; no zero masks; every young tick > 0, and
       ``_num_young_new[r]`` is right.
    2. ``num_blocks(r) <= capacity_blocks(r) + learn_slack(r)``, and
       ``<= capacity_blocks(r)`` right after a summary (``_young[r]`` empty).
    3. Every entry has its current ``(tick, hash)`` (:meth:`ticks`) in ``_fifo[r]``; items
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
        self._young: dict[str, dict[int, int]] = {}  # learned since the last fold: hash -> tick
        self._num_young_new: dict[str, int] = {}  # young hashes not in _entries
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
        return len(entries) + self._num_young_new[replica_id] if entries is not None else 0

    def ticks(self, replica_id: str) -> dict[int, int]:
        """Each block ``replica_id`` holds → its recency tick (0: only a
        summary reported it). A copy, O(blocks held): for checks and tests."""
        return {**self._entries.get(replica_id, {}), **self._young.get(replica_id, {})}

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
            replica_id = self._replica_at[low.bit_length() - 1]
            if block_hash in self._young[replica_id] or self._entries[replica_id][block_hash] > 0:
                return True  # a young entry is a learn's
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
        young = self._young[replica_id]
        num_young = len(young)
        tick = self._tick  # one per learn: its run's FIFO order puts the deepest block first out
        self._tick += 1
        deepest_first = block_hashes[::-1]
        young.update(zip(deepest_first, repeat(tick)))
        if len(young) > num_young:  # keys new to it went last: those without the bit are new here (1.)
            holders, num_new = self._holders, 0
            for block_hash in islice(reversed(young), len(young) - num_young):
                mask = holders.get(block_hash, 0)
                if not mask & bit:
                    holders[block_hash] = mask | bit
                    num_new += 1
            self._num_young_new[replica_id] += num_new
        self._prompt_ends.add(deepest_first[0])
        self._fifo[replica_id].append((tick, deepest_first))
        self._fifo_size[replica_id] += num_blocks
        self._tick_times.append((now, tick))
        if len(self._tick_times) > 4096:
            self._first_tick_after(now - self.learned_grace_s)  # prunes
        self._maybe_trim(replica_id, self.learn_slack(replica_id))

    def remove_replica(self, replica_id: str) -> None:
        """Forget everything about ``replica_id`` (it died or left)."""
        slot = self._slot.pop(replica_id, None)
        if slot is None:
            return
        bit = 1 << slot
        self._fold(replica_id)
        for block_hash in self._entries.pop(replica_id):
            self._clear_bit(block_hash, bit)
        del self._fifo[replica_id], self._fifo_size[replica_id], self._trimmed[replica_id]
        del self._young[replica_id], self._num_young_new[replica_id]
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
            self._entries[replica_id], self._young[replica_id], self._num_young_new[replica_id] = {}, {}, 0
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

    def _fold(self, replica_id: str) -> None:
        """Move ``replica_id``'s young entries into its entries (their ticks win)."""
        young = self._young[replica_id]
        if young:
            self._entries[replica_id].update(young)
            self._young[replica_id], self._num_young_new[replica_id] = {}, 0

    def _maybe_trim(self, replica_id: str, slack: int = 0) -> None:
        """Evict least recent entries down to capacity + ``slack``; rebuild a mostly stale FIFO."""
        excess = self.num_blocks(replica_id) - self.capacity_blocks(replica_id) - slack
        if excess > 0:
            self._fold(replica_id)  # eviction reads every entry's current tick
            evicted, num_popped = pop_least_recent(self._fifo[replica_id], self._entries[replica_id], excess)
            self._fifo_size[replica_id] -= num_popped
            bit = 1 << self._slot[replica_id]
            for block_hash in evicted:  # pop_least_recent deleted their entries
                self._clear_bit(block_hash, bit)
            if replica_id in self._applied_tick:  # kept for the next summary, at most TRIMMED_KEPT caches' worth
                trimmed = self._trimmed[replica_id]
                room = TRIMMED_KEPT * self.capacity_blocks(replica_id) - len(trimmed)
                if room > 0:
                    trimmed.update(evicted[:room])
        if self._fifo_size[replica_id] > 8 * self.num_blocks(replica_id) + 4096:
            self._fold(replica_id)  # the rebuild keeps the items whose tick is the entry's
            self._fifo[replica_id] = deque(fifo_runs(self._current_items(replica_id), RUN_LIMIT))
            self._fifo_size[replica_id] = len(self._entries[replica_id])

    def _current_items(self, replica_id: str) -> list[tuple[int, int]]:
        """``replica_id``'s current FIFO items, each entry once: reported blocks in hash
        order, then learned ones in FIFO order (deepest blocks before their ancestors)."""
        entries = self._entries[replica_id]
        learned = dict.fromkeys((t, h) for t, h in fifo_items(self._fifo[replica_id]) if t and entries.get(h) == t)
        return [(0, h) for h in sorted(h for h, t in entries.items() if not t)] + list(learned)

    def check_invariants(self) -> None:
        for replica_id, young in self._young.items():
            assert all(tick > 0 for tick in young.values()), "a young entry without a learn's tick"
            assert self._num_young_new[replica_id] == len(young.keys() - self._entries[replica_id].keys())
        pairs_from_entries = {(h, r) for r in self._entries for h in self.ticks(r)}
        pairs_from_holders = {
            (h, self._replica_at[slot]) for h, mask in self._holders.items()
            for slot in range(mask.bit_length()) if mask >> slot & 1
        }
        assert pairs_from_entries == pairs_from_holders, "holders and entries disagree"
        assert all(self._holders.values()), "zero holder mask"
        assert self._prompt_ends <= self._holders.keys(), "a prompt end nobody holds"
        assert set(self._slot) == set(self._entries) == set(self._fifo) == set(self._fifo_size) == set(self._trimmed) \
            == set(self._young) == set(self._num_young_new)
        assert set(self._unreported) == set(self._applied_tick) <= set(self._entries)
        for replica_id in self._entries:
            entries = self.ticks(replica_id)
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

