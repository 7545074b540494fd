"""Replay a workload through every routing policy on simulated replicas.

    python -m router.simulate --trace FILE --replicas N --budget-tokens B --json OUT [--plot PNG]
    python -m router.simulate --workload shared-prefix|multi-turn --replicas N --budget-tokens B --json OUT
        [--replica-model fifo|cb] [--profile PROFILE.json] [--max-tokens N] [--routers K]
        [--arrivals open|closed --concurrency N --ingress-s S]
        [--kv-bytes-per-token B --fetch-bandwidth-gbps G --fetch-export-fraction F]

Fetch (issue 13, :mod:`router.sim_fetch`): ``ours`` hints a lighter replica
to fetch a prefix from its owner; the receiver fetches when the transfer
beats recomputing; ``ours_nofetch`` is the same policy with fetch off.
Peers never fetch.

Replica models: ``fifo`` (:class:`router.cluster.CostModel`: prefill time ∝
tokens computed, a decode time per output token, one request at a time) and
``cb`` (:class:`router.batching.BatchingReplica`: continuous batching with
chunked prefill under a step profile, e.g. one ``python -m router.calibrate``
measured). Honest inputs: ours sees each request's ``max_tokens`` (never its
output length), the summaries a live worker fills, and completion events.
Arrivals are rescaled so round robin with no cache hits would keep the
replicas ``--utilisation`` busy: ``factor = no-hit work / (N × utilisation ×
trace span)``, a request's work being its time alone on a replica; or, with
``--arrivals closed`` (:mod:`router.closed_loop`), N client sessions each send
their next request when the previous completes, as the live load test does. Writes ``{"global_lru_hit_rate", "infinite_hit_rate",
"policies": {NAME: {"hit_rate", "load_imbalance", "ttft_p50_s",
"ttft_p99_s", ...}}, "setup": {...}}``. Hit rates count prompt tokens.
The setup is :mod:`router.sim_config`; the command line, :mod:`router.sim_cli`.
"""

from __future__ import annotations

import json
import math
import random
import sys
import time
from collections import deque
from dataclasses import asdict, replace

from cache import RadixCache
from cache.summary import BASE_REF_KEY, CacheSummary, SummaryStream
from cache.summary_sender import REF_WIRE_BYTES, SummarySender
from harness.loadstats import percentile
from router.baselines import (DynamoKV, LlmdScorers, PowerOfTwo, RayPrefixAffinity, RayPrefixTree, RoundRobin,
                              SGLangCacheAware)
from router.batching import BatchingReplica
from router.closed_loop import arrivals
from router.cluster import CostModel, SimReplica
from router.policy import PolicyConfig  # re-exported
from router.policy import PrefixAffinityPolicy
from router.request import RoutingRequest
from router.shared_decisions import PeerDecision
from router.sim_cli import build_parser, build_run
from router.sim_cli import workload_kind  # re-exported
from router.sim_config import KNOWN_POLICY_NAMES, POLICY_NAMES, SimConfig, check_policy_names
from router.sim_config import REPLICA_MODELS, SIM_SUMMARY_MODES, TRACE_MAX_TOKENS  # re-exported
from router.sim_fetch import SimFetch
from router.sim_report import plot, replay_figures
from router.sim_table import print_table
from router.workload import Workload, scale_arrivals


def make_replicas(config: SimConfig, budget_units: int) -> list:
    if config.replica_model == "fifo":
        replicas = [SimReplica(f"replica-{i}", budget_units, config.cost, config.cache_protected_share)
                    for i in range(config.num_replicas)]
    else:
        replicas = [BatchingReplica(f"replica-{i}", budget_units, config.profile, config.cache_protected_share)
                    for i in range(config.num_replicas)]
    prefill_s_per_token = (1.0 / config.cost.prefill_tokens_per_s if config.replica_model == "fifo"
                           else config.profile.prefill_token_s)
    for replica in replicas:
        replica.peers = tuple(peer for peer in replicas if peer is not replica)
        replica.reported_token_costs = config.reported_token_costs
        replica.reported_fetch_costs = (config.reported_fetch_costs if config.reported_fetch_costs is not None
                                        else config.fetch.reported_costs(prefill_s_per_token))
    return replicas


