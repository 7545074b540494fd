"""Fetching a cached prefix from the replica that holds it instead of
recomputing it (issue 13): the decision, the fetch, the owner's export and
their counters. No Ray here: the transport is injected (the Ray one,
``worker/kv_transport.py``, calls the owner through the Worker deployment's
handle, pinned to it by ``router/serve.py``; the bundle travels through
Ray's object store as the call's return value). The measured rates the
decision weighs are ``worker/fetch_estimates.py``'s.

Per hinted request, :meth:`PrefixFetcher.prepare` runs before the request is
queued:

1. Ignore the hint when fetch is off, the hint names this replica (Ray fell
   back to the owner itself) or this replica already holds the prefix.
2. Estimate ``transfer_s = overhead_s + num_tokens * bytes_per_token /
   bandwidth`` (:class:`TransferModel`) and ``recompute_s = missing_tokens *
   prefill_s_per_token``; fetch only if ``recompute_s > min_speedup *
   transfer_s`` (``slower`` otherwise; the default ``min_speedup`` 1:
   whenever the transfer is faster). ``bandwidth``: a start-up object-store
   round trip (``probe_bytes``), until fetches of varied sizes fit a line;
   ``overhead_s``: what completed fetches took beyond that (the call to the
   owner, its copy and checksum, the import); ``prior_overhead_s`` before
   the first. ``prefill_s_per_token``: what
   one more token adds to the engine's prefill steps (:class:`PrefillRate`,
   ``AsyncEngine.prefill_s_per_token``), since the missing prefix rides in a
   step its request runs anyway; before the first one the replica recomputes (``unmeasured``; with
   ``min_speedup`` 0 it fetches): a fresh replica's first hints had fetched
   64 tokens in 0.09-0.15 s that recompute in ~10 ms on this VM, and were
   the live multi-turn TTFT p99. Recomputing is never wrong, and the first
   prefill step measures the rate.
3. Ask the owner for the longest prefix it holds of the prompt (all but
   its last token, which the request computes anyway) under the request's
   own salt (a tenant's export never reads another namespace), and wait at
   most ``timeout_s``. That may be more than the hint's ``num_tokens``, the
   depth the router knew of: a replica that generated a chat's last answer
   holds it, though no router learned those tokens (simulated multi-turn,
   seeds 0-7: 16 of 711 fetches had recomputed such tokens when asked for
   the hinted depth only). Step 2 and the patience weigh the hinted
   tokens. The ask carries ``wait_s``, what is left of the request's
   patience (of ``timeout_s`` without one) less the transfer's estimate:
   while a sequence at the owner is still computing more of the prefix
   than it caches (a group's first request in its prefill there), the owner
   polls every ``EXPORT_POLL_S`` until that is cached, nobody computes it
   any more or ``wait_s`` has passed, then exports what it holds
   (``fetch_export_waits``, ``fetch_export_wait_prefill_seconds``); so the
   group's second request gets the whole prefix instead of recomputing
   what was not cached yet. When the owner answers that it no longer holds them
   (``evicted``), is gone or its call fails, ask the hint's
   ``alternates`` in turn (other replicas the router believes hold them: its
   index lags evictions by up to a summary period), each within ``timeout_s``
   and all within the request's patience. Every failure falls back to
   recomputing, counted once by the last replica's reason
   (:data:`FALLBACK_REASONS`); ``prepare`` raises nothing but
   ``CancelledError``.
4. Import the bundle (checked, checksum and weights fingerprint included,
   outside any lock; written under the engine's cache lock in one bounded
   copy, which a running forward does not hold: ``AsyncEngine``). The
   request then finds the prefix in the local cache like any hit. The
   owner's export likewise copies under the cache lock only, so neither side
   waits for the other's step in flight to end (on a busy ~125M replica a
   1,024-token step takes seconds).

Requests hinted to the same prefix (salt and tokens) while its fetch is in
flight join it instead of fetching it again (a hot prefix spilling a burst
to one replica moves once); each joiner counts in ``fetch_joined``.

Patience: a request waits for its fetch at most ``patience`` (1) × its own
estimated recompute time (:meth:`PrefixFetcher._patience_s`), then recomputes
(``fetch_outwaited``). The fetch itself runs on (bounded by ``timeout_s``):
its time is measured, so the next decision knows the overhead, and its
bundle lands for the requests after it (``cached_meanwhile`` if this one's
recompute finished first).

Cancellation: cancelling ``prepare`` cancels the call to the owner once no
request waits for it any more; an import already handed to its thread
completes (it is atomic under the engine lock and leaves a consistent
cache), so nothing leaks either way.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from cache.summary import rounded_rate
from worker.config import FetchConfig
from worker.fetch_counters import FALLBACK_REASONS, FetchCounters  # noqa: F401 - re-exported
from worker.fetch_estimates import EWMA_WEIGHT, Ewma, PrefillRate, TransferModel, fit_line  # noqa: F401 - re-exported
from worker.kv_bundle import KVBundle
from worker.messages import ExportReply, ExportRequest

if TYPE_CHECKING:
    from worker.async_engine import AsyncEngine

logger = logging.getLogger("kvroute.worker")

EXPORT_POLL_S = 0.005  # how often an owner's export that may wait looks whether its prefill got there


class PeerTransport(Protocol):
    """How a replica reaches another's :meth:`PrefixFetcher.export`."""

    async def fetch(self, request: ExportRequest) -> ExportReply:
        """The reply of ``request.target_replica`` (or of whichever replica took it
        when the target is gone); cancelling the call cancels it on the owner."""
        ...


