"""Simulated replicas: a real radix cache each, a FIFO queue, a cost model."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from cache import RadixCache
from cache.summary import CacheSummary, cached_block_hashes
from router.workload import SimRequest


@dataclass(frozen=True, slots=True)
class CostModel:
    """Time a replica spends on a request, as in a continuous-batching engine
    where decode is cheap next to prefill.

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

    def service_s(self, num_computed_tokens: int, num_output_tokens: int) -> float:
        return num_computed_tokens / self.prefill_tokens_per_s + num_output_tokens * self.decode_s_per_token


@dataclass(frozen=True, slots=True)
class Served:
    """What happened to one request."""

    replica: int
    cached_tokens: int
    ttft_s: float
    finish_s: float


class SimReplica:
    """One worker: a simulated-mode :class:`cache.RadixCache` over the
    workload's units under ``budget_units``, and a FIFO server.

    A request is matched and inserted when it is routed: in a FIFO queue the
    cache state it meets when it starts is exactly what the requests ahead of
    it leave, so doing it at arrival gives the same hits (and requests that
    share a prefix while queued compute it once, as the engine's in-flight
    sharing does).
    """

    def __init__(self, replica_id: str, budget_units: int, cost: CostModel) -> None:
        self.replica_id = replica_id
        self.radix = RadixCache(budget_units, block_size=1)
        self.cost = cost
        self.free_at_s = 0.0
        self.busy_s = 0.0
        self._in_flight: deque[tuple[float, int]] = deque()  # (finish_s, active tokens)
        self._active_tokens = 0

    def match_units(self, units: tuple[int, ...]) -> int:
        return self.radix.match(units, touch=False).num_tokens

    def queue_len(self, now: float) -> int:
        self._expire(now)
        return len(self._in_flight)

    def active_tokens(self, now: float) -> int:
        """Tokens (prompt + output) of requests queued or running here."""
        self._expire(now)
        return self._active_tokens

    def pending_work_s(self, now: float) -> float:
        return max(0.0, self.free_at_s - now)

    def serve(self, request: SimRequest, now: float) -> Served:
        num_units = self.radix.match(request.units, touch=True).num_tokens
        cached = request.cached_tokens(num_units)
        self._expire(now)
        start = max(now, self.free_at_s)
        prefill_s = (request.num_prompt_tokens - cached) / self.cost.prefill_tokens_per_s
        service_s = prefill_s + request.num_output_tokens * self.cost.decode_s_per_token
        self.free_at_s = start + service_s
        self.busy_s += service_s
        active = request.num_prompt_tokens + request.num_output_tokens
        self._in_flight.append((self.free_at_s, active))
        self._active_tokens += active
        self.radix.insert(request.cache_units)
        return Served(-1, cached, start - now + prefill_s, self.free_at_s)

    def summary(self, version: int, now: float, unit_tokens: int, units_per_block: int) -> CacheSummary:
        """What the worker would report: cached block hashes at the router's
        block size and its load (pending work, in prefill-token equivalents)."""
        load_tokens = int(self.pending_work_s(now) * self.cost.prefill_tokens_per_s)
        return CacheSummary(
            replica_id=self.replica_id,
            version=version,
            timestamp_s=now,
            block_size=unit_tokens * units_per_block,
            block_hashes=frozenset(cached_block_hashes(self.radix, units_per_block)),
            num_cached_tokens=self.radix.num_tokens * unit_tokens,
            budget_tokens=self.radix.budget_tokens * unit_tokens,
            num_queued_tokens=load_tokens,
            num_running=self.queue_len(now),
        )

    def _expire(self, now: float) -> None:
        while self._in_flight and self._in_flight[0][0] <= now:
            self._active_tokens -= self._in_flight.popleft()[1]