class Ours:
    """:class:`PrefixAffinityPolicy` driven as live routers are. Its only inputs
    are :class:`RoutingRequest` (``num_output_tokens`` = the request's
    ``max_tokens``), the :class:`CacheSummary` each replica reports every
    ``summary_period_s`` (what a live worker fills: :meth:`summary` of the
    simulated replica) and completion events; it never reads a replica.
    With ``num_routers > 1`` each router takes every ``num_routers``-th
    request and sees only its own decisions and completions, plus every
    summary; with ``share_decisions_s`` each also books the others'
    decisions that long after they were made (``on_peer_routed``, with what
    a live router sends: the tokens past the last full block, not the prompt). A decision's fetch hint goes to the chosen replica as a
    :class:`SimFetch` (:meth:`take_fetch`); ``fetch=False`` (``ours_nofetch``)
    turns fetch off in the policy."""

    name = "ours"

    def __init__(self, workload: Workload, replicas: list, config: SimConfig, fetch: bool = True) -> None:
        self.now = 0.0
        self._replicas, self._fetch_model, self._fetch = replicas, config.fetch, None
        self.num_fetch_hints = 0
        self._prepared: tuple[int, RoutingRequest] | None = None
        policy_config = replace(config.policy, fetch_enabled=config.policy.fetch_enabled and fetch,
                                block_size=workload.router_block_tokens,
                                decode_token_cost=config.decode_token_cost if config.decode_token_cost is not None
                                else config.timing.decode_token_cost,
                                queue_decode_token_cost=config.policy.queue_decode_token_cost
                                if config.policy.queue_decode_token_cost is not None
                                else config.timing.queue_token_cost)  # an explicit setting wins (the live router's)
        self.routers = [PrefixAffinityPolicy(policy_config, clock=lambda: self.now)
                        for _ in range(config.num_routers)]
        for router in self.routers:
            router.set_replicas(r.replica_id for r in replicas)
        self._index_of = {r.replica_id: i for i, r in enumerate(replicas)}
        self._max_tokens = config.max_tokens or max((r.num_output_tokens for r in workload.requests), default=1)
        self._router_of: dict[str, PrefixAffinityPolicy] = {}
        self._share_s = config.share_decisions_s if config.num_routers > 1 else None
        self._shared: deque = deque()  # (due, router index, PeerDecision): decisions on their way to the others

    def routing_request(self, request) -> RoutingRequest:
        """What the ingress knows: block hashes, prompt length, token ids, max_tokens."""
        return RoutingRequest(request.block_hashes, request.num_prompt_tokens,
                              num_output_tokens=self._max_tokens, token_ids=request.token_ids())

    def _deliver_shared(self, now: float) -> None:
        """Book every shared decision due by ``now`` in the routers that did not make it."""
        while self._shared and self._shared[0][0] <= now:
            due, origin, decision = self._shared.popleft()
            self.now = due
            for index, router in enumerate(self.routers):
                if index != origin:
                    router.on_peer_routed(decision.request, decision.replica_id, decision.tail_token_ids)
        self.now = now

    def on_summary(self, summary, now: float) -> None:
        self._deliver_shared(now)
        self.now = now
        for router in self.routers:
            router.on_summary(summary)

    def on_completed(self, number: int, now: float) -> None:
        self._deliver_shared(now)
        self.now = now
        router = self._router_of.pop(str(number), None)
        if router is not None:
            router.on_completed(str(number))

    def prepare(self, number: int, request) -> None:
        """The ingress's part, before the decision: the routing request. A
        trace's stand-in token ids take ~0.1 ms to build that a live ingress
        has from its tokenizer, so the driver leaves this out of the
        decision's time."""
        self._prepared = (number, self.routing_request(request))

    def choose(self, number: int, request, now: float) -> int:
        self._deliver_shared(now)
        self.now = now
        router = self.routers[number % len(self.routers)]
        prepared, self._prepared = self._prepared, None
        routing = prepared[1] if prepared is not None and prepared[0] == number else self.routing_request(request)
        decision = router.decide(routing, request_id=str(number))
        replica_id = decision.ranked[0]
        router.on_routed(routing, replica_id, str(number))
        if self._share_s is not None:  # delays are equal: due times stay in order
            self._shared.append((now + self._share_s, number % len(self.routers),
                                 PeerDecision.of(routing, replica_id, router.config.block_size)))
        self._router_of[str(number)] = router
        hint = decision.fetch
        replica_of = lambda replica_id: self._replicas[self._index_of[replica_id]]  # noqa: E731
        self._fetch = None if hint is None else SimFetch(replica_of(hint.owner), hint.num_tokens, self._fetch_model,
                                                         tuple(map(replica_of, hint.alternates)), hint.owner_computing)
        self.num_fetch_hints += hint is not None
        return self._index_of[replica_id]

    def take_fetch(self) -> SimFetch | None:
        """The last decision's fetch hint, once."""
        fetch, self._fetch = self._fetch, None
        return fetch


