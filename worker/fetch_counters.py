"""A replica's fetch counters (issue 13, worker/kv_fetch.py): what its
:class:`~worker.kv_fetch.PrefixFetcher` did as receiver and as owner since
start, and the keys they add to its ``/stats`` (deploy/metrics.py exports
the counters among them)."""

from __future__ import annotations

from dataclasses import dataclass, field

# Why a hinted request recomputed instead: the estimate said recompute is faster (slower),
# the owner no longer held the prefix (evicted), the owner was gone (owner_gone), it did not
# answer within timeout_s (timeout), the call failed (owner_failed), the bundle was refused
# (rejected: wrong tenant or tokens, checksum, weights), there was no room to import it (no_room), or
# the prefix was cached here while the fetch ran (cached_meanwhile: a request computed it locally
# first; the import had nothing to add, and the request reuses that copy).
FALLBACK_REASONS = ("slower", "unmeasured", "evicted", "owner_gone", "timeout", "owner_failed", "rejected", "no_room",
                    "cached_meanwhile")


@dataclass(slots=True)
class FetchCounters:
    """A replica's fetch figures since start (the keys :meth:`to_stats` adds to its stats)."""

    num_fetches: int = 0  # bundles imported
    num_fetched_tokens: int = 0  # positions newly cached from fetched bundles
    num_fetched_bytes: int = 0  # KV bytes of the fetched bundles
    fetch_s: float = 0.0  # wall time of the completed fetches (request to imported)
    fetch_call_s: float = 0.0  # of that: the call to the owner (its export, serialization, object store)
    fetch_import_s: float = 0.0  # of that: the import (check, waiting for the cache lock, the copy)
    num_hints: int = 0  # requests that arrived with a fetch hint
    num_hints_ignored: int = 0  # of those: fetch off, the hint named this replica, or the prefix was held already
    num_joined: int = 0  # hinted requests that waited for a fetch of the same prefix already in flight
    num_outwaited: int = 0  # hinted requests that stopped waiting for their fetch after their recompute time
    num_alternate_asks: int = 0  # alternates asked after the replica before them had evicted the prefix or failed
    num_from_alternate: int = 0  # of the imported bundles: those an alternate served
    num_exports: int = 0  # bundles this replica served to others
    num_exported_bytes: int = 0
    export_wait_s: float = 0.0  # exports waiting for this replica's cache lock
    export_copy_s: float = 0.0  # exports copying rows out of the pool and checksumming them
    num_export_waits: int = 0  # exports that waited for this replica's prefill of the asked prefix
    export_wait_prefill_s: float = 0.0  # seconds they waited
    fallbacks: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FALLBACK_REASONS, 0))

    def to_stats(self) -> dict:
        return {
            "fetch_count": self.num_fetches,
            "fetch_tokens": self.num_fetched_tokens,
            "fetch_bytes": self.num_fetched_bytes,
            "fetch_seconds": round(self.fetch_s, 6),
            "fetch_call_seconds": round(self.fetch_call_s, 6),
            "fetch_import_seconds": round(self.fetch_import_s, 6),
            "fetch_hints": self.num_hints,
            "fetch_hints_ignored": self.num_hints_ignored,
            "fetch_joined": self.num_joined,
            "fetch_outwaited": self.num_outwaited,
            "fetch_alternate_asks": self.num_alternate_asks,
            "fetch_from_alternate": self.num_from_alternate,
            "fetch_exports": self.num_exports,
            "fetch_exported_bytes": self.num_exported_bytes,
            "fetch_export_wait_seconds": round(self.export_wait_s, 6),
            "fetch_export_copy_seconds": round(self.export_copy_s, 6),
            "fetch_export_waits": self.num_export_waits,
            "fetch_export_wait_prefill_seconds": round(self.export_wait_prefill_s, 6),
            **{f"fetch_fallback_{reason}": count for reason, count in self.fallbacks.items()},
        }
