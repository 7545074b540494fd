"""A router's out-of-band fetch of a replica's summary base (issue 14, item 5).

A replica streaming its summary *by reference* (``cache.summary.SummaryStream``,
``cache.summary_sender``) sends deltas against a base it sent earlier, each
naming the base with an awaitable handle (a Ray ``ObjectRef``; opaque here).
A router that saw the base applies the delta at once. One that did not (it
started later, or Serve's latest-value channel skipped that summary) fetches
the base through the handle, hands it to the policy and re-applies the
replica's latest stats. Until then it routes on its own decisions, as it does
for a replica that has not reported. Pure Python: the caller spawns the task.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from cache.summary import BASE_REF_KEY, unpack_block_hashes
from router.policy import PrefixAffinityPolicy

logger = logging.getLogger(__name__)

BASE_FETCH_TIMEOUT_S = 10.0


class BaseFetcher:
    """Applies routing stats to ``policy``, fetching a delta's base when it must.

    ``spawn`` runs a coroutine in the background (the router's event loop).
    At most one fetch per (replica, epoch, base version) is in flight; a
    failed or timed-out fetch is logged and dropped (a later delta retries).

    Invariant: ``latest`` holds the last stats seen per replica, so a fetched
    base is applied with the newest delta, never an older one.
    """

    def __init__(self, policy: PrefixAffinityPolicy, spawn: Callable[[Awaitable[None]], Any],
                 timeout_s: float = BASE_FETCH_TIMEOUT_S) -> None:
        self._policy = policy
        self._spawn = spawn
        self._timeout_s = timeout_s
        self._in_flight: set[tuple[str, str, int]] = set()
        self.latest: dict[str, object] = {}
        self.num_fetched = 0
        self.num_failed = 0
        self.apply_cpu_s = 0.0  # thread CPU spent applying stats (parse + index), for benchmarks

    def on_routing_stats(self, replica_id: str, stats: object) -> bool:
        """``policy.on_routing_stats``; if it refused a delta for want of its
        base and the stats name one, start fetching it. True if applied now."""
        self.latest[replica_id] = stats
        started = time.thread_time()
        applied = self._policy.on_routing_stats(replica_id, stats)
        self.apply_cpu_s += time.thread_time() - started
        if applied:
            return True
        handle = stats.get(BASE_REF_KEY) if isinstance(stats, Mapping) else None
        if handle is None:
            return False
        wanted = self._policy.missing_base(replica_id, stats)
        if wanted is None:
            return False
        key = (replica_id, *wanted)
        if key not in self._in_flight:
            self._in_flight.add(key)
            self._spawn(self._fetch(key, handle))
        return False

    def forget(self, replica_id: str) -> None:
        self.latest.pop(replica_id, None)

    def retain(self, replica_ids: set[str]) -> None:
        """Forget every replica not in ``replica_ids`` (the live set)."""
        for replica_id in self.latest.keys() - replica_ids:
            del self.latest[replica_id]

    async def _fetch(self, key: tuple[str, str, int], handle: Any) -> None:
        replica_id, epoch, version = key
        try:
            hashes = unpack_block_hashes(await asyncio.wait_for(_awaited(handle), self._timeout_s))
        except Exception as error:  # noqa: BLE001 - the owner died, timed out or sent garbage: wait for the next
            self.num_failed += 1
            logger.warning("could not fetch the summary base of %s (version %d): %r", replica_id, version, error)
            return
        finally:
            self._in_flight.discard(key)
        self.num_fetched += 1
        if self._policy.on_base(replica_id, epoch, version, hashes):
            self.on_routing_stats(replica_id, self.latest.get(replica_id))


async def _awaited(handle: Any) -> Any:
    return await handle
