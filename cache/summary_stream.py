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

    ``by_reference=True`` (with ``cumulative``, for a latest-value channel
    such as Ray Serve's routing stats): only the first summary is an inline
    snapshot. Where the others would send one, the stream *rebases* instead:
    the new base is the state it sent last (``last_sent``), which every
    router that saw that summary holds already, and the delta is taken
    against it. A router that did not see it fetches the base's block set
    out of band (:attr:`base_version`, :attr:`base_hashes`: the adapter
    publishes them, e.g. in Ray's object store, and names them in the
    deltas), so one summary naming its base is enough to rebuild the full
    set. An inline snapshot still goes out when the delta against the last
    state sent would change more blocks than the snapshot holds (it would
    be the larger message).

    Invariant: every delta's ``base_version`` is the version of a summary
    this stream sent before it, or of the snapshot it sent; with
    ``by_reference``, it is :attr:`base_version`.
    """

    def __init__(self, epoch: str, max_periods: int = 30, max_delta_ratio: float = 0.25,
                 cumulative: bool = False, by_reference: bool = False) -> None:
        if not isinstance(epoch, str) or not epoch:
            raise ValueError(f"epoch must be a non-empty str, got {epoch!r}")
        if type(max_periods) is not int or max_periods <= 0:
            raise ValueError(f"max_periods must be a positive int, got {max_periods!r}")
        if not 0 < max_delta_ratio <= 1:
            raise ValueError(f"max_delta_ratio must be in (0, 1], got {max_delta_ratio!r}")
        if by_reference and not cumulative:
            raise ValueError("by_reference needs cumulative deltas (a latest-value channel drops the chained ones)")
        self.epoch = epoch
        self.max_periods = max_periods
        self.max_delta_ratio = max_delta_ratio
        self.is_cumulative = bool(cumulative)
        self.is_by_reference = bool(by_reference)
        self._base: frozenset[int] | None = None  # the state deltas are taken against
        self._base_version = 0
        self._snapshot_size = 0
        self._periods = 0
        self._last_sent: tuple[int, frozenset[int]] | None = None  # (version, full set) of the last summary sent

    @property
    def base_version(self) -> int:
        """The version the next delta is taken against (0 before the first summary)."""
        return self._base_version

    @property
    def base_hashes(self) -> frozenset[int]:
        """The full block set at :attr:`base_version`."""
        return self._base or frozenset()

    def encode(self, full: CacheSummary) -> CacheSummary:
        """What to send for ``full`` (a full summary with this replica's next version)."""
        if full.is_delta:
            raise ValueError("encode takes a full summary")
        sent = self._encode(full)
        self._last_sent = (full.version, full.block_hashes)
        return sent

    def _encode(self, full: CacheSummary) -> CacheSummary:
        if self._base is not None and self._periods < self.max_periods:
            delta = self._delta(full, self._base_version, self._base)
            if delta is not None:
                self._periods += 1
                if not self.is_cumulative:
                    self._base, self._base_version = full.block_hashes, full.version
                return delta
        if self.is_by_reference and self._last_sent is not None:
            version, hashes = self._last_sent
            delta = self._delta(full, version, hashes, limit=len(full.block_hashes))  # else the snapshot is smaller
            if delta is not None:
                self._base, self._base_version, self._periods = hashes, version, 1
                self._snapshot_size = len(hashes)
                return delta
        self._base, self._base_version, self._periods = full.block_hashes, full.version, 0
        self._snapshot_size = len(full.block_hashes)
        return replace(full, epoch=self.epoch, base_version=full.version)

    def _delta(self, full: CacheSummary, base_version: int, base: frozenset[int],
               limit: float | None = None) -> CacheSummary | None:
        """``full`` as a delta against ``base``, or None if its changes would exceed
        ``limit`` (default: ``max_delta_ratio`` of the snapshot's size)."""
        added = full.block_hashes - base
        removed = base - full.block_hashes
        if limit is None:
            limit = self.max_delta_ratio * max(self._snapshot_size, 64)
        if len(added) + len(removed) > limit:
            return None
        return replace(full, epoch=self.epoch, base_version=base_version,
                       block_hashes=frozenset(added), removed_hashes=frozenset(removed))
