"""Simulated FIFO replicas: a real radix cache each, one request at a time, a cost model.

Every simulated replica (this one and :class:`router.batching.BatchingReplica`)
offers the same small surface to the simulator:

- ``submit(number, request, now, fetch=None)``: a request arrives, with
  the fetch hint our policy gave it (:mod:`router.sim_fetch`; peers never
  give one);
- ``match_units(units)``, ``export(units, now, busy_s)``: what a receiver
  asks of the owner of a fetched prefix;
- ``fetch_counts``: fetches this replica received, by outcome;
- ``advance(until) -> list[Completion]``: run to ``until``; the requests that
  finished by then, in time order;
- ``summary(version, now, unit_tokens, units_per_block) -> CacheSummary``:
  what a live worker would report — cached block hashes, prompt tokens not
  yet prefilled, tokens of running sequences, counts, the mean output length
  of recently finished requests. Never a request's future or its real
  output length before it finished;
- ``outcomes``: ``number -> Outcome`` (cached tokens, time to first token);
- ``queue_len(now)``, ``active_tokens(now)``, ``match_units(units)``,
  ``radix``, ``busy_s``: what the peers' rules read (observable counts).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass

from cache import RadixCache
from cache.output_quantiles import output_quantiles
from cache.summary import CacheSummary, cached_block_hashes
from router.sim_fetch import FetchCounts, SimFetch, held_elsewhere, plan_fetch, still_computed
from router.workload import SimRequest

OUTPUT_WINDOW = 64  # finished requests a replica's mean output length covers (as the live worker)


@dataclass(frozen=True, slots=True)
class CostModel:
    """Time a FIFO replica spends on a request.

    ``service_s = computed_prompt_tokens / prefill_tokens_per_s
    + num_output_tokens * decode_s_per_token``; one request at a time per
    replica in arrival order (FIFO). ``ttft_s = queue wait + prefill time``.
    Work is measured in prefill-token equivalents too:
    ``decode_token_cost = decode_s_per_token * prefill_tokens_per_s``.
    """

    prefill_tokens_per_s: float = 20_000.0
    decode_s_per_token: float = 0.002

    def __post_init__(self) -> None:
        for name in ("prefill_tokens_per_s", "decode_s_per_token"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive number, got {value!r}")

    @property
    def decode_token_cost(self) -> float:
        return self.decode_s_per_token * self.prefill_tokens_per_s

    @property
    def queue_token_cost(self) -> float:
        """An output token delays the requests behind it as long as it keeps the replica busy."""
        return self.decode_token_cost

    def service_s(self, num_computed_tokens: int, num_output_tokens: int) -> float:
        return num_computed_tokens / self.prefill_tokens_per_s + num_output_tokens * self.decode_s_per_token

    def prefill_s(self, num_computed_tokens: int, num_cached_tokens: int = 0) -> float:
        """Prefill time of ``num_computed_tokens`` on an idle replica."""
        return num_computed_tokens / self.prefill_tokens_per_s


@dataclass(frozen=True, slots=True)
class Outcome:
    """What happened to one request. ``cached_tokens`` counts every prompt
    token not computed, ``fetched_tokens`` (of them) those fetched from
    another replica; ``held_elsewhere_tokens`` those another replica held
    beyond them when the outcome was fixed (:func:`router.sim_fetch.held_elsewhere`:
    report only, no policy reads it)."""

    cached_tokens: int
    ttft_s: float
    fetched_tokens: int = 0
    held_elsewhere_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Completion:
    number: int
    finish_s: float


@dataclass(slots=True)
class _Job:
    number: int
    start_s: float
    prefill_end_s: float
    finish_s: float
    num_prompt_tokens: int
    num_output_tokens: int
    units: tuple[int, ...] = ()  # what it caches (cache_units: its prompt's, then its answer's in a chat)
    num_cached_units: int = 0  # of them in this replica's cache at arrival: the prompt's rest computed by prefill_end_s
    num_prompt_units: int = 0  # the answer's units computed by finish_s
    num_computed_tokens: int = 0  # prompt tokens its prefill computes (not cached, not fetched)


class OutputWindow:
    """Mean output length of the last ``OUTPUT_WINDOW`` finished requests (0.0 when none)."""

    def __init__(self) -> None:
        self._lengths: deque[int] = deque(maxlen=OUTPUT_WINDOW)
        self._sum = 0

    def add(self, num_output_tokens: int) -> None:
        if len(self._lengths) == self._lengths.maxlen:
            self._sum -= self._lengths[0]
        self._lengths.append(num_output_tokens)
        self._sum += num_output_tokens

    @property
    def mean(self) -> float:
        return self._sum / len(self._lengths) if self._lengths else 0.0

    @property
    def quantiles(self) -> tuple[int, ...]:
        """:func:`cache.output_quantiles.output_quantiles` of the window (``()`` when empty)."""
        return output_quantiles(self._lengths)


class SimReplica:
    """One FIFO worker: a simulated-mode :class:`cache.RadixCache` over the
    workload's units under ``budget_units``, one request served at a time.

    A request is matched and inserted when it arrives: in a FIFO queue the
    cache state it meets when it starts is exactly what the requests ahead of
    it leave, so doing it at arrival gives the same hits (and requests that
    share a prefix while queued compute it once, as the engine's in-flight
    sharing does). Its outcome is therefore known at once; :meth:`advance`
    only releases completions, and :meth:`summary` reads the state a worker
    would see at ``now`` (who waits, who runs, how far it decoded).

    Fetch: a hinted request is planned at arrival against the owner's cache
    then (:func:`router.sim_fetch.plan_fetch`; a prefix the owner's prefill
    in flight computes comes once computed, :meth:`prefill_done_s`); a fetch replaces the
    prefill of the tokens it brings by the transfer, which the replica
    waits for when the request starts (a stall, counted busy; a wait for
    the owner's prefill runs from arrival, so only what is left of it at
    the start stalls). An export
    occupies this replica from ``now`` for its copy time: it delays the
    requests that arrive after it (those already queued keep the times
    the FIFO model gave them at arrival).
    """

    def __init__(self, replica_id: str, budget_units: int, cost: CostModel, protected_share: float = 0.0) -> None:
        self.replica_id = replica_id
        self.radix = RadixCache(budget_units, block_size=1, protected_share=protected_share)
        self.cost = cost
        self.free_at_s = 0.0
        self.busy_s = 0.0
        self.busy_reported = 0.0  # the busy counter last reported (observed_summary): it never goes back
        self.outcomes: dict[int, Outcome] = {}
        self._jobs: deque[_Job] = deque()  # not yet finished, in start order
        self._completions: list[tuple[float, int, int]] = []  # heap of (finish_s, number, output tokens)
        self._outputs = OutputWindow()
        self._time_s = 0.0
        self._prefill_total = self._output_total = 0  # counted when done (prefill at submit: FIFO order)
        self.fetch_counts = FetchCounts()
        self.peers: tuple[SimReplica, ...] = ()  # the other replicas, for the report's held-elsewhere figure
        self.reported_token_costs: tuple[float, float] | None = None
        self.reported_fetch_costs: tuple[float, float] = (0.0, 0.0)  # what a fetch costs here (FetchModel)

    def match_units(self, units: tuple[int, ...]) -> int:
        return self.radix.match(units, touch=False).num_tokens

    def queued_units(self, units: tuple[int, ...]) -> int:
        """:meth:`router.sim_fetch.Owner.queued_units`: 0 (a request enters the tree on arrival)."""
        return 0

    def computed_units(self, units: tuple[int, ...], now: float) -> int:
        """:meth:`match_units` less what a request not finished at ``now``
        has yet to compute (inserted at arrival: its prompt computed by its
        ``prefill_end_s``, its answer by its ``finish_s``): what an export
        reads."""
        held = self.match_units(units)
        for job in self._jobs:
            done = job.num_cached_units if job.prefill_end_s > now else job.num_prompt_units
            if job.finish_s > now and held > done and still_computed(units, job.units, done):
                held = done
        return held

    def prefill_done_s(self, units: tuple[int, ...], num_units: int, now: float) -> float:
        """:meth:`router.sim_fetch.Owner.prefill_done_s`: the latest
        ``prefill_end_s`` of the unfinished requests still computing one of
        the first ``num_units`` (``inf`` where one is an answer still to
        decode)."""
        done_s = now
        for job in self._jobs:
            computed = job.num_cached_units if job.prefill_end_s > now else job.num_prompt_units
            if job.finish_s > now and computed < num_units and still_computed(units, job.units, computed):
                if job.prefill_end_s <= now or job.num_prompt_units < num_units:
                    return math.inf
                done_s = max(done_s, job.prefill_end_s)
        return done_s

    @property
    def token_costs(self) -> tuple[float, float]:
        """What a live worker measures of its own steps: (busy, queue) prefill-token price of an output
        token — its timing's, or ``reported_token_costs`` where given (a live run's Workers' reports)."""
        if self.reported_token_costs is not None:
            return self.reported_token_costs
        return self.cost.decode_token_cost, self.cost.queue_token_cost

    def busy_until(self, now: float) -> float:
        """Seconds this replica was busy up to ``now`` (what it has booked
        past ``now`` is one contiguous run of service, not yet done)."""
        return self.busy_s - max(0.0, self.free_at_s - now)

    def export(self, units: tuple[int, ...], now: float, busy_s: float) -> None:
        # the worker's export reads the tree without an LRU touch (KVCache.pinned_prefix): nothing to do here
        self.free_at_s = max(self.free_at_s, now) + busy_s
        self.busy_s += busy_s
        self.fetch_counts.export_busy_s += busy_s

    def submit(self, number: int, request: SimRequest, now: float, fetch: SimFetch | None = None) -> Outcome:
        num_units = self.radix.match(request.units, touch=True).num_tokens
        cached = request.cached_tokens(num_units)
        fetched, transfer_s = 0, 0.0
        if fetch is not None:
            plan = plan_fetch(fetch, request.units, request.unit_tokens, num_units, request.cached_tokens,
                              self.cost, now)
            self.fetch_counts.count(plan)
            transfer_s = plan.transfer_s  # a fetch, or the round trips that found the prefix evicted
            if plan.num_units:
                cached, fetched = request.cached_tokens(plan.num_units), plan.num_tokens
        elsewhere = held_elsewhere(self.peers, request.units, request.cached_tokens, cached, now)
        start = max(now, self.free_at_s)
        if fetch is not None and plan.wait_s:  # the wait for the owner's prefill runs from arrival, queued or not
            transfer_s += max(now + plan.wait_s - start, 0.0) - plan.wait_s
        prefill_s = transfer_s + (request.num_prompt_tokens - cached) / self.cost.prefill_tokens_per_s
        service_s = prefill_s + request.num_output_tokens * self.cost.decode_s_per_token
        self.free_at_s = start + service_s
        self.busy_s += service_s
        self._jobs.append(_Job(number, start, start + prefill_s, self.free_at_s, request.num_prompt_tokens,
                               request.num_output_tokens, request.cache_units, num_units, len(request.units),
                               request.num_prompt_tokens - cached))
        heapq.heappush(self._completions, (self.free_at_s, number, request.num_output_tokens))
        self.radix.insert(request.cache_units)
        self._prefill_total += request.num_prompt_tokens - cached
        outcome = Outcome(cached, start - now + prefill_s, fetched, elsewhere)
        self.outcomes[number] = outcome
        return outcome

    def advance(self, until: float) -> list[Completion]:
        done = []
        while self._completions and self._completions[0][0] <= until:
            finish_s, number, num_output = heapq.heappop(self._completions)
            self._outputs.add(num_output)
            self._output_total += num_output
            done.append(Completion(number, finish_s))
        while self._jobs and self._jobs[0].finish_s <= until:
            self._jobs.popleft()
        self._time_s = max(self._time_s, until)
        return done

    def _state(self, now: float) -> tuple[int, int, int, int]:
        """``(waiting, running, queued prompt tokens, running tokens)`` at ``now``."""
        num_waiting = num_running = queued = running = 0
        for job in self._jobs:
            if job.finish_s <= now:
                continue
            if now < job.start_s:
                num_waiting += 1
                queued += job.num_prompt_tokens
            else:
                num_running += 1
                decoded = 0 if now < job.prefill_end_s else min(
                    job.num_output_tokens, 1 + int((now - job.prefill_end_s) / self.cost.decode_s_per_token))
                running += job.num_prompt_tokens + decoded
        return num_waiting, num_running, queued, running

    def queue_len(self, now: float) -> int:
        num_waiting, num_running, _, _ = self._state(now)
        return num_waiting + num_running

    def active_tokens(self, now: float) -> int:
        """Tokens of the requests queued (prompt) or running (prompt + output so far) here."""
        _, _, queued, running = self._state(now)
        return queued + running

    def summary(self, version: int, now: float, unit_tokens: int, units_per_block: int) -> CacheSummary:
        num_waiting, num_running, queued, running = self._state(now)
        return observed_summary(self, version, now, unit_tokens, units_per_block, num_waiting=num_waiting,
                                num_running=num_running, queued=queued, running=running,
                                prefilling=self._prefill_left(now))

    def _prefill_left(self, now: float) -> int:
        """Prompt tokens the request in prefill at ``now`` has still to
        compute (a live worker's ``num_prefilling_tokens``): its computed
        tokens less what its prefill has run since its fetch (if any) ended."""
        for job in self._jobs:
            if job.start_s <= now < job.prefill_end_s:
                left = (job.prefill_end_s - now) * self.cost.prefill_tokens_per_s
                return min(job.num_computed_tokens, math.ceil(left))
        return 0