class _Peer:
    """A baseline's ``choose(request, replicas, now)`` behind the driver's interface."""

    def __init__(self, rule, replicas: list) -> None:
        self.name, self._rule, self._replicas = rule.name, rule, replicas

    def prepare(self, number: int, request) -> None:
        """Nothing to build: a baseline reads the simulator's request."""

    def choose(self, number: int, request, now: float) -> int:
        return self._rule.choose(request, self._replicas, now)


def make_policies(names, workload: Workload, replicas: list, config: SimConfig):
    rng = random.Random(config.seed)
    factories = {
        "ours": lambda: Ours(workload, replicas, config),
        "ours_nofetch": lambda: Ours(workload, replicas, config, fetch=False),
        "round_robin": lambda: _Peer(RoundRobin(), replicas),
        "pow2": lambda: _Peer(PowerOfTwo(rng), replicas),
        "ray_prefix_affinity": lambda: _Peer(RayPrefixAffinity(), replicas),
        "ray_prefix_tree": lambda: _Peer(RayPrefixTree(), replicas),
        "sglang_cache_aware": lambda: _Peer(SGLangCacheAware(), replicas),
        "dynamo_kv": lambda: _Peer(DynamoKV(workload.router_block_tokens, rng), replicas),
        "llm_d": lambda: _Peer(LlmdScorers(rng), replicas),
    }
    assert set(factories) == set(KNOWN_POLICY_NAMES), "router.sim_config.KNOWN_POLICY_NAMES is out of date"
    check_policy_names(names)
    return [factories[n]() for n in names]


