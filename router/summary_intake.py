"""Which replica summaries a router applies, and what full block set each means."""

from __future__ import annotations

from cache.summary import CacheSummary


class SummaryIntake:
    """Per replica: the newest version applied, its epoch, and the states a
    delta may be taken against (the last snapshot and the last state applied).

    :meth:`accept` returns the full block set a summary stands for, and
    whether the router may keep the entries it learned recently, or None to
    skip the summary: an older or equal version in the same epoch, or a delta
    against a state this router does not hold (it missed a summary; it waits
    for the next snapshot). A new epoch (the replica restarted) is accepted
    whatever its version, and then nothing learned before it survives.

    A base fetched out of band (:meth:`install_base`: a stream sent *by
    reference*, ``cache.summary.SummaryStream``) is one more state a delta
    may be taken against, in the epoch it was fetched for; :meth:`missing_base`
    tells the caller that a refused summary waits for one.

    Invariants: the three maps know the same replicas, except that a
    replica sending plain summaries (no epoch) has no held states; a fetched
    base is dropped with its replica (:meth:`remove`) and once a delta used it.
    """

    def __init__(self) -> None:
        self._versions: dict[str, int] = {}
        self._epochs: dict[str, str] = {}
        self._held: dict[str, tuple[tuple[int, frozenset[int]], tuple[int, frozenset[int]]]] = {}
        self._fetched: dict[str, tuple[str, int, frozenset[int]]] = {}  # replica -> (epoch, version, hashes)

    @property
    def replica_ids(self) -> set[str]:
        """Replicas this intake holds anything for (a version, or a fetched base)."""
        return set(self._versions) | set(self._fetched)

    def has_seen(self, replica_id: str, version: object, epoch: object) -> bool:
        """True if a summary with this version and epoch would be skipped (cheap, before parsing)."""
        return (type(version) is int and version <= self._versions.get(replica_id, -1)
                and (epoch or "") == self._epochs.get(replica_id))

    def accept(self, summary: CacheSummary) -> tuple[frozenset[int], bool] | None:
        replica_id = summary.replica_id
        is_new_epoch = replica_id in self._epochs and summary.epoch != self._epochs[replica_id]
        if not is_new_epoch and summary.version <= self._versions.get(replica_id, -1):
            return None
        hashes = summary.block_hashes
        if summary.is_delta:
            base = self._base_for(summary, is_new_epoch)
            if base is None:
                return None
            hashes = (base | hashes) - summary.removed_hashes
            self._held[replica_id] = ((summary.base_version, base), (summary.version, hashes))
            self._fetched.pop(replica_id, None)
        elif summary.epoch:
            self._held[replica_id] = ((summary.version, hashes), (summary.version, hashes))
        else:
            self._held.pop(replica_id, None)
        self._epochs[replica_id] = summary.epoch
        self._versions[replica_id] = summary.version
        return hashes, not is_new_epoch

    def _base_for(self, summary: CacheSummary, is_new_epoch: bool) -> frozenset[int] | None:
        """The full set at ``summary.base_version`` in its epoch, if this router holds it."""
        if not is_new_epoch:
            for version, hashes in self._held.get(summary.replica_id, ()):
                if version == summary.base_version:
                    return hashes
        fetched = self._fetched.get(summary.replica_id)
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
        self._held.pop(replica_id, None)
        self._fetched.pop(replica_id, None)

    def check_invariants(self) -> None:
        assert set(self._held) <= set(self._epochs) == set(self._versions), "intake state drifted"
