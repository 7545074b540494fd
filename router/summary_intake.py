"""Which replica summaries a router applies, and what full block set each means."""

from __future__ import annotations

from typing import NamedTuple

from cache.summary import CacheSummary


class Accepted(NamedTuple):
    """What an accepted summary stands for: ``hashes``, the replica's full
    block set (the intake's own set: read it during the call, never keep
    it); ``keep_learned``: False after a restart (nothing learned before
    survives); ``changes``: ``(added, removed)`` when the set was updated in
    place from the state applied just before it (a chained delta), so the
    index may apply only those, else None."""

    hashes: set[int] | frozenset[int]
    keep_learned: bool
    changes: tuple[frozenset[int], frozenset[int]] | None = None


class SummaryIntake:
    """Per replica: the newest version applied, its epoch, and the states a
    delta may be taken against: the last snapshot (kept until a delta moves
    past it), the state applied last, updated in place by a delta taken
    against it (O(changes), not O(cached blocks)), and the state before
    that in-place delta (rebuilt only if a delta is taken against it).

    :meth:`accept` returns the full block set a summary stands for
    (:class:`Accepted`), or None to skip the summary: an older or equal
    version in the same epoch, or a delta against a state this router does
    not hold (it missed a summary; it waits for the next snapshot). A new
    epoch (the replica restarted) is accepted whatever its version, and then
    nothing learned before it survives.

    A base fetched out of band (:meth:`install_base`: a stream sent *by
    reference*, ``cache.summary.SummaryStream``) is one more state a delta
    may be taken against, in the epoch it was fetched for; :meth:`missing_base`
    tells the caller that a refused summary waits for one.

    Invariants: versions and epochs know the same replicas; a replica with
    a held state has a version (one sending plain summaries, no epoch, has
    none); a fetched base is dropped with its replica (:meth:`remove`) and
    once a delta used it.
    """

    def __init__(self) -> None:
        self._versions: dict[str, int] = {}
        self._epochs: dict[str, str] = {}
        self._snapshots: dict[str, tuple[int, frozenset[int]]] = {}  # replica -> the last snapshot applied
        self._current: dict[str, tuple[int, set[int]]] = {}  # replica -> the state applied last (mutable)
        # replica -> (version, added, removed) of the delta applied in place last: the state before it is
        # current - added | removed (a cumulative stream's next delta may be taken against it)
        self._undo: dict[str, tuple[int, frozenset[int], frozenset[int]]] = {}
        self._fetched: dict[str, tuple[str, int, frozenset[int]]] = {}  # replica -> (epoch, version, hashes)

    @property
    def replica_ids(self) -> set[str]:
        """Replicas this intake holds anything for (a version, or a fetched base)."""
        return set(self._versions) | set(self._fetched)

    def has_seen(self, replica_id: str, version: object, epoch: object) -> bool:
        """True if a summary with this version and epoch would be skipped (cheap, before parsing)."""
        return (type(version) is int and version <= self._versions.get(replica_id, -1)
                and (epoch or "") == self._epochs.get(replica_id))

    def accept(self, summary: CacheSummary) -> Accepted | None:
        replica_id = summary.replica_id
        is_new_epoch = self.is_restart(summary)
        if not is_new_epoch and summary.version <= self._versions.get(replica_id, -1):
            return None
        changes = None
        if summary.is_delta:
            current = self._current.get(replica_id)
            added, removed = summary.block_hashes, summary.removed_hashes
            if not is_new_epoch and current is not None and current[0] == summary.base_version:
                hashes = current[1]
                hashes -= removed
                hashes |= added
                changes = (added, removed)
                self._undo[replica_id] = (summary.base_version, added, removed)
                snapshot = self._snapshots.get(replica_id)
                if snapshot is not None and snapshot[0] != summary.base_version:
                    del self._snapshots[replica_id]  # a chained stream has moved past it for good
            else:
                base = self._base_for(summary, is_new_epoch)
                if base is None:
                    return None
                hashes = (set(base) | added) - removed
                self._snapshots[replica_id] = (summary.base_version, frozenset(base))
                self._undo.pop(replica_id, None)
            self._current[replica_id] = (summary.version, hashes)
            self._fetched.pop(replica_id, None)
        elif summary.epoch:
            self._undo.pop(replica_id, None)
            hashes = set(summary.block_hashes)
            self._snapshots[replica_id] = (summary.version, summary.block_hashes)
            self._current[replica_id] = (summary.version, hashes)
        else:
            hashes = summary.block_hashes
            self._snapshots.pop(replica_id, None)
            self._current.pop(replica_id, None)
            self._undo.pop(replica_id, None)
        self._epochs[replica_id] = summary.epoch
        self._versions[replica_id] = summary.version
        return Accepted(hashes, not is_new_epoch, changes)

    def _base_for(self, summary: CacheSummary, is_new_epoch: bool) -> frozenset[int] | set[int] | None:
        """The full set at ``summary.base_version`` in its epoch, if this router holds it."""
        replica_id = summary.replica_id
        if not is_new_epoch:
            for held in (self._current.get(replica_id), self._snapshots.get(replica_id)):
                if held is not None and held[0] == summary.base_version:
                    return held[1]
            undo = self._undo.get(replica_id)
            if undo is not None and undo[0] == summary.base_version:  # the state before the last in-place delta
                version, added, removed = undo
                return frozenset((self._current[replica_id][1] - added) | removed)
        fetched = self._fetched.get(replica_id)
        if fetched is not None and fetched[:2] == (summary.epoch, summary.base_version):
            return fetched[2]
        return None

    def is_restart(self, summary: CacheSummary) -> bool:
        """True if ``summary`` is of another epoch than the one applied last for its replica."""
        return summary.replica_id in self._epochs and summary.epoch != self._epochs[summary.replica_id]

    def missing_base(self, summary: CacheSummary) -> bool:
        """True if ``summary`` is new here and a delta whose base this router
        does not hold (what :meth:`install_base` would let it apply)."""
        is_new_epoch = self.is_restart(summary)
        if not is_new_epoch and summary.version <= self._versions.get(summary.replica_id, -1):
            return False
        return summary.is_delta and self._base_for(summary, is_new_epoch) is None

    def install_base(self, replica_id: str, epoch: str, version: int, hashes: frozenset[int]) -> None:
        """Hold ``hashes`` as the replica's full set at ``version`` of ``epoch``
        (fetched out of band), for the next delta taken against it."""
        self._fetched[replica_id] = (epoch, version, frozenset(hashes))

    def remove(self, replica_id: str) -> None:
        self._versions.pop(replica_id, None)
        self._epochs.pop(replica_id, None)
        self._snapshots.pop(replica_id, None)
        self._current.pop(replica_id, None)
        self._undo.pop(replica_id, None)
        self._fetched.pop(replica_id, None)

    def check_invariants(self) -> None:
        assert set(self._epochs) == set(self._versions), "intake state drifted"
        assert set(self._snapshots) | set(self._undo) <= set(self._current) <= set(self._versions), "held states drifted"
        for replica_id, (version, _) in self._current.items():
            assert version == self._versions[replica_id], replica_id
