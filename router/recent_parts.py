"""Recent work split into parts, kept beside a LoadTracker's own."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence


class RecentParts:
    """``num_parts`` recent-work counters per replica, kept by a
    :class:`router.load.LoadTracker` beside its recent work: booked with
    each request (one in-flight entry carries them), forgotten with it when
    its reservation lapses, rescaled and cleared with the tracker's own.
    The float operations are the tracker's, in the same order, so a part
    reads exactly what a tracker of its own fed the same bookings would.

    For :class:`router.queue_priced.QueuePricedWork` (the prompt tokens a
    replica computes and the output tokens expected there): two trackers of
    its own mirrored every booking, reservation and completion, two more
    tracker updates on each decision.

    Invariants (checked by :meth:`check_invariants`): every part counts the
    same replicas, and ``_totals[k]`` is the sum of ``_recent[k]``.
    """

    def __init__(self, num_parts: int) -> None:
        if num_parts <= 0:
            raise ValueError(f"num_parts must be positive, got {num_parts!r}")
        self._recent: list[dict[str, float]] = [{} for _ in range(num_parts)]
        self._totals = [0.0] * num_parts

    @property
    def num_parts(self) -> int:
        return len(self._totals)

    def total(self, part: int, decay: float) -> float:
        """Part ``part``'s sum over the replicas, times ``decay``."""
        return self._totals[part] * decay

    def view(self, part: int, decay: float) -> Callable[[str], float]:
        """``replica -> part's recent work x decay`` (0 for an unknown one)."""
        recent = self._recent[part]
        return lambda replica_id: recent.get(replica_id, 0.0) * decay

    def track(self, replica_id: str, num_others: int) -> None:
        """Count a new replica, each part at the others' mean (``num_others``
        of them; 0: at 0), as the tracker starts its recent work."""
        for part, recent in enumerate(self._recent):
            value = self._totals[part] / num_others if num_others else 0.0
            recent[replica_id] = value
            self._totals[part] += value

    def remove(self, replica_id: str) -> None:
        for part, recent in enumerate(self._recent):
            self._totals[part] = max(0.0, self._totals[part] - recent.pop(replica_id))

    def add(self, replica_id: str, parts: Sequence[float], scale: float) -> None:
        """Book ``parts`` (one value per part) at ``replica_id``, stored times ``scale``."""
        for part, value in enumerate(parts):
            scaled = value * scale
            self._recent[part][replica_id] += scaled
            self._totals[part] += scaled

    def forget(self, replica_id: str, parts: Sequence[float], scale: float) -> None:
        """Take back a booking of ``parts`` stored times ``scale`` (never below 0)."""
        for part, value in enumerate(parts):
            recent = self._recent[part]
            kept = max(0.0, recent[replica_id] - value * scale)
            self._totals[part] = max(0.0, self._totals[part] - (recent[replica_id] - kept))
            recent[replica_id] = kept

    def rescale(self, scale: float) -> None:
        self._recent = [{r: v * scale for r, v in recent.items()} for recent in self._recent]
        self._totals = [total * scale for total in self._totals]

    def clear(self) -> None:
        """Every replica's parts 0 (the replicas stay counted)."""
        self._recent = [dict.fromkeys(recent, 0.0) for recent in self._recent]
        self._totals = [0.0] * len(self._totals)

    def check_invariants(self, replica_ids: set[str]) -> None:
        for part, recent in enumerate(self._recent):
            assert set(recent) == replica_ids, f"part {part} counts other replicas"
            assert math.isclose(sum(recent.values()), self._totals[part], rel_tol=1e-6, abs_tol=1e-3), part
