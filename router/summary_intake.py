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

    Invariants: the three maps know the same replicas, except that a
    replica sending plain summaries (no epoch) has no held states.
    """

    def __init__(self) -> None:
        self._versions: dict[str, int] = {}
        self._epochs: dict[str, str] = {}
        self._held: dict[str, tuple[tuple[int, frozenset[int]], tuple[int, frozenset[int]]]] = {}

    @property
    def replica_ids(self) -> set[str]:
        return set(self._versions)

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
            held = self._held.get(replica_id, ())
            base = next((h for v, h in held if v == summary.base_version), None)
            if is_new_epoch or base is None:
                return None
            hashes = (base | hashes) - summary.removed_hashes
            self._held[replica_id] = (held[0], (summary.version, hashes))
        elif summary.epoch:
            self._held[replica_id] = ((summary.version, hashes), (summary.version, hashes))
        else:
            self._held.pop(replica_id, None)
        self._epochs[replica_id] = summary.epoch
        self._versions[replica_id] = summary.version
        return hashes, not is_new_epoch

    def remove(self, replica_id: str) -> None:
        self._versions.pop(replica_id, None)
        self._epochs.pop(replica_id, None)
        self._held.pop(replica_id, None)

    def check_invariants(self) -> None:
        assert set(self._held) <= set(self._epochs) == set(self._versions), "intake state drifted"
