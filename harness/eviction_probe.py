"""Where the hit rate below the ceiling goes: eviction rules over one pooled cache.

    python -m harness.eviction_probe --trace T --replicas 8 --budget-tokens 1250000
    python -m harness.eviction_probe --workload shared-prefix --replicas 8 --budget-tokens 8000

One cache of the fleet's whole budget reads every prompt in arrival order
(as ``router.floors`` does), under rules that differ only in what they keep:

- ``lru``: least recently used goes first;
- ``segmented_lru``: new units on probation, a second read protects them
  (80 % of the room), as the engine's cache does without its adaptation;
- ``s3_fifo``: a small FIFO for new units (10 %), a main FIFO with one
  more pass for units read while there, and a ghost list of recent
  evictions whose return goes straight to main (Yang et al., SOSP 2023);
- ``lru_oracle_admission``: LRU that never caches a unit no later prompt
  reads (with ``--horizon``: none that no prompt in the next N reads) —
  knowledge no server has, here to measure what admission is worth;
- ``segmented_lru_branch_admission``: the segmented LRU with an admission
  a server could learn online (:class:`BranchAdmission`): a prompt's new
  units are not cached where earlier branches off the same point were
  mostly never read again.

Units are told apart by their whole prefix; unlike the radix tree, a unit
may stay when its parent goes (so ``lru`` reads a little above
``router.simulate``'s one-cache LRU). A prompt's hit is its leading run of
kept units. Every figure is at most :func:`router.floors.hit_ceiling`.
Also printed: how often a newly cached unit is read again, by where it sits.
"""

from __future__ import annotations

import argparse
import sys
from collections import OrderedDict, defaultdict
from collections.abc import Sequence

from router.floors import add_workload_args, hit_ceiling, prefix_nodes, workload_from_args
from router.workload import Workload

NEVER = float("inf")


def unit_paths(workload: Workload) -> list[tuple[list[int], list[int]]]:
    """Per request, the node ids of the units it reads and of those it caches
    (:func:`router.floors.prefix_nodes`)."""
    node_of: dict[tuple[int, int], int] = {}
    return [(prefix_nodes(r.units, node_of), prefix_nodes(r.cache_units, node_of)) for r in workload.requests]


class Lru:
    def __init__(self, capacity: int) -> None:
        self.capacity, self.kept = capacity, OrderedDict()

    def __contains__(self, node: int) -> bool:
        return node in self.kept

    def read(self, node: int) -> None:
        self.kept.move_to_end(node)

    def write(self, node: int) -> None:
        self.kept[node] = None
        if len(self.kept) > self.capacity:
            self.kept.popitem(last=False)


class SegmentedLru:
    def __init__(self, capacity: int, protected_share: float = 0.8) -> None:
        self.capacity, self.protected_room = capacity, int(capacity * protected_share)
        self.probation, self.protected = OrderedDict(), OrderedDict()

    def __contains__(self, node: int) -> bool:
        return node in self.probation or node in self.protected

    def read(self, node: int) -> None:
        if node in self.protected:
            self.protected.move_to_end(node)
            return
        del self.probation[node]
        self.protected[node] = None
        if len(self.protected) > self.protected_room:
            self.probation[self.protected.popitem(last=False)[0]] = None

    def write(self, node: int) -> None:
        self.probation[node] = None
        while len(self.probation) + len(self.protected) > self.capacity:
            (self.probation or self.protected).popitem(last=False)


class S3Fifo:
    def __init__(self, capacity: int, small_share: float = 0.1) -> None:
        self.capacity, self.small_room = capacity, max(1, int(capacity * small_share))
        self.small, self.main, self.ghost = OrderedDict(), OrderedDict(), OrderedDict()
        self.reads: dict[int, int] = {}

    def __contains__(self, node: int) -> bool:
        return node in self.small or node in self.main

    def read(self, node: int) -> None:
        self.reads[node] = min(self.reads[node] + 1, 3)

    def _evict_one(self) -> None:
        if len(self.small) >= self.small_room or not self.main:
            while self.small:
                node = self.small.popitem(last=False)[0]
                if self.reads[node]:  # read while new: to main
                    self.reads[node] = 0
                    self.main[node] = None
                    continue
                del self.reads[node]
                self.ghost[node] = None
                if len(self.ghost) > self.capacity - self.small_room:
                    self.ghost.popitem(last=False)
                return
        while self.main:
            node = self.main.popitem(last=False)[0]
            if self.reads[node]:  # one more pass
                self.reads[node] -= 1
                self.main[node] = None
            else:
                del self.reads[node]
                return

    def write(self, node: int) -> None:
        while len(self.small) + len(self.main) >= self.capacity:
            self._evict_one()
        if node in self.ghost:  # evicted new, written again: it is reused after all
            del self.ghost[node]
            self.main[node] = None
        else:
            self.small[node] = None
        self.reads[node] = 0


ROOT = -1  # the branch point of a prompt that found nothing kept


