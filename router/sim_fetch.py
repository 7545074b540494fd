"""The simulator's KV fetch (issue 13, item 3): what moving a cached prefix
from its owner to the receiving replica costs, whether the receiver takes
it, and what it leaves on both sides.

Both replica models (:class:`router.cluster.SimReplica`,
:class:`router.batching.BatchingReplica`) call :func:`plan_fetch` where the
request starts (FIFO: when it arrives, the moment the FIFO model fixes its
outcome; batching: when it is admitted), with the :class:`SimFetch` our
policy's decision carried. The receiver decides as the live worker does
(``worker``'s fetcher): it reads the owner's cache *then* (an owner that has
evicted the prefix gives what it still holds, possibly nothing), and fetches
only if the estimated transfer of the tokens it lacks beats recomputing
them with its own timing (``prefill_s``), else recomputes. Fetched tokens
count as saved prefill (a hit) and are reported separately.

An owner still prefilling the prefix (a group's second request arriving
while the first computes it there) exports it once computed, as the live
owner waits for an in-flight prefill up to the receiver's patience
(``ExportRequest.wait_s``): the receiver waits that long, and where the
wait and the transfer outlast its patience (:meth:`FetchModel.patience_s`)
it has lost the patience and recomputes (``"outwaited"``). The FIFO model
knows when each prefill ends (:meth:`Owner.prefill_done_s`); the batching
model defers a hinted sequence while its owner computes the prefix
(:meth:`router.batching.BatchingReplica`), so its owner answers computed
tokens only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from cache.summary import rounded_rate

# Llama-3.1-8B in bf16: 32 layers x 8 KV heads x 128 dims x (K, V) x 2 bytes.
LLAMA_8B_KV_BYTES_PER_TOKEN = 32 * 8 * 128 * 2 * 2


@dataclass(frozen=True, slots=True)
class FetchModel:
    """Transfer figures of a fetch.

    ``transfer_s(n) = latency_s + n × kv_bytes_per_token / bandwidth_bytes_per_s``:
    the receiver waits that long for ``n`` tokens' KV (defaults: Llama-3.1-8B
    bf16, 128 KiB per token, over a 25 GB/s RDMA-class link, plus 1 ms for
    the round trip to the owner and the bundle's checksum). The owner is
    busy for ``export_fraction × transfer_s(n)`` copying the blocks out of
    its KV pool (0.1: a device-to-host copy at PCIe-class ~250 GB/s is a
    tenth of the 25 GB/s network's time), which delays its own work.
    ``patience`` and ``prefill_patience``: the live Worker's (``FetchConfig``),
    how many times its recompute time a receiver waits for a fetch, and for
    one whose hint says the owner still computes the prefix.
    """

    kv_bytes_per_token: int = LLAMA_8B_KV_BYTES_PER_TOKEN
    bandwidth_bytes_per_s: float = 25e9
    latency_s: float = 0.001
    export_fraction: float = 0.1
    patience: float = 1.0
    prefill_patience: float = 3.0

    def __post_init__(self) -> None:
        if type(self.kv_bytes_per_token) is not int or self.kv_bytes_per_token <= 0:
            raise ValueError(f"kv_bytes_per_token must be a positive int, got {self.kv_bytes_per_token!r}")
        for name, low in (("bandwidth_bytes_per_s", 0.0), ("latency_s", None), ("export_fraction", None),
                          ("patience", None), ("prefill_patience", None)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value < 0 or (low is not None and value <= low):
                raise ValueError(f"{name} must be a finite number {'>' if low is not None else '>='} 0, "
                                 f"got {value!r}")

    def transfer_s(self, num_tokens: int) -> float:
        return self.latency_s + num_tokens * self.kv_bytes_per_token / self.bandwidth_bytes_per_s

    def export_s(self, num_tokens: int) -> float:
        return self.export_fraction * self.transfer_s(num_tokens)

    def patience_s(self, recompute_s: float, owner_computing: bool) -> float:
        """How long a receiver waits for a fetch whose tokens it would
        recompute in ``recompute_s`` (the Worker's ``PrefixFetcher._patience_s``)."""
        return (max(self.patience, self.prefill_patience) if owner_computing else self.patience) * recompute_s

    def reported_costs(self, prefill_s_per_token: float) -> tuple[float, float]:
        """``(fetch_token_cost, fetch_overhead_tokens)`` a receiver that
        prefills a token in ``prefill_s_per_token`` reports in its summary, as
        a live worker's fetcher does (``CacheSummary``): the transfer per
        token and its fixed latency, in prefill-token equivalents."""
        return (rounded_rate(self.kv_bytes_per_token / self.bandwidth_bytes_per_s / prefill_s_per_token),
                rounded_rate(self.latency_s / prefill_s_per_token))


class Owner(Protocol):
    """What a fetch needs of the owning replica (both models provide it)."""

    replica_id: str

    def match_units(self, units: tuple[int, ...]) -> int:
        """Leading units of ``units`` cached now (no LRU touch)."""

    def queued_units(self, units: tuple[int, ...]) -> int:
        """Leading units of ``units`` a request waiting here, not yet in the
        tree, will compute once admitted (its prompt shares them); 0 where a
        request enters the tree on arrival. The live owner counts such a
        request too (``Scheduler.in_flight_prefix_tokens``: waiting
        sequences and the inbox)."""

    def computed_units(self, units: tuple[int, ...], now: float) -> int:
        """Leading units of ``units`` cached with their KV computed by
        ``now``: what an export reads (a worker's tree takes a block once
        the prefill chunk that computes it has run)."""

    def prefill_done_s(self, units: tuple[int, ...], num_units: int, now: float) -> float:
        """When the first ``num_units`` of ``units`` (all in the tree) are
        computed here: ``now`` if they are, the end of the prefill that
        computes them if one is in flight (queued or running) and its end is
        known, else ``inf`` (an answer still decoding; the batching model,
        whose step times are not known ahead)."""

    def export(self, units: tuple[int, ...], now: float, busy_s: float) -> None:
        """Copy ``units`` out (a pure read, as the worker's export: no LRU touch)
        and stay busy ``busy_s`` from ``now``."""


@dataclass(frozen=True, slots=True)
class SimFetch:
    """A hint as the simulator hands it to the receiving replica: the owner
    replica itself, the hinted tokens (``FetchHint.num_tokens``), the model,
    and the replicas of ``FetchHint.alternates``, asked in turn when the
    owner holds no more than the receiver."""

    owner: Owner
    num_tokens: int
    model: FetchModel
    alternates: tuple[Owner, ...] = ()
    owner_computing: bool = False  # FetchHint.owner_computing: the receiver waits prefill_patience


@dataclass(frozen=True, slots=True)
class FetchPlan:
    """What the receiver does: ``num_units`` leading units fetched (0: it
    recomputes), in ``transfer_s``; ``reason`` for the figures:
    ``"fetched"``, ``"held"`` (the receiver holds every hinted unit itself:
    a backup hint it did not need), ``"evicted"`` (no replica named holds
    more than the receiver), ``"slower"`` (recomputing was cheaper),
    ``"outwaited"`` (the owner's prefill would end too late: the receiver
    waited its patience, in ``transfer_s``, then recomputes).
    ``num_asked``: replicas asked (the owner, then alternates until one held
    more); each that held no more cost the receiver a round trip
    (``latency_s``), in ``transfer_s`` whatever the outcome. ``wait_s``:
    of ``transfer_s``, the wait for the owner's prefill in flight (the
    transfer follows it)."""

    num_units: int
    num_tokens: int
    transfer_s: float
    reason: str
    num_asked: int = 0
    wait_s: float = 0.0

    @property
    def from_alternate(self) -> bool:
        """Fetched from an alternate: the owner (and any alternate before) had evicted the prefix."""
        return self.reason == "fetched" and self.num_asked > 1


class Timing(Protocol):
    def prefill_s(self, num_computed_tokens: int, num_cached_tokens: int = 0) -> float: ...


def plan_fetch(fetch: SimFetch, units: tuple[int, ...], unit_tokens: int, num_own_units: int,
               cached_tokens, timing: Timing, now: float) -> FetchPlan:
    """Decide a hinted fetch for a request whose receiver holds
    ``num_own_units`` of ``units``; ``cached_tokens(units) -> tokens`` (the
    request's rule, at most prompt - 1). A receiver that holds the hinted
    tokens itself takes nothing. Else the owner's cache is read now (it may
    have evicted them), then each alternate's in turn until one holds more
    than the receiver, as the worker asks them, each for as much of the
    prompt as it holds: past the hint too (the replica that generated a
    chat's last answer holds it, though no router learned those tokens). If
    the fetch pays, the replica that holds them is charged its export time
    at ``now``."""
    hinted = units[:min(hinted_units(fetch.num_tokens, unit_tokens), len(units))]
    if num_own_units >= len(hinted):
        return FetchPlan(0, 0, 0.0, "held")
    own_tokens = cached_tokens(num_own_units)
    latency_s = fetch.model.latency_s
    for num_asked, owner in enumerate((fetch.owner, *fetch.alternates), 1):
        held, ready_s = _held_by(owner, units, now)
        missing = cached_tokens(held) - own_tokens
        if held > num_own_units and missing > 0:
            break
    else:  # every replica named had evicted them: a round trip each, then recompute
        return FetchPlan(0, 0, num_asked * latency_s, "evicted", num_asked)
    asked_s = (num_asked - 1) * latency_s  # the replicas before it answered "evicted"
    transfer_s = fetch.model.transfer_s(missing)
    recompute_s = timing.prefill_s(missing, own_tokens)
    if transfer_s >= recompute_s:
        return FetchPlan(0, 0, asked_s, "slower", num_asked)
    wait_s, patience_s = ready_s - now, fetch.model.patience_s(recompute_s, fetch.owner_computing)
    if wait_s + transfer_s > patience_s:  # the patience ran out first
        return FetchPlan(0, 0, asked_s + patience_s, "outwaited", num_asked)
    owner.export(units[:held], ready_s, fetch.model.export_s(missing))
    return FetchPlan(held, missing, asked_s + wait_s + transfer_s, "fetched", num_asked, wait_s)


def awaits_owner_prefill(fetch: SimFetch, units: tuple[int, ...], unit_tokens: int, num_own_units: int,
                         cached_tokens, timing: Timing, since_s: float, now: float) -> bool:
    """Whether a receiver that got ``fetch`` at ``since_s`` still waits at
    ``now`` for its owner to compute the hinted prefix (the batching model's
    deferral; the FIFO model knows the prefill's end instead): the owner's
    tree holds more of it than it has computed and the receiver holds, and
    the receiver's patience (:meth:`FetchModel.patience_s` of its recompute
    time of those tokens) less the transfer has not run out."""
    pending = owner_computes(fetch, units, unit_tokens, num_own_units, now)
    if not pending:
        return False
    own_tokens = cached_tokens(num_own_units)
    missing = cached_tokens(pending) - own_tokens
    model = fetch.model
    patience_s = model.patience_s(timing.prefill_s(missing, own_tokens), fetch.owner_computing) - model.transfer_s(missing)
    return now < since_s + patience_s


def owner_computes(fetch: SimFetch, units: tuple[int, ...], unit_tokens: int, num_own_units: int,
                   now: float) -> int:
    """The hinted units (of ``units``) the owner's tree holds, or a request
    waiting there will compute (:meth:`Owner.queued_units`), past both what
    it has computed by ``now`` and the receiver's ``num_own_units``, where a
    prefill in flight or queued still computes some (else 0)."""
    owner = fetch.owner
    promised = max(owner.match_units(units), owner.queued_units(units))
    pending = min(promised, hinted_units(fetch.num_tokens, unit_tokens), len(units))
    if pending <= num_own_units or owner.computed_units(units, now) >= pending:
        return 0
    return pending


def hinted_units(num_tokens: int, unit_tokens: int) -> int:
    """Units a hint of ``num_tokens`` reaches into: a unit partly hinted
    counts whole (a within-block hint names part of a trace's partial last
    unit, whose hash id says the owner holds all of it)."""
    return -(-num_tokens // unit_tokens)


def _held_by(owner: Owner, units: tuple[int, ...], now: float) -> tuple[int, float]:
    """``(units, when)``: the leading units of ``units`` the owner's export
    gives and when it can: all it holds once its prefill in flight has
    computed them, where that end is known (:meth:`Owner.prefill_done_s`),
    else what it has computed by ``now``, at once."""
    held = owner.match_units(units)
    done_s = owner.prefill_done_s(units, held, now) if held else now
    if done_s < math.inf:
        return held, done_s
    return owner.computed_units(units, now), now


def still_computed(units: tuple[int, ...], computing: tuple[int, ...], num_done: int) -> bool:
    """Whether unit ``num_done`` of ``units`` is one a request prefilling
    ``computing`` (its first ``num_done`` units computed) has yet to
    compute: the two share their first ``num_done + 1`` units."""
    return len(units) > num_done < len(computing) and units[:num_done + 1] == computing[:num_done + 1]


def held_elsewhere(peers: Sequence[Owner], units: tuple[int, ...], cached_tokens, num_used_tokens: int,
                   now: float) -> int:
    """Prompt tokens some other replica (of ``peers``) held, computed, at
    ``now`` beyond the ``num_used_tokens`` a request reused (cached or
    fetched), read from the replicas' true caches when its outcome is fixed:
    what a fleet whose caches acted as one would have saved on top.
    ``cached_tokens(units) -> tokens`` is the request's rule (at most prompt
    - 1). A report-only figure: no policy ever reads it. O(len(units)) per
    peer."""
    if not peers:
        return 0
    deepest = max(peer.computed_units(units, now) for peer in peers)
    return max(cached_tokens(deepest) - num_used_tokens, 0)


@dataclass(slots=True)
class FetchCounts:
    """Per replica: fetches received by outcome, tokens fetched, export time given."""

    num_fetched: int = 0
    num_held: int = 0
    num_evicted: int = 0
    num_slower: int = 0
    num_outwaited: int = 0
    num_waited: int = 0  # of the fetched: waited for the owner's prefill in flight
    num_fetched_tokens: int = 0
    export_busy_s: float = 0.0
    num_from_alternate: int = 0  # of the fetched: from an alternate (the owner had evicted the prefix)

    def count(self, plan: FetchPlan) -> None:
        if plan.reason == "fetched":
            self.num_fetched += 1
            self.num_fetched_tokens += plan.num_tokens
            self.num_from_alternate += plan.from_alternate
            self.num_waited += plan.wait_s > 0
        elif plan.reason == "held":
            self.num_held += 1
        elif plan.reason == "evicted":
            self.num_evicted += 1
        elif plan.reason == "outwaited":
            self.num_outwaited += 1
        else:
            self.num_slower += 1
