"""The peers' routing rules, as the simulator replays them.

Each baseline reads the simulated replicas as its live counterpart reads
its engines: request counts (running + waiting) and active tokens (queued
prompts + running sequences' tokens so far) — never a request's future
decode or real output length — and, generously, each replica's *true*
cache contents (``match_units``), where the real routers work from an
approximate router-side tree or from KV events. Ours sees only its own
index, the replicas' periodic summaries and completions. Every rule is
``choose(request, replicas, now) -> replica index``.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from cache import RadixCache
from router.cluster import SimReplica
from router.workload import SimRequest


class RoundRobin:
    """Replica ``i mod N`` for the i-th request."""

    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, request: SimRequest, replicas: Sequence[SimReplica], now: float) -> int:
        index = self._next % len(replicas)
        self._next += 1
        return index


class PowerOfTwo:
    """Ray Serve's default: two random replicas, the shorter queue wins."""

    name = "pow2"

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def choose(self, request: SimRequest, replicas: Sequence[SimReplica], now: float) -> int:
        if len(replicas) == 1:
            return 0
        a, b = self._rng.sample(range(len(replicas)), 2)
        return a if replicas[a].queue_len(now) <= replicas[b].queue_len(now) else b


def _match_rates(request: SimRequest, replicas: Sequence[SimReplica]) -> list[float]:
    total = max(request.num_prompt_tokens, 1)
    return [request.cached_tokens(r.match_units(request.units)) / total for r in replicas]


def _lowest_queue(indices: Sequence[int], replicas: Sequence[SimReplica], now: float) -> int:
    return min(indices, key=lambda i: (replicas[i].queue_len(now), i))


class RayPrefixAffinity:
    """Ray Serve LLM's PrefixCacheAffinityRouter (imbalanced_threshold=inf, its
    default): match rate >= 0.1 → the replicas with the deepest match, else
    the replicas with the smallest tree; the lowest queue among them."""

    name = "ray_prefix_affinity"

    def choose(self, request: SimRequest, replicas: Sequence[SimReplica], now: float) -> int:
        rates = _match_rates(request, replicas)
        best = max(rates)
        if best >= 0.1:
            chosen = [i for i, rate in enumerate(rates) if rate == best]
        else:
            smallest = min(r.radix.num_tokens for r in replicas)
            chosen = [i for i, r in enumerate(replicas) if r.radix.num_tokens == smallest]
        return _lowest_queue(chosen, replicas, now)


class RayPrefixTree:
    """Ray Serve LLM's PrefixCacheAffinityRouter as it runs (ray 2.60): the
    same rule as :class:`RayPrefixAffinity`, but on *its own* prefix tree —
    each prompt (as text: one character per token here) inserted for the
    replica it was routed to at the moment it is routed, never the response,
    never evicted (``do_eviction=False``, the default) — rather than on the
    replicas' true caches. A request that follows one still queued therefore
    matches it already, as live; a chat's next turn matches only its previous
    prompt. Trees count units (tokens for the generated workloads)."""

    name = "ray_prefix_tree"

    def __init__(self) -> None:
        self._trees: list[RadixCache] = []

    def choose(self, request: SimRequest, replicas: Sequence[SimReplica], now: float) -> int:
        while len(self._trees) < len(replicas):
            self._trees.append(RadixCache(1 << 62, block_size=1))
        total = max(len(request.units), 1)
        rates = [tree.match(request.units, touch=False).num_tokens / total for tree in self._trees]
        best = max(rates)
        if best >= 0.1:
            chosen = [i for i, rate in enumerate(rates) if rate == best]
        else:
            smallest = min(tree.num_tokens for tree in self._trees)
            chosen = [i for i, tree in enumerate(self._trees) if tree.num_tokens == smallest]
        index = _lowest_queue(chosen, replicas, now)
        self._trees[index].insert(request.units)
        return index


class SGLangCacheAware:
    """SGLang router ``cache_aware``: loads are running-request counts;
    imbalanced iff max - min > 64 and max > 1.5 * min → least loaded; else
    match rate > 0.3 → the best match; else least loaded."""

    name = "sglang_cache_aware"

    def choose(self, request: SimRequest, replicas: Sequence[SimReplica], now: float) -> int:
        loads = [r.queue_len(now) for r in replicas]
        least = min(range(len(replicas)), key=lambda i: (loads[i], i))
        if max(loads) - min(loads) > 64 and max(loads) > 1.5 * min(loads):
            return least
        rates = _match_rates(request, replicas)
        best = max(range(len(replicas)), key=lambda i: (rates[i], -loads[i], -i))
        return best if rates[best] > 0.3 else least


class DynamoKV:
    """NVIDIA Dynamo's KV router cost: argmin over replicas of
    ``1.0 * prefill_blocks + decode_blocks`` (prefill blocks: the request's
    uncached blocks there; decode blocks: blocks of the requests active
    there); ties at random."""

    name = "dynamo_kv"

    def __init__(self, block_tokens: int, rng: random.Random, overlap_weight: float = 1.0) -> None:
        self._block_tokens = block_tokens
        self._rng = rng
        self._overlap_weight = overlap_weight

    def choose(self, request: SimRequest, replicas: Sequence[SimReplica], now: float) -> int:
        costs = []
        for r in replicas:
            uncached = request.num_prompt_tokens - request.cached_tokens(r.match_units(request.units))
            prefill_blocks = uncached / self._block_tokens
            decode_blocks = r.active_tokens(now) / self._block_tokens
            costs.append(self._overlap_weight * prefill_blocks + decode_blocks)
        lowest = min(costs)
        return self._rng.choice([i for i, c in enumerate(costs) if c == lowest])


class LlmdScorers:
    """llm-d inference scheduler's default scorers, weighted sum, argmax:
    queue (x2, min-max normalised, shorter is better), KV-cache utilisation
    (x2, ``1 - active tokens / budget``), prefix cache (x3, fraction of the
    prompt's blocks cached there); ties at random."""

    name = "llm_d"

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def choose(self, request: SimRequest, replicas: Sequence[SimReplica], now: float) -> int:
        queues = [r.queue_len(now) for r in replicas]
        low, high = min(queues), max(queues)
        rates = _match_rates(request, replicas)
        scores = []
        for r, queue, rate in zip(replicas, queues, rates):
            queue_score = 1.0 if high == low else (high - queue) / (high - low)
            budget = max(r.radix.budget_tokens * request.unit_tokens, 1)
            kv_score = 1.0 - min(1.0, r.active_tokens(now) / budget)
            scores.append(2 * queue_score + 2 * kv_score + 3 * rate)
        best = max(scores)
        return self._rng.choice([i for i, s in enumerate(scores) if s == best])
