"""A replica's successive summaries as it sends them: snapshots now and
then, deltas in between (:class:`SummaryStream`). Pure Python."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cache.summary import CacheSummary


class SummaryStream:
    """Turns a replica's successive full summaries into what it sends: a full
    snapshot now and then, deltas in between.

    A snapshot goes out first, then whenever ``max_periods`` summaries have
    passed since the last one, or a delta (added + removed) would exceed
    ``max_delta_ratio`` of the snapshot's size. ``cumulative=True``: each
    delta is against the last snapshot, so a router that missed the deltas
    in between loses nothing (``bytes ≈ snapshot / max_periods + churn ×
    periods since it``). ``cumulative=False``: each delta is against the
    previous summary (``bytes ≈ snapshot / max_periods + churn per period``),
    for a channel that delivers every summary in order; a router that misses
    one sees the gap (the next delta's base is not the state it holds) and
    waits for the next snapshot, routing on its own decisions meanwhile.
    ``epoch`` names this process: a restarted replica starts a new stream,
    and its first snapshot replaces whatever a router held for it.
    """

    def __init__(self, epoch: str, max_periods: int = 30, max_delta_ratio: float = 0.25,
                 cumulative: bool = False) -> None:
        if not isinstance(epoch, str) or not epoch:
            raise ValueError(f"epoch must be a non-empty str, got {epoch!r}")
        if type(max_periods) is not int or max_periods <= 0:
            raise ValueError(f"max_periods must be a positive int, got {max_periods!r}")
        if not 0 < max_delta_ratio <= 1:
            raise ValueError(f"max_delta_ratio must be in (0, 1], got {max_delta_ratio!r}")
        self.epoch = epoch
        self.max_periods = max_periods
        self.max_delta_ratio = max_delta_ratio
        self.is_cumulative = bool(cumulative)
        self._base: frozenset[int] | None = None  # the state deltas are taken against
        self._base_version = 0
        self._snapshot_size = 0
        self._periods = 0

    def encode(self, full: CacheSummary) -> CacheSummary:
        """What to send for ``full`` (a full summary with this replica's next version)."""
        if full.is_delta:
            raise ValueError("encode takes a full summary")
        if self._base is not None and self._periods < self.max_periods:
            added = full.block_hashes - self._base
            removed = self._base - full.block_hashes
            if len(added) + len(removed) <= self.max_delta_ratio * max(self._snapshot_size, 64):
                delta = replace(full, epoch=self.epoch, base_version=self._base_version,
                                block_hashes=frozenset(added), removed_hashes=frozenset(removed))
                self._periods += 1
                if not self.is_cumulative:
                    self._base, self._base_version = full.block_hashes, full.version
                return delta
        self._base, self._base_version, self._periods = full.block_hashes, full.version, 0
        self._snapshot_size = len(full.block_hashes)
        return replace(full, epoch=self.epoch, base_version=full.version)