def replay(workload: Workload, config: SimConfig, name: str, progress: bool = False) -> dict:
    """Run one policy over ``workload`` (already scaled); returns its figures.

    Time moves from arrival to arrival; before each, the replicas run up to
    every summary tick in between (ours hears each completion at its time and
    each summary at its tick), then up to the arrival."""
    budget_units = config.budget_tokens // workload.unit_tokens
    replicas = make_replicas(config, budget_units)
    (policy,) = make_policies([name], workload, replicas, config)
    hears = isinstance(policy, Ours)
    next_summary_s = workload.requests[0].arrival_s if workload.requests else 0.0
    version = 0
    decision_us = []
    streams = {r.replica_id: SummaryStream(f"{r.replica_id}@0") for r in replicas}
    senders = {r.replica_id: SummarySender(r.replica_id, put=lambda data: "ref") for r in replicas}
    summary_bytes, summary_cpu_s = 0, 0.0
    summary_bytes_v1 = 0  # the same summaries in the long-keyed v1 wire, for comparison

    def run_to(until: float) -> list:
        completions = [c for r in replicas for c in r.advance(until)]
        if hears:
            for completion in sorted(completions, key=lambda c: c.finish_s):
                policy.on_completed(completion.number, completion.finish_s)
        return completions

    def catch_up(now: float) -> list:
        """Replicas and summaries up to ``now``; the completions on the way."""
        nonlocal next_summary_s, version, summary_bytes, summary_cpu_s, summary_bytes_v1
        completions = []
        while next_summary_s <= now:
            completions += run_to(next_summary_s)
            version += 1
            if hears:
                for replica in replicas:
                    summary = replica.summary(version, next_summary_s, workload.unit_tokens, workload.units_per_block)
                    if config.summary_mode == "stream":
                        summary = streams[replica.replica_id].encode(summary)
                    elif config.summary_mode == "reference":
                        wire = senders[replica.replica_id].encode(summary)
                        summary_bytes += REF_WIRE_BYTES * (wire.pop(BASE_REF_KEY, None) is not None)
                        summary = CacheSummary.from_dict(wire)
                    summary_bytes += len(json.dumps(summary.to_dict()))
                    summary_bytes_v1 += len(json.dumps(summary.to_dict(compact=False)))
                    started = time.thread_time()
                    policy.on_summary(summary, next_summary_s)
                    summary_cpu_s += time.thread_time() - started
            next_summary_s += config.summary_period_s
        return completions + run_to(now)

    if config.closed_loop is None:
        sends = ((number, request.arrival_s) for number, request in enumerate(workload.requests))
    else:
        sessions = workload.sessions or tuple((number,) for number in range(len(workload.requests)))
        sends = arrivals(config.closed_loop.loop(sessions, next_summary_s), catch_up, config.closed_loop.tick_s,
                         next_summary_s)
    if progress:
        from tqdm import tqdm
        sends = tqdm(sends, desc=f"{name:>20}", unit="req", leave=False, file=sys.stderr, total=len(workload.requests))
    sent = []  # request numbers in the order they reached the router
    for number, now in sends:
        request = workload.requests[number]
        sent.append(number)
        catch_up(now)
        policy.prepare(number, request)
        started = time.thread_time()  # CPU time: other processes on a shared machine do not count
        index = policy.choose(number, request, now)
        decision_us.append((time.thread_time() - started) * 1e6)
        replicas[index].submit(number, request, now, policy.take_fetch() if hears else None)
    run_to(math.inf)
    figures = replay_figures(workload, config, replicas, decision_us)
    if config.closed_loop is not None:  # this policy's own arrival order: the one-cache bounds over it
        figures.update(bounds_as_sent(workload, config, sent))
    if hears:
        figures["num_fetch_hints"] = policy.num_fetch_hints
    if hears and version:
        span_s = version * config.summary_period_s
        figures["summary_bytes_per_replica_s"] = summary_bytes / (span_s * len(replicas))
        figures["summary_bytes_v1_per_replica_s"] = summary_bytes_v1 / (span_s * len(replicas))
        figures["router_summary_cpu_ms_per_s"] = 1e3 * summary_cpu_s / (span_s * config.num_routers)
    return figures


def cache_bound(workload: Workload, budget_units: int | None, cost,
                protected_share: float = 0.0) -> tuple[float, float]:
    """One radix cache of ``budget_units`` (None: unbounded) seeing every
    request, LRU (or segmented LRU with ``protected_share``): ``(token hit
    rate, p99 of the prefill time it leaves)``. With an unbounded cache the
    second is a floor under any policy's TTFT p99: each request's TTFT is at
    least its own prefill of what no cache could hold."""
    if budget_units is None:
        budget_units = sum(len(r.cache_units) for r in workload.requests) + 1
    radix = RadixCache(budget_units, block_size=1, protected_share=protected_share)
    cached = total = 0
    prefill_s = []
    for request in workload.requests:
        hit = request.cached_tokens(radix.match(request.units).num_tokens)
        cached += hit
        total += request.num_prompt_tokens
        prefill_s.append(cost.prefill_s(request.num_prompt_tokens - hit, hit))
        radix.insert(request.cache_units)
    prefill_s.sort()
    return cached / max(total, 1), percentile(prefill_s, 99)


def bounds_as_sent(workload: Workload, config: SimConfig, sent: list[int]) -> dict:
    """The one-cache bounds (LRU, and under the replicas' eviction) over the
    requests in the order ``sent`` (request numbers as they reached the
    router). Closed-loop arrivals depend on when each policy's replicas
    finished the earlier turns, so each policy has its own order, and the
    bound over the workload's nominal order is not one its requests could
    meet: there a chat's turns interleave with other chats as generated, not
    as its client sent them."""
    as_sent = replace(workload, requests=tuple(workload.requests[number] for number in sent))
    budget_units = config.budget_tokens // workload.unit_tokens * config.num_replicas
    return {"global_lru_hit_rate_as_sent": cache_bound_hit_rate(as_sent, budget_units),
            "global_cache_hit_rate_as_sent": cache_bound_hit_rate(as_sent, budget_units,
                                                                  config.cache_protected_share)}


