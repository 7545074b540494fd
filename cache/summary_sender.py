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
    before. With ``max_periods=1`` (the default) every delta is against the
    summary sent just before it, so a router that follows the stream applies
    each at once and never fetches. Every ``ref_every``-th delta also carries
    ``put(pack_block_hashes(base))`` under :data:`cache.summary.BASE_REF_KEY`:
    Serve's channel keeps only each replica's latest stats, so a router that
    missed a summary (it started later, or the channel skipped one) fetches
    the base named by the next delta that carries one, at most ``ref_every``
    periods later, and is whole again. A base is put only for a delta that
    names it (once), and its handle kept until the next one is put (a
    handle nobody keeps may be freed). On the Mooncake replay
    (BENCHMARKS, "Summaries that scale") these defaults send 13.3 × fewer
    bytes than full summaries at 64 replicas and 47 × fewer at 8; a larger
    ``max_periods`` (cumulative deltas, fewer puts) costs bytes.

    Counters (:meth:`stats`): messages, their wire bytes (JSON of the dict,
    plus :data:`REF_WIRE_BYTES` per handle), inline snapshots and bases put.
    """

    def __init__(self, replica_id: str, mode: str = "stream", *, put: Callable[[bytes], object],
                 max_periods: int = 1, max_delta_ratio: float = 0.25, ref_every: int = 4) -> None:
        if mode not in SUMMARY_MODES:
            raise ValueError(f"summary mode must be one of {SUMMARY_MODES}, got {mode!r}")
        if type(ref_every) is not int or ref_every <= 0:
            raise ValueError(f"ref_every must be a positive int, got {ref_every!r}")
        self.mode = mode
        self._put = put
        epoch = f"{replica_id}@{uuid.uuid4().hex[:12]}"
        self._stream = SummaryStream(epoch, max_periods, max_delta_ratio, cumulative=True, by_reference=True)
        self._base_ref: object = None
        self._base_ref_version = 0
        self._ref_every = ref_every
        self._num_deltas = 0
        self._counts = {"summary_messages": 0, "summary_bytes": 0, "summary_snapshots": 0, "summary_bases_put": 0}

    def encode(self, full: CacheSummary) -> dict:
        """The routing-stats dict for ``full`` (this replica's next full summary)."""
        sent = full if self.mode == "full" else self._stream.encode(full)
        wire = sent.to_dict()
        self._counts["summary_messages"] += 1
        self._counts["summary_bytes"] += len(json.dumps(wire, separators=(",", ":")))
        if not sent.is_delta:
            self._counts["summary_snapshots"] += 1
            return wire
        self._num_deltas += 1
        if (self._num_deltas - 1) % self._ref_every == 0:  # the 1st, then every ref_every-th delta
            wire[BASE_REF_KEY] = self._base_ref_for(self._stream.base_version, self._stream.base_hashes)
            self._counts["summary_bytes"] += REF_WIRE_BYTES
        return wire

    def _base_ref_for(self, version: int, hashes: frozenset[int]) -> object:
        """The handle of the base at ``version``, put now unless it was already."""
        if self._base_ref_version != version:
            self._base_ref = self._put(pack_block_hashes(hashes))
            self._base_ref_version = version
            self._counts["summary_bases_put"] += 1
        return self._base_ref

    def stats(self) -> dict:
        return dict(self._counts)