class BranchAdmission:
    """Admission learned from what a server sees: at a prompt's branch point
    (the deepest unit it found kept, or :data:`ROOT`), how many earlier
    branches left that point and how many of them a later prompt read
    again (passed through their first unit, kept or not). A prompt's new
    units are not cached when at least ``min_branches`` earlier branches
    left its point and under ``min_reuse`` of them were read again; a
    prompt that found nothing is always cached. Documents under many
    one-off questions stop being written past the document. Measured
    (BENCHMARKS.md "The prefill in progress, and admission learned
    online"): +0.0007 on Mooncake 8 x 1.25M over the segmented LRU, and
    -0.0115 on the multi-turn chats, whose new turns branch off a shared
    system prompt and are read again only after their answer: by then more
    branches have left the point unread, and the next chats are refused."""

    def __init__(self, min_branches: int = 2, min_reuse: float = 0.15) -> None:
        self.min_branches, self.min_reuse = min_branches, min_reuse
        self._counts: dict[int, list[int]] = defaultdict(lambda: [0, 0])  # point -> [branches, read again]
        self._head_of: dict[int, list] = {}  # a branch's first unit -> [its point, read again]

    def observe(self, read: Sequence[int]) -> None:
        """A prompt reads ``read``: every branch it passes through was read again."""
        for node in read:
            head = self._head_of.get(node)
            if head is not None and not head[1]:
                head[1] = True
                self._counts[head[0]][1] += 1

    def admits(self, point: int, head: int) -> bool:
        """Whether a branch starting at ``head`` off ``point`` is cached (and count it)."""
        counts = self._counts[point]
        earlier, read_again = counts
        if head not in self._head_of:
            self._head_of[head] = [point, False]
            counts[0] += 1
        return point == ROOT or earlier < self.min_branches or read_again >= self.min_reuse * earlier


def next_reads(paths: list[tuple[list[int], list[int]]]) -> list[dict[int, float]]:
    """Per request, each written node's next read by a later request (its number, or NEVER)."""
    upcoming: dict[int, float] = {}
    out: list[dict[int, float]] = [{} for _ in paths]
    for number in range(len(paths) - 1, -1, -1):
        read, written = paths[number]
        out[number] = {node: upcoming.get(node, NEVER) for node in written}
        for node in read:
            upcoming[node] = number
    return out


def replay(workload: Workload, paths, cache, admit=None, branches: BranchAdmission | None = None) -> float:
    """Token hit rate of ``cache`` over the workload; ``admit(number, node)``
    False: the unit is not cached; ``branches``: whether a prompt's new
    units are cached at all (:class:`BranchAdmission`, which sees every prompt's reads)."""
    cached = total = 0
    for number, (request, (read, written)) in enumerate(zip(workload.requests, paths)):
        lead = 0
        while lead < len(read) and read[lead] in cache:
            cache.read(read[lead])
            lead += 1
        cached += request.cached_tokens(lead)
        total += request.num_prompt_tokens
        if branches is not None:
            branches.observe(read)
            if lead < len(written) and not branches.admits(read[lead - 1] if lead else ROOT, written[lead]):
                continue
        for node in written[lead:]:
            if node not in cache and (admit is None or admit(number, node)):
                cache.write(node)
    return cached / max(total, 1)


def reuse_by_place(workload: Workload, paths, upcoming) -> dict[str, tuple[int, float]]:
    """How often a unit cached for the first time is read again: ``{place:
    (units, share read again)}``; place is how much of its request hit
    (``cold``: nothing, ``deep``: over half) and whether it is the prompt's last unit."""
    seen: set[int] = set()
    counts = defaultdict(lambda: [0, 0])
    for number, (read, _) in enumerate(paths):
        lead = 0
        while lead < len(read) and read[lead] in seen:
            lead += 1
        depth = "cold" if lead == 0 else "deep" if lead > len(read) / 2 else "shallow"
        for position, node in enumerate(read):
            if node in seen:
                continue
            place = f"{depth}, {'last unit' if position == len(read) - 1 else 'inner unit'}"
            for key in (place, "all"):
                counts[key][0] += 1
                counts[key][1] += upcoming[number].get(node, NEVER) != NEVER
        seen.update(read)
    return {key: (num, again / num) for key, (num, again) in sorted(counts.items())}


def probe(workload: Workload, capacity: int, horizons: Sequence[int] = ()) -> dict[str, float]:
    paths = unit_paths(workload)
    upcoming = next_reads(paths)
    figures = {
        "ceiling": hit_ceiling(workload, capacity),
        "lru": replay(workload, paths, Lru(capacity)),
        "segmented_lru": replay(workload, paths, SegmentedLru(capacity)),
        "s3_fifo": replay(workload, paths, S3Fifo(capacity)),
        "segmented_lru_branch_admission": replay(workload, paths, SegmentedLru(capacity), branches=BranchAdmission()),
        "lru_oracle_admission": replay(workload, paths, Lru(capacity),
                                       lambda number, node: upcoming[number][node] != NEVER),
    }
    for horizon in horizons:
        figures[f"lru_oracle_admission_{horizon}"] = replay(
            workload, paths, Lru(capacity), lambda number, node: upcoming[number][node] - number <= horizon)
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harness.eviction_probe", description=__doc__.split("\n\n")[0])
    add_workload_args(parser)
    parser.add_argument("--horizon", type=int, action="append", default=[],
                        help="also: oracle admission that sees only the next N requests (repeatable)")
    args = parser.parse_args(argv)
    workload = workload_from_args(parser, args)
    capacity = args.budget_tokens // workload.unit_tokens * args.replicas
    for name, hit in probe(workload, capacity, args.horizon).items():
        print(f"{name:>28}: hit {hit:.4f}")
    paths = unit_paths(workload)
    print("units cached for the first time, and how often a later prompt reads them:")
    for place, (num, share) in reuse_by_place(workload, paths, next_reads(paths)).items():
        print(f"{place:>28}: {num:>7} units, {share:.3f} read again")
    return 0


if __name__ == "__main__":
    sys.exit(main())