def observed_summary(replica, version: int, now: float, unit_tokens: int, units_per_block: int, *,
                     num_waiting: int, num_running: int, queued: int, running: int,
                     prefilling: int = 0) -> CacheSummary:
    """The summary a simulated replica (either model) reports: only what a live
    worker fills (its cache, queued/running/prefilling tokens and counts, mean output and its quantiles,
    token counters, the token prices its steps cost, what a fetch costs it), in tokens of
    ``unit_tokens`` per simulated unit."""
    decode_token_cost, queue_token_cost = replica.token_costs
    return CacheSummary(
        replica_id=replica.replica_id,
        version=version,
        timestamp_s=now,
        block_size=unit_tokens * units_per_block,
        block_hashes=frozenset(cached_block_hashes(replica.radix, units_per_block)),
        num_cached_tokens=replica.radix.num_tokens * unit_tokens,
        budget_tokens=replica.radix.budget_tokens * unit_tokens,
        num_queued_tokens=queued,
        num_running_tokens=running,
        num_running=num_running,
        num_waiting=num_waiting,
        mean_output_tokens=replica._outputs.mean,  # noqa: SLF001 - both replica models keep one
        output_quantiles=replica._outputs.quantiles,  # noqa: SLF001
        num_prefill_tokens_total=replica._prefill_total,  # noqa: SLF001
        num_output_tokens_total=replica._output_total,  # noqa: SLF001
        decode_token_cost=decode_token_cost,
        queue_token_cost=queue_token_cost,
        fetch_token_cost=replica.reported_fetch_costs[0],
        fetch_overhead_tokens=replica.reported_fetch_costs[1],
        busy_s_total=_busy_counter(replica, now),
        num_prefilling_tokens=prefilling,
    )


def _busy_counter(replica, now: float) -> float:
    """The replica's busy-time counter as its summary reports it: busy up to
    ``now``, never below what it reported before. A live counter only grows;
    ``busy_until`` is a difference of floats that can read an ulp lower a
    period later."""
    replica.busy_reported = max(replica.busy_reported, replica.busy_until(now))
    return replica.busy_reported
