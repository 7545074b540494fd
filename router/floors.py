"""What any dispatcher could reach on FIFO replicas: TTFT floors with queueing,
and the hit rate no router could pass (:func:`hit_ceiling`).

``simulate.cache_bound`` gives the *no-queue* floor (every request starts
on arrival, every prefix cached). Two tighter references for the ``fifo``
replica model, each with one cache shared by the whole fleet (a global LRU
of the fleet's budget, evicting by plain LRU or by the replicas' segmented
LRU, or unbounded) — more than any partitioned fleet has:

- :func:`pooled_fifo` — one first-come-first-served queue in front of all
  N replicas (late binding: a request waits at the router until a replica
  frees). With exact service times, sending each request on arrival to the
  replica with the least work left is the same schedule, request for
  request: the classic reference for dispatching to FIFO servers, here
  with an oracle of every request's output length. (It is not a proof of
  optimality: a dispatcher that reorders short jobs can wait less.)
- :func:`honest_dispatch` — immediate dispatch to the replica with the
  least *estimated* work left, knowing only what a live router can: when it
  sent each request, when each completed (FIFO: a replica's oldest
  unfinished request is the one running) and the output lengths of
  completed requests. ``estimate="mean"`` prices every unfinished output at
  the mean of finished ones; ``"residual"`` prices a request already
  decoding for ``k`` tokens at the mean of finished outputs longer than
  ``k``, less ``k`` (heavy-tailed outputs: the longer one has run, the
  longer it is likely to run on); ``"oracle"`` uses the true lengths and
  reproduces :func:`pooled_fifo`.

Both are references, not policies, and both are generous: the cache is
shared (no affinity to trade against load) and nothing lags. ``"oracle"``
reproducing :func:`pooled_fifo` is tested. ``python -m router.floors``
prints them beside the no-queue floor for a trace.
"""

from __future__ import annotations

import argparse
import bisect
import heapq
import sys
from collections.abc import Sequence

from cache import RadixCache
from cache.segmented_lru import SERVING_PROTECTED_SHARE
from harness.loadstats import percentile
from router.cluster import CostModel
from router.simulate import SimConfig, arrival_scale, cache_bound
from router.workload import Workload, load_mooncake, multi_turn, scale_arrivals, shared_prefix

ESTIMATES = ("oracle", "mean", "residual")


def _shared_cache(workload: Workload, budget_units: int | None, protected_share: float) -> RadixCache:
    if budget_units is None:
        budget_units = sum(len(r.cache_units) for r in workload.requests) + 1
    return RadixCache(budget_units, block_size=1, protected_share=protected_share)


def pooled_fifo(workload: Workload, num_replicas: int, cost: CostModel,
                budget_units: int | None = None, protected_share: float = 0.0) -> tuple[float, list[float]]:
    """``(hit rate, TTFTs in arrival order)`` of one FCFS queue feeding
    ``num_replicas`` FIFO replicas over one shared cache of ``budget_units``
    (None: unbounded); a request's hit is read when it starts, and its
    ``cache_units`` inserted then (as optimistic as the no-queue floor).
    The cache evicts by plain LRU, or with ``protected_share`` > 0 by the
    replicas' adaptive segmented LRU (:class:`cache.segmented_lru.SegmentedLru`)."""
    if num_replicas < 1:
        raise ValueError("num_replicas must be >= 1")
    cache = _shared_cache(workload, budget_units, protected_share)
    free_at = [0.0] * num_replicas
    ttfts: list[float] = []
    cached = total = 0
    for request in workload.requests:
        start = max(heapq.heappop(free_at), request.arrival_s)
        hit = request.cached_tokens(cache.match(request.units).num_tokens)
        computed = request.num_prompt_tokens - hit
        cached += hit
        total += request.num_prompt_tokens
        ttfts.append(start - request.arrival_s + cost.prefill_s(computed, hit))
        heapq.heappush(free_at, start + cost.service_s(computed, request.num_output_tokens))
        cache.insert(request.cache_units)
    return cached / max(total, 1), ttfts