@dataclass(slots=True, eq=False)
class _SharedFetch:
    """One fetch in flight and how many hinted requests wait for it."""

    task: asyncio.Future
    num_waiters: int = 0
    outwaited: bool = False  # a waiter stopped waiting: it runs on (timeout_s), is measured, and lands for later requests


class PrefixFetcher:
    """One replica's side of fetching: :meth:`prepare` (receiver), :meth:`export` (owner).

    Invariant: every hinted request counts in ``num_hints``; one whose hint
    was ignored (step 1) in ``num_hints_ignored``; every other was judged
    not worth fetching (``fallbacks["slower"]``, or ``["unmeasured"]`` before
    the engine timed a prefill step), joined a fetch in
    flight (``num_joined``) or ran one, which ended in an import
    (``num_fetches``) or in exactly one other fallback. A request that waited
    for a fetch and stopped (its patience) counts in ``num_outwaited`` too;
    the fetch's own end is counted as above when it comes.
    ``_in_flight`` holds exactly the fetches not yet finished, by (salt, hinted prefix).
    """

    def __init__(self, engine: AsyncEngine, replica_id: str, config: FetchConfig, transport: PeerTransport, *,
                 bandwidth_bytes_per_s: float | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self._engine = engine
        self._replica_id = replica_id
        self._config = config
        self._transport = transport
        self._clock = clock
        self.transfer = TransferModel(bandwidth_bytes_per_s, config.prior_overhead_s)
        self.counters = FetchCounters()
        self._in_flight: dict[tuple, _SharedFetch] = {}

    def stats(self) -> dict:
        """The counters, with the estimates behind the decisions."""
        overhead_s, bandwidth = self.transfer.terms() or (None, None)
        return {**self.counters.to_stats(), "fetch_enabled": self._config.enabled,
                "fetch_bandwidth_bytes_per_s": bandwidth, "fetch_overhead_s": overhead_s,
                "prefill_s_per_token": self._engine.prefill_s_per_token, **self.fetch_prices()}

    def fetch_prices(self) -> dict[str, float]:
        """What a fetch costs this replica in prefill-token equivalents, for
        its cache summary (``CacheSummary.fetch_token_cost`` /
        ``fetch_overhead_tokens``): moving ``n`` tokens takes as long as
        prefilling ``n * fetch_token_cost + fetch_overhead_tokens`` of them,
        times ``min_speedup`` (the worker fetches only past that). Both 0.0
        while the bandwidth or the prefill rate is unmeasured, with fetch off,
        or with ``min_speedup`` 0 (every hint fetched): the router's prior."""
        s_per_token, terms = self._engine.prefill_s_per_token, self.transfer.terms()
        if not self._config.enabled or not self._config.min_speedup or not s_per_token or terms is None:
            return {"fetch_token_cost": 0.0, "fetch_overhead_tokens": 0.0}
        overhead_s, bandwidth = terms
        if not bandwidth > 0:
            return {"fetch_token_cost": 0.0, "fetch_overhead_tokens": 0.0}
        scale = self._config.min_speedup / s_per_token
        return {"fetch_token_cost": rounded_rate(self._engine.engine.bytes_per_token / bandwidth * scale),
                "fetch_overhead_tokens": rounded_rate(overhead_s * scale)}

    # ----------------------------------------------------------------- receiver
    def should_fetch(self, num_tokens: int, num_missing: int) -> bool:
        """Step 2: is moving ``num_tokens`` positions ``min_speedup`` times faster than computing ``num_missing``?"""
        return self._why_not_fetch(num_tokens, num_missing) is None

    def _why_not_fetch(self, num_tokens: int, num_missing: int) -> str | None:
        """None to fetch, else the fallback reason (``unmeasured``, ``slower``)."""
        if self._config.min_speedup == 0:
            return None  # every hinted fetch, whatever the estimates
        s_per_token = self._engine.prefill_s_per_token
        if s_per_token is None:
            return "unmeasured"  # no prefill step timed yet: recomputing is never wrong
        transfer_s = self.transfer.estimate_s(num_tokens * self._engine.engine.bytes_per_token)
        if transfer_s is None:
            return None  # no bandwidth probe, no fetch yet, no prior: only a fetch can measure it
        return None if num_missing * s_per_token > self._config.min_speedup * transfer_s else "slower"

    async def prepare(self, token_ids: Sequence[int], salt: str | None, hint) -> int:
        """Fetch what ``hint`` (a ``router.fetch.FetchHint`` or None) names of
        ``token_ids`` into the local cache when that pays; the positions newly
        cached (0: recompute). Raises nothing but ``CancelledError``."""
        if hint is None:
            return 0
        self.counters.num_hints += 1
        num_tokens = min(int(hint.num_tokens), len(token_ids))
        owners = tuple(o for o in (hint.owner, *getattr(hint, "alternates", ())) if o != self._replica_id)
        if not self._config.enabled or hint.owner == self._replica_id or num_tokens <= 0:
            self.counters.num_hints_ignored += 1
            return 0
        prefix = tuple(token_ids[:num_tokens])
        num_cached = await asyncio.to_thread(self._engine.cached_prefix_tokens, prefix, salt)
        if num_cached >= num_tokens:
            self.counters.num_hints_ignored += 1
            return 0
        key = (salt, prefix)
        shared = self._in_flight.get(key)
        patience_s = self._patience_s(num_tokens - num_cached, getattr(hint, "owner_computing", False) is True)
        if shared is None:
            reason = self._why_not_fetch(num_tokens, num_tokens - num_cached)
            if reason is not None:
                return self._fall_back(reason)
            asked = tuple(token_ids[:len(token_ids) - 1]) if len(token_ids) - 1 > num_tokens else prefix
            deadline_s = None if patience_s is None else self._clock() + patience_s
            shared = self._in_flight[key] = _SharedFetch(asyncio.ensure_future(
                self._fetch(owners, asked, salt, deadline_s)))
            shared.task.add_done_callback(lambda _: self._forget(key, shared))
        else:
            self.counters.num_joined += 1
        shared.num_waiters += 1
        try:
            if patience_s is None:
                return await asyncio.shield(shared.task)
            return await asyncio.wait_for(asyncio.shield(shared.task), patience_s)
        except asyncio.TimeoutError:  # the fetch took as long as recomputing would have: recompute now
            shared.outwaited = True
            self.counters.num_outwaited += 1
            return 0
        finally:
            shared.num_waiters -= 1
            if shared.num_waiters == 0 and not shared.task.done() and not shared.outwaited:  # all were cancelled
                self._forget(key, shared)  # nobody joins a cancelled fetch
                shared.task.cancel()

    def _patience_s(self, num_missing: int, owner_computing: bool = False) -> float | None:
        """How long a request waits for its fetch: ``patience`` (``prefill_patience``
        where the hint says the owner still computes the prefix, if larger) × the
        estimated time to recompute what it misses (None, only ``timeout_s``,
        with ``min_speedup`` or ``patience`` 0 or no measured prefill rate). By then the fetch has
        cost as much as recomputing would have in all, so a request pays at
        most twice its recompute time for an estimate that was wrong (the
        prior overhead on a busy host: live, a fresh replica's first fetch
        of 512 tokens took 0.3 s, ~3x their recompute time)."""
        s_per_token, config = self._engine.prefill_s_per_token, self._config
        if config.min_speedup == 0 or config.patience == 0 or s_per_token is None:
            return None
        factor = max(config.patience, config.prefill_patience) if owner_computing else config.patience
        return factor * num_missing * s_per_token

    def _owner_wait_s(self, num_tokens: int, deadline_s: float | None) -> float:
        """``ExportRequest.wait_s`` for an ask of ``num_tokens`` positions: what is
        left of the call's ``timeout_s`` and of the request's patience (until
        ``deadline_s``; None: no patience), less the transfer's estimate (the
        prior overhead before one), so a bundle the owner waited for still
        arrives before the request stops waiting for it. Never negative."""
        budget_s = self._config.timeout_s
        if deadline_s is not None:
            budget_s = min(budget_s, deadline_s - self._clock())
        transfer_s = self.transfer.estimate_s(num_tokens * self._engine.engine.bytes_per_token)
        return max(0.0, budget_s - (self._config.prior_overhead_s if transfer_s is None else transfer_s))

    def _forget(self, key: tuple, shared: _SharedFetch) -> None:
        if self._in_flight.get(key) is shared:
            del self._in_flight[key]

    async def _fetch(self, owners: tuple[str, ...], prefix: tuple[int, ...], salt: str | None,
                     deadline_s: float | None) -> int:
        """Ask ``owners`` in turn (step 3) until one sends a bundle, then import it;
        ``deadline_s``: when the request that started it stops waiting (None: never)."""
        failure: tuple = ()
        for number, owner in enumerate(owners):
            if number:
                self.counters.num_alternate_asks += 1
            start = self._clock()
            reply, failure = await self._ask(owner, prefix, salt, deadline_s)
            if reply is not None:
                imported = await self._import(reply.bundle, prefix, salt, start, self._clock())
                self.counters.num_from_alternate += bool(number and imported)
                return imported
            if failure[0] == "timeout":
                break  # a slow owner took the time a second ask would need
        return self._fall_back(*failure)

    async def _ask(self, owner: str, prefix: tuple[int, ...], salt: str | None,
                   deadline_s: float | None) -> tuple[ExportReply | None, tuple]:
        """``(reply with a bundle, ())`` or ``(None, (reason, owner[, error]))``."""
        request = ExportRequest(owner, prefix, salt, len(prefix), self._owner_wait_s(len(prefix), deadline_s))
        try:
            reply = await asyncio.wait_for(self._transport.fetch(request), self._config.timeout_s)
        except asyncio.TimeoutError:  # TimeoutError from 3.11; pyproject allows 3.10
            return None, ("timeout", owner)
        except Exception as error:  # noqa: BLE001 - a failed owner means recompute, never a failed request
            return None, ("owner_failed", owner, error)
        if not isinstance(reply, ExportReply) or reply.replica_id != owner:
            return None, ("owner_gone", owner)
        if reply.bundle is None:
            return None, ("evicted", owner)
        return reply, ()

    async def _import(self, bundle: KVBundle, prefix: tuple[int, ...], salt: str | None, start: float,
                      replied: float) -> int:
        if not isinstance(bundle, KVBundle) or bundle.salt != salt or bundle.token_ids != prefix[: bundle.num_tokens]:
            return self._fall_back("rejected", None, "the bundle is for other tokens or another tenant")
        try:
            num_new = await asyncio.to_thread(self._engine.import_prefix, bundle)
        except ValueError as error:  # checksum, model, weights fingerprint, geometry
            return self._fall_back("rejected", None, error)
        except Exception as error:  # noqa: BLE001 - a failed import released what it reserved; recompute
            logger.exception("%s: importing a fetched bundle failed", self._replica_id)
            return self._fall_back("rejected", None, error)
        if num_new == 0:  # import_checked keeps nothing when the pool is full or the prefix is held already
            held = await asyncio.to_thread(self._engine.cached_prefix_tokens, bundle.token_ids, salt)
            return self._fall_back("cached_meanwhile" if held >= bundle.num_tokens else "no_room")
        elapsed_s = max(self._clock() - start, 1e-9)
        counters = self.counters
        counters.num_fetches += 1
        counters.num_fetched_tokens += num_new
        counters.num_fetched_bytes += bundle.num_bytes
        counters.fetch_s += elapsed_s
        counters.fetch_call_s += replied - start
        counters.fetch_import_s += self._clock() - replied
        self.transfer.observe(bundle.num_bytes, elapsed_s)
        return num_new

    def _fall_back(self, reason: str, owner: str | None = None, error: object = None) -> int:
        self.counters.fallbacks[reason] += 1
        if error is not None or reason in ("timeout", "owner_gone"):
            logger.info("%s: fetch from %s fell back to recompute (%s): %s", self._replica_id, owner, reason, error)
        return 0

    # -------------------------------------------------------------------- owner
    async def export(self, request: ExportRequest) -> ExportReply:
        """The KV of the longest cached prefix of ``request.token_ids`` (at most
        ``max_tokens``) under the request's salt, once what this engine still
        computes of it is cached or ``wait_s`` has passed (:meth:`_wait_for_prefill`);
        no bundle when this replica is not the target, fetch is off or nothing
        of it is cached. ValueError for a malformed request."""
        if not isinstance(request, ExportRequest):
            raise ValueError(f"expected an ExportRequest, got {type(request).__name__}")
        _check_wait_s(request.wait_s)
        if request.target_replica != self._replica_id or not self._config.enabled:
            return ExportReply(self._replica_id, None)
        if request.wait_s > 0:
            await self._wait_for_prefill(request)
        timing: dict = {}
        bundle = await asyncio.to_thread(self._engine.export_prefix, request.token_ids, request.salt,
                                         max_tokens=request.max_tokens, timing=timing)
        if bundle is not None:
            self.counters.num_exports += 1
            self.counters.num_exported_bytes += bundle.num_bytes
        self.counters.export_wait_s += timing.get("wait_s", 0.0)
        self.counters.export_copy_s += timing.get("copy_s", 0.0) + timing.get("bundle_s", 0.0)
        return ExportReply(self._replica_id, bundle)

    async def _wait_for_prefill(self, request: ExportRequest) -> None:
        """Step 3's wait, at the owner: while a sequence here is still computing
        more of the asked prefix than the cache holds
        (``AsyncEngine.in_flight_prefix_tokens``), look again every
        ``EXPORT_POLL_S`` until it is cached, nobody computes it any more
        (finished or aborted; a preempted sequence waits to compute it again)
        or ``request.wait_s`` has passed. Each look is a pure read on a worker thread, so the event loop
        never blocks and a cancelled wait leaves nothing pinned. Counted when
        it waited at all: ``num_export_waits``, ``export_wait_prefill_s``."""
        def num_in_flight() -> Awaitable[int]:
            return asyncio.to_thread(self._engine.in_flight_prefix_tokens, request.token_ids, request.salt,
                                     max_tokens=request.max_tokens)

        if not await num_in_flight():
            return
        start = self._clock()
        deadline_s = start + request.wait_s
        self.counters.num_export_waits += 1
        try:
            while (left_s := deadline_s - self._clock()) > 0:
                await asyncio.sleep(min(EXPORT_POLL_S, left_s))
                if not await num_in_flight():
                    return
        finally:
            self.counters.export_wait_prefill_s += self._clock() - start


def _check_wait_s(wait_s: object) -> None:
    """ValueError unless ``wait_s`` (``ExportRequest.wait_s``) is a finite number of seconds >= 0."""
    if isinstance(wait_s, bool) or not isinstance(wait_s, (int, float)) or not 0 <= wait_s < math.inf:  # NaN fails
        raise ValueError(f"wait_s must be a finite number of seconds >= 0, got {wait_s!r}")