def cache_bound_hit_rate(workload: Workload, budget_units: int | None, protected_share: float = 0.0) -> float:
    return cache_bound(workload, budget_units, CostModel(), protected_share)[0]


def arrival_scale(workload: Workload, config: SimConfig) -> float:
    """Factor that makes no-hit round robin run at ``config.utilisation``."""
    requests = workload.requests
    work_s = sum(config.timing.service_s(r.num_prompt_tokens, r.num_output_tokens) for r in requests)
    span_s = requests[-1].arrival_s - requests[0].arrival_s
    if span_s <= 0:
        raise ValueError("workload spans no time; cannot scale arrivals")
    return work_s / (config.num_replicas * config.utilisation * span_s)


def simulate(
    workload: Workload, config: SimConfig, names=POLICY_NAMES, progress: bool = False, seeds=None
) -> dict:
    """Every policy in ``names`` over ``workload``; with several ``seeds`` the
    randomised baselines (pow2, dynamo_kv and llm_d tie-breaks) run once per
    seed and their figures are the means."""
    seeds = tuple(seeds) if seeds else (config.seed,)
    factor = arrival_scale(workload, config) if config.closed_loop is None else 1.0  # closed: no clock to scale
    scaled = scale_arrivals(workload, factor)
    budget_units = config.budget_tokens // workload.unit_tokens
    infinite_hit_rate, ttft_floor_s = cache_bound(scaled, None, config.timing)
    result = {
        "global_lru_hit_rate": cache_bound_hit_rate(scaled, budget_units * config.num_replicas),
        # the same one cache of the fleet's budget under the replicas' own eviction (segmented LRU)
        "global_cache_hit_rate": cache_bound_hit_rate(scaled, budget_units * config.num_replicas,
                                                      config.cache_protected_share),
        "infinite_hit_rate": infinite_hit_rate,
        "ttft_p99_floor_s": ttft_floor_s,
        "policies": {},
        "setup": {
            "workload": workload.name,
            "num_requests": len(workload.requests),
            "num_replicas": config.num_replicas,
            "budget_tokens": config.budget_tokens,
            "utilisation": config.utilisation,
            "arrival_scale": factor,
            "prefill_tokens_per_s": config.cost.prefill_tokens_per_s,
            "decode_s_per_token": config.cost.decode_s_per_token,
            "summary_period_s": config.summary_period_s,
            "replica_model": config.replica_model,
            "profile": config.profile.to_dict() if config.replica_model == "cb" else None,
            "max_tokens": config.max_tokens or max((r.num_output_tokens for r in workload.requests), default=1),
            "num_routers": config.num_routers, "share_decisions_s": config.share_decisions_s,
            "summary_mode": config.summary_mode,
            "closed_loop": asdict(config.closed_loop) if config.closed_loop else None,
            "router_block_tokens": workload.router_block_tokens,
            "policy_config": asdict(config.policy),
            "fetch": asdict(config.fetch),
            "reported_fetch_costs": config.reported_fetch_costs,
            "cache_protected_share": config.cache_protected_share,
        },
    }
    for name in names:
        runs = [replay(scaled, replace(config, seed=seed), name, progress) for seed in seeds]
        result["policies"][name] = runs[0] if len(runs) == 1 else _mean_over_seeds(runs)
    result["setup"]["seeds"] = list(seeds)
    return result


def _mean_over_seeds(runs: list[dict]) -> dict:
    """Means of the figures; ``per_seed`` keeps each run's headline figures."""
    keys = [k for k, v in runs[0].items() if isinstance(v, (int, float))]
    merged = {k: sum(run[k] for run in runs) / len(runs) for k in keys}
    merged["per_seed"] = {k: [run[k] for run in runs] for k in ("hit_rate", "load_imbalance", "ttft_p99_s")}
    return merged


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        workload, config, names = build_run(args)
    except ValueError as error:
        parser.error(str(error))
    seeds = range(args.seed, args.seed + args.seeds)
    result = simulate(workload, config, names, progress=not args.no_progress, seeds=seeds)
    with open(args.json, "w") as handle:
        json.dump(result, handle, indent=2)
    if args.plot:
        plot(result, args.plot)
    print_table(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