class _OutputLengths:
    """Output lengths of completed requests, sorted; the estimates read them."""

    def __init__(self, prior_tokens: float) -> None:
        self._sorted: list[int] = []
        self._sum = 0
        self._prior = prior_tokens

    def add(self, num_tokens: int) -> None:
        bisect.insort(self._sorted, num_tokens)
        self._sum += num_tokens

    def mean(self) -> float:
        return self._sum / len(self._sorted) if self._sorted else self._prior

    def residual(self, decoded: float) -> float:
        """Mean of finished outputs longer than ``decoded``, less ``decoded``
        (the prior when none was that long)."""
        longer = self._sorted[bisect.bisect_right(self._sorted, decoded):]
        return sum(longer) / len(longer) - decoded if longer else self._prior


class _Job:
    __slots__ = ("start_s", "end_s", "prefill_s", "output_tokens")

    def __init__(self, start_s: float, end_s: float, prefill_s: float, output_tokens: int) -> None:
        self.start_s, self.end_s, self.prefill_s, self.output_tokens = start_s, end_s, prefill_s, output_tokens


def _work_left(jobs: Sequence[_Job], now: float, cost: CostModel, lengths: _OutputLengths, estimate: str) -> float:
    """Seconds of work a replica's unfinished ``jobs`` (FIFO order) still need, as estimated."""
    decode_s = cost.decode_s_per_token
    left = 0.0
    for job in jobs:
        if estimate == "oracle":
            left += max(job.end_s - max(now, job.start_s), 0.0)
            continue
        elapsed = now - job.start_s
        if elapsed < job.prefill_s:  # queued (elapsed < 0) or still in prefill
            left += job.prefill_s - max(elapsed, 0.0) + lengths.mean() * decode_s
        elif estimate == "mean":
            left += max(lengths.mean() * decode_s - (elapsed - job.prefill_s), 0.0)
        else:
            left += lengths.residual((elapsed - job.prefill_s) / decode_s) * decode_s
    return left


def honest_dispatch(workload: Workload, num_replicas: int, cost: CostModel, budget_units: int | None = None,
                    estimate: str = "residual", prior_output_tokens: float = 256,
                    protected_share: float = 0.0) -> list[float]:
    """TTFTs (arrival order) of immediate dispatch to the replica with the
    least estimated work left (ties: the lowest index), over one shared
    cache as in :func:`pooled_fifo`. A replica's job start times follow
    from what the router saw: FIFO, each starts when it was sent or when the
    one before it completed."""
    if estimate not in ESTIMATES:
        raise ValueError(f"estimate must be one of {ESTIMATES}, not {estimate!r}")
    cache = _shared_cache(workload, budget_units, protected_share)
    queues: list[list[_Job]] = [[] for _ in range(num_replicas)]
    completions: list[tuple[float, int]] = []  # (end_s, output tokens): heard when end_s passes
    lengths = _OutputLengths(prior_output_tokens)
    ttfts: list[float] = []
    for request in workload.requests:
        now = request.arrival_s
        while completions and completions[0][0] <= now:
            lengths.add(heapq.heappop(completions)[1])
        for jobs in queues:
            while jobs and jobs[0].end_s <= now:
                jobs.pop(0)
        target = min(range(num_replicas), key=lambda i: (_work_left(queues[i], now, cost, lengths, estimate), i))
        jobs = queues[target]
        hit = request.cached_tokens(cache.match(request.units).num_tokens)
        computed = request.num_prompt_tokens - hit
        start = max(jobs[-1].end_s if jobs else now, now)
        prefill_s = cost.prefill_s(computed, hit)
        end = start + cost.service_s(computed, request.num_output_tokens)
        jobs.append(_Job(start, end, prefill_s, request.num_output_tokens))
        heapq.heappush(completions, (end, request.num_output_tokens))
        ttfts.append(start - now + prefill_s)
        cache.insert(request.cache_units)
    return ttfts


