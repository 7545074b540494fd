"""A replica's recency FIFO in :class:`router.prefix_index.PrefixIndex`:
``(tick, hash)`` items stored as runs ``(tick, hashes)``: every item of a
run has the run's tick (one learn's tick, or 0 for reported blocks), so a
learn allocates one tuple and no int per block."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator, Sequence

# the longest run of reported blocks (tick 0) or of a rebuilt FIFO: trimming a few off a run copies its rest
RUN_LIMIT = 256


def fifo_items(runs: Iterable[tuple[int, Sequence[int]]]) -> Iterator[tuple[int, int]]:
    """The ``(tick, hash)`` items of FIFO runs, in order."""
    for tick, run in runs:
        for block_hash in run:
            yield tick, block_hash


def fifo_runs(items: Sequence[tuple[int, int]], max_length: int | None = None) -> Iterator[tuple[int, tuple[int, ...]]]:
    """FIFO runs holding ``items`` (``(tick, hash)``, in order): consecutive
    items of one tick share a run of at most ``max_length`` items."""
    limit = max_length or len(items)
    start = 0
    for end in range(1, len(items) + 1):
        if end == len(items) or end - start == limit or items[end][0] != items[start][0]:
            yield items[start][0], tuple(h for _, h in items[start:end])
            start = end


def reported_runs(hashes: Sequence[int]) -> list[tuple[int, tuple[int, ...]]]:
    """Runs of tick-0 items holding ``hashes`` in order, ``RUN_LIMIT`` at most each."""
    return [(0, tuple(hashes[start:start + RUN_LIMIT])) for start in range(0, len(hashes), RUN_LIMIT)]


def pop_least_recent(fifo: deque[tuple[int, Sequence[int]]], entries: dict[int, int],
                     count: int) -> tuple[list[int], int]:
    """Pop ``fifo``'s items up to its ``count``-th current one (an item is
    current iff ``entries`` maps its hash to its tick), deleting those
    ``count`` entries from ``entries`` as it goes; return their hashes,
    least recent first, and how many items left the FIFO. Stale items met on
    the way are dropped; the rest of the last run goes back to the head.
    ``entries`` must hold at least ``count`` entries with a current item.

    A hash may have two items that look current: a reported block (tick 0)
    that a summary deleted while its item stayed queued, and that a later
    summary reported again. Deleting as it goes takes each entry once, at
    its least recent item."""
    get = entries.get
    evicted: list[int] = []
    num_popped = 0
    while True:
        tick, run = fifo.popleft()
        num_popped += len(run)
        for cut, block_hash in enumerate(run, 1):  # cut: items of the run looked at
            if get(block_hash) == tick:
                del entries[block_hash]
                evicted.append(block_hash)
                if len(evicted) == count:
                    if cut < len(run):
                        fifo.appendleft((tick, run[cut:]))
                        num_popped -= len(run) - cut
                    return evicted, num_popped
