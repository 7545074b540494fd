"""What one Worker returns from ``record_routing_stats``: its cache summary
as a full record each period, or as a stream (issue 14, item 5).

No Ray here: ``put`` (Ray's ``ray.put`` in ``worker/replica.py``) publishes a
stream's base out of band and returns the handle that travels in the deltas.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable

from cache.summary import BASE_REF_KEY, CacheSummary, SummaryStream, pack_block_hashes

SUMMARY_MODES = ("stream", "full")
# Bytes a nested Ray ObjectRef adds to a routing-stats dict on the wire
# (ray 2.60's serializer: a dict holding one ref, less the same dict holding None).
REF_WIRE_BYTES = 254


class SummarySender:
    """Encodes one replica's successive full summaries for Serve's routing-stats channel.

    ``mode="full"``: every summary whole (every cached block each period).
    ``mode="stream"``: ``SummaryStream(cumulative=True, by_reference=True)``:
    an inline snapshot first, then deltas against a base the replica sent
    before, each carrying ``put(pack_block_hashes(base))`` under
    :data:`cache.summary.BASE_REF_KEY` — Serve's channel keeps only each
    replica's latest stats, so one delta must be enough for a router that
    missed the rest; a router that holds the base never fetches it. A base
    is put once, when it becomes the base, and the handle kept until the
    next one (a handle nobody keeps may be freed).

    Counters (:meth:`stats`): messages, their wire bytes (JSON of the dict,
    plus :data:`REF_WIRE_BYTES` per handle), inline snapshots and bases put.
    """

    def __init__(self, replica_id: str, mode: str = "stream", *, put: Callable[[bytes], object],
                 max_periods: int = 8, max_delta_ratio: float = 0.25) -> None:
        if mode not in SUMMARY_MODES:
            raise ValueError(f"summary mode must be one of {SUMMARY_MODES}, got {mode!r}")
        self.mode = mode
        self._put = put
        epoch = f"{replica_id}@{uuid.uuid4().hex[:12]}"
        self._stream = SummaryStream(epoch, max_periods, max_delta_ratio, cumulative=True, by_reference=True)
        self._base_ref: object = None
        self._base_ref_version = 0
        self._counts = {"summary_messages": 0, "summary_bytes": 0, "summary_snapshots": 0, "summary_bases_put": 0}

    def encode(self, full: CacheSummary) -> dict:
        """The routing-stats dict for ``full`` (this replica's next full summary)."""
        if self.mode == "full":
            wire = full.to_dict()
            return self._count(wire, is_snapshot=True)
        sent = self._stream.encode(full)
        wire = sent.to_dict()
        if not sent.is_delta:
            return self._count(wire, is_snapshot=True)
        if self._base_ref_version != self._stream.base_version:
            self._base_ref = self._put(pack_block_hashes(self._stream.base_hashes))
            self._base_ref_version = self._stream.base_version
            self._counts["summary_bases_put"] += 1
        wire = self._count(wire, is_snapshot=False)
        wire[BASE_REF_KEY] = self._base_ref
        self._counts["summary_bytes"] += REF_WIRE_BYTES
        return wire

    def _count(self, wire: dict, *, is_snapshot: bool) -> dict:
        self._counts["summary_messages"] += 1
        self._counts["summary_bytes"] += len(json.dumps(wire, separators=(",", ":")))
        self._counts["summary_snapshots"] += is_snapshot
        return wire

    def stats(self) -> dict:
        return dict(self._counts)