def floors(workload: Workload, num_replicas: int, cost: CostModel, budget_units: int,
           protected_share: float = 0.0) -> dict:
    """Every reference at ``budget_units`` per replica (shared: × replicas)
    under plain LRU (``global_lru``), under the replicas' segmented LRU where
    ``protected_share`` > 0 (``global_cache``), and unbounded; and
    ``hit_ceiling``, :func:`hit_ceiling` of the fleet's whole budget."""
    shared = budget_units * num_replicas
    caches = [("global_lru", shared, 0.0), ("unbounded", None, 0.0)]
    if protected_share > 0:
        caches.insert(1, ("global_cache", shared, protected_share))
    result = {"hit_ceiling": hit_ceiling(workload, shared)}
    for label, budget, share in caches:
        hit, pooled = pooled_fifo(workload, num_replicas, cost, budget, share)
        result[label] = {"hit_rate": hit, "pooled_ttft_p99_s": percentile(sorted(pooled), 99)}
        for estimate in ("mean", "residual"):
            ttfts = sorted(honest_dispatch(workload, num_replicas, cost, budget, estimate, protected_share=share))
            result[label][f"honest_{estimate}_ttft_p99_s"] = percentile(ttfts, 99)
    return result


def prefix_nodes(units: Sequence[int], node_of: dict[tuple[int, int], int]) -> list[int]:
    """One id per unit of ``units`` that stands for the unit and everything
    before it (a radix tree's node): equal ids, equal prefixes. ``node_of``
    maps ``(parent id, unit)`` to ids and grows as new prefixes are seen."""
    node, nodes = -1, []
    for unit in units:
        node = node_of.setdefault((node, unit), len(node_of))
        nodes.append(node)
    return nodes


def hit_ceiling(workload: Workload, budget_units: int | None) -> float:
    """An upper bound on the token hit rate any router and any eviction can
    reach over replicas whose caches hold ``budget_units`` in all (None:
    unbounded): Belady's offline rule over one cache of that size.

    The fleet's caches together never hold more than their budgets, a
    replica caches a block only when it computes or fetches it, and a prompt
    reuses only what its replica holds: every hit of a routed fleet is a hit
    of one cache holding the union. That cache is given the future: a unit
    of a prompt or answer is kept if it is read again sooner than something
    kept (which then goes), else not kept at all; for equal-sized units this
    keeps the most reads possible. A prompt counts every kept unit it reads,
    not only its leading run (at most ``T - 1`` tokens), and reads the cache
    on arrival, before anything queued ahead of it: so a bound, not a policy.
    Units are told apart by their whole prefix, as the radix tree does.
    Reads go in arrival order; queues that reorder them across replicas
    change Belady's optimum, so below the infinite cache's rate this bounds
    that order, not every schedule."""
    node_of: dict[tuple[int, int], int] = {}
    events: list[tuple[int, int]] = []  # (node, request number: reads it; -1: its answer, cached unread)
    tokens: list[int] = []  # the prompt tokens each read unit holds (the last unit may be partial)
    for number, request in enumerate(workload.requests):
        read = prefix_nodes(request.units, node_of)
        last_tokens = request.num_prompt_tokens - request.unit_tokens * (len(read) - 1)
        events += [(node, number) for node in read]
        tokens += [request.unit_tokens] * (len(read) - 1) + [last_tokens] * bool(read)
        read_set = set(read)
        written = [node for node in prefix_nodes(request.cache_units, node_of) if node not in read_set]
        events += [(node, -1) for node in written]  # what the request caches past its prompt (a chat's answer)
        tokens += [0] * len(written)
    never = len(events)
    next_read = [never] * len(events)
    last_seen: dict[int, int] = {}
    for index in range(len(events) - 1, -1, -1):
        node, reader = events[index]
        next_read[index] = last_seen.get(node, never)
        if reader >= 0:
            last_seen[node] = index
    capacity = never if budget_units is None else budget_units
    kept: dict[int, int] = {}  # node -> the index of its next read
    farthest: list[tuple[int, int]] = []  # (-next read, node), stale entries skipped
    hit_tokens = [0] * len(workload.requests)
    for index, (node, reader) in enumerate(events):
        if reader >= 0 and node in kept:
            hit_tokens[reader] += tokens[index]
        upcoming = next_read[index]
        if node not in kept:
            if upcoming == never or capacity <= 0:
                continue
            if len(kept) >= capacity:
                while kept.get(farthest[0][1]) != -farthest[0][0]:
                    heapq.heappop(farthest)
                if -farthest[0][0] <= upcoming:
                    continue
                del kept[heapq.heappop(farthest)[1]]
        kept[node] = upcoming
        heapq.heappush(farthest, (-upcoming, node))
    cached = sum(min(hit, request.num_prompt_tokens - 1) for request, hit in zip(workload.requests, hit_tokens))
    return cached / max(sum(request.num_prompt_tokens for request in workload.requests), 1)


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    """The fleet and its workload, as ``router.floors`` and ``harness.eviction_probe`` take them."""
    parser.add_argument("--trace", help="Mooncake-format JSONL trace")
    parser.add_argument("--workload", choices=("shared-prefix", "multi-turn"),
                        help="a generated workload instead of a trace (as router.simulate builds it)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--replicas", type=int, required=True)
    parser.add_argument("--budget-tokens", type=int, required=True, help="cache budget per replica")


