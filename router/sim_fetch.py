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
    """

    kv_bytes_per_token: int = LLAMA_8B_KV_BYTES_PER_TOKEN
    bandwidth_bytes_per_s: float = 25e9
    latency_s: float = 0.001
    export_fraction: float = 0.1

    def __post_init__(self) -> None:
        if type(self.kv_bytes_per_token) is not int or self.kv_bytes_per_token <= 0:
            raise ValueError(f"kv_bytes_per_token must be a positive int, got {self.kv_bytes_per_token!r}")
        for name, low in (("bandwidth_bytes_per_s", 0.0), ("latency_s", None), ("export_fraction", None)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value < 0 or (low is not None and value <= low):
                raise ValueError(f"{name} must be a finite number {'>' if low is not None else '>='} 0, "
                                 f"got {value!r}")

    def transfer_s(self, num_tokens: int) -> float:
        return self.latency_s + num_tokens * self.kv_bytes_per_token / self.bandwidth_bytes_per_s

    def export_s(self, num_tokens: int) -> float:
        return self.export_fraction * self.transfer_s(num_tokens)

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

    def computed_units(self, units: tuple[int, ...], now: float) -> int:
        """Leading units of ``units`` cached with their KV computed by
        ``now``: what an export reads (a worker's tree takes a block once
        the prefill chunk that computes it has run)."""

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


@dataclass(frozen=True, slots=True)
class FetchPlan:
    """What the receiver does: ``num_units`` leading units fetched (0: it
    recomputes), in ``transfer_s``; ``reason`` for the figures:
    ``"fetched"``, ``"held"`` (the receiver holds every hinted unit itself:
    a backup hint it did not need), ``"evicted"`` (no replica named holds
    more than the receiver), ``"slower"`` (recomputing was cheaper).
    ``num_asked``: replicas asked (the owner, then alternates until one held
    more); each that held no more cost the receiver a round trip
    (``latency_s``), in ``transfer_s`` whatever the outcome."""

    num_units: int
    num_tokens: int
    transfer_s: float
    reason: str
    num_asked: int = 0

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
    hinted = units[:min(fetch.num_tokens // unit_tokens, len(units))]
    if num_own_units >= len(hinted):
        return FetchPlan(0, 0, 0.0, "held")
    own_tokens = cached_tokens(num_own_units)
    latency_s = fetch.model.latency_s
    for num_asked, owner in enumerate((fetch.owner, *fetch.alternates), 1):
        held = owner.computed_units(units, now)
        missing = cached_tokens(held) - own_tokens
        if held > num_own_units and missing > 0:
            break
    else:  # every replica named had evicted them: a round trip each, then recompute
        return FetchPlan(0, 0, num_asked * latency_s, "evicted", num_asked)
    asked_s = (num_asked - 1) * latency_s  # the replicas before it answered "evicted"
    transfer_s = fetch.model.transfer_s(missing)
    if transfer_s >= timing.prefill_s(missing, own_tokens):
        return FetchPlan(0, 0, asked_s, "slower", num_asked)
    owner.export(units[:held], now, fetch.model.export_s(missing))
    return FetchPlan(held, missing, asked_s + transfer_s, "fetched", num_asked)


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
    num_fetched_tokens: int = 0
    export_busy_s: float = 0.0
    num_from_alternate: int = 0  # of the fetched: from an alternate (the owner had evicted the prefix)

    def count(self, plan: FetchPlan) -> None:
        if plan.reason == "fetched":
            self.num_fetched += 1
            self.num_fetched_tokens += plan.num_tokens
            self.num_from_alternate += plan.from_alternate
        elif plan.reason == "held":
            self.num_held += 1
        elif plan.reason == "evicted":
            self.num_evicted += 1
        else:
            self.num_slower += 1
