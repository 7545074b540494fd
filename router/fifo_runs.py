"""A replica's recency FIFO in :class:`router.prefix_index.PrefixIndex`:
``(tick, hash)`` items stored as runs ``(first_tick, hashes)``, one per
learn (item ``k`` of a run is ``(first_tick + k, hashes[k])``, or
``(0, hashes[k])`` when ``first_tick`` is 0)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence


def fifo_items(runs: Iterable[tuple[int, Sequence[int]]]) -> Iterator[tuple[int, int]]:
    """The ``(tick, hash)`` items of FIFO runs, in order."""
    for first_tick, run in runs:
        for offset, block_hash in enumerate(run):
            yield (first_tick + offset if first_tick else 0), block_hash


def fifo_runs(items: Sequence[tuple[int, int]]) -> Iterator[tuple[int, tuple[int, ...]]]:
    """FIFO runs holding ``items`` (``(tick, hash)``, in order): items of tick 0,
    or of consecutive ticks, share a run."""
    start = 0
    for end in range(1, len(items) + 1):
        if end == len(items) or items[end][0] != (items[end - 1][0] + 1 if items[start][0] else 0):
            yield items[start][0], tuple(h for _, h in items[start:end])
            start = end