def workload_from_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Workload:
    """The trace or generated workload :func:`add_workload_args` named (exactly one)."""
    if (args.trace is None) == (args.workload is None):
        parser.error("give exactly one of --trace FILE and --workload NAME")
    if args.trace:
        return load_mooncake(args.trace)
    build = shared_prefix if args.workload == "shared-prefix" else multi_turn
    return build(block_tokens=64, seed=args.seed)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m router.floors", description=__doc__.split("\n\n")[0])
    add_workload_args(parser)
    parser.add_argument("--utilisation", type=float, default=0.9)
    parser.add_argument("--prefill-tokens-per-s", type=float, default=20_000.0)
    parser.add_argument("--decode-s-per-token", type=float, default=0.002)
    parser.add_argument("--cache-protected-share", type=float, default=SERVING_PROTECTED_SHARE,
                        help="the shared cache's segmented LRU, as the replicas evict (0: plain LRU only)")
    args = parser.parse_args(argv)
    workload = workload_from_args(parser, args)
    config = SimConfig(num_replicas=args.replicas, budget_tokens=args.budget_tokens, utilisation=args.utilisation,
                       cost=CostModel(args.prefill_tokens_per_s, args.decode_s_per_token))
    scaled = scale_arrivals(workload, arrival_scale(workload, config))
    _, no_queue = cache_bound(scaled, None, config.cost)
    print(f"no-queue floor (unbounded cache): TTFT p99 {no_queue:.3f} s")
    budget_units = args.budget_tokens // workload.unit_tokens
    references = floors(scaled, args.replicas, config.cost, budget_units, args.cache_protected_share)
    print(f"hit ceiling (the fleet's budget as one cache evicting by the future, hit_ceiling): "
          f"{references.pop('hit_ceiling'):.4f}")
    for label, figures in references.items():
        print(f"{label:>10}: hit {figures['hit_rate']:.4f}  pooled FCFS p99 {figures['pooled_ttft_p99_s']:.3f} s  "
              f"honest dispatch p99 (mean) {figures['honest_mean_ttft_p99_s']:.3f} s  "
              f"(residual) {figures['honest_residual_ttft_p99_s']:.3f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
