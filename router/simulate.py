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
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field, replace

from cache import RadixCache
from cache.segmented_lru import SERVING_PROTECTED_SHARE
from cache.summary import BASE_REF_KEY, CacheSummary, SummaryStream
from cache.summary_sender import REF_WIRE_BYTES, SummarySender
from harness.loadstats import percentile
from router.baselines import (DynamoKV, LlmdScorers, PowerOfTwo, RayPrefixAffinity, RayPrefixTree, RoundRobin,
                              SGLangCacheAware)
from router.batching import H100_LLAMA_8B, BatchingReplica, StepProfile
from router.closed_loop import ClosedLoopConfig, arrivals
from router.cluster import CostModel, SimReplica
from router.policy import PolicyConfig, PrefixAffinityPolicy
from router.request import RoutingRequest
from router.sim_fetch import FetchModel, SimFetch
from router.sim_report import plot, replay_figures
from router.sim_table import print_table
from router.workload import Workload, load_mooncake, multi_turn, scale_arrivals, shared_prefix

# how replicas send summaries: whole; a snapshot + chained deltas (SummaryStream); or what a live Worker
# sends, its summary_mode "stream" (cache.summary_sender: deltas naming their base by an object ref)
SIM_SUMMARY_MODES = ("full", "stream", "reference")
POLICY_NAMES = ("ours", "ours_nofetch", "round_robin", "pow2", "ray_prefix_affinity", "sglang_cache_aware", "dynamo_kv", "llm_d")


@dataclass(frozen=True, slots=True)
class SimConfig:
    """One simulation's setup. ``replica_model``: ``"fifo"`` (:class:`CostModel`,
    one request at a time) or ``"cb"`` (continuous batching under ``profile``).
    ``max_tokens``: the ``max_tokens`` every request is sent with, the only
    output length a router sees (None: the workload's longest output, which
    is the generated workloads' fixed length). ``num_routers``: independent
    routers for ours, each taking every ``num_routers``-th request."""

    num_replicas: int
    budget_tokens: int
    utilisation: float = 0.9
    cost: CostModel = field(default_factory=CostModel)
    summary_period_s: float = 1.0
    seed: int = 0
    policy: PolicyConfig = field(default_factory=PolicyConfig)  # block size/decode cost set from the workload
    replica_model: str = "fifo"
    profile: StepProfile = H100_LLAMA_8B
    max_tokens: int | None = None
    num_routers: int = 1
    decode_token_cost: float | None = None  # ours' price of an output token; None: the timing's
    summary_mode: str = "full"  # SIM_SUMMARY_MODES: "full" every block each period; "stream" snapshots + chained
    # deltas; "reference" what a live Worker sends (cache.summary_sender): deltas naming their base by a handle
    closed_loop: ClosedLoopConfig | None = None  # None: open loop at the workload's (scaled) arrival times
    fetch: FetchModel = field(default_factory=FetchModel)  # KV transfer figures for ours' fetch hints
    # The (busy, queue) token prices the replicas report as their engines' measurement; None: their cost
    # model's. sim_vs_live passes what the live Workers reported, whose engine measures its own.
    reported_token_costs: tuple[float, float] | None = None
    # The (per token, fixed) fetch costs the replicas report (CacheSummary.fetch_token_cost /
    # fetch_overhead_tokens); None: their FetchModel's. sim_vs_live passes what the live Workers reported.
    reported_fetch_costs: tuple[float, float] | None = None
    # Each replica's eviction, as the engine runs it (worker.EngineConfig.cache_protected_share): adaptive
    # segmented LRU whose protected segment for reused prefixes starts at this share of the budget; 0: plain LRU.
    cache_protected_share: float = SERVING_PROTECTED_SHARE

    def __post_init__(self) -> None:
        if type(self.num_replicas) is not int or self.num_replicas <= 0:
            raise ValueError(f"num_replicas must be a positive int, got {self.num_replicas!r}")
        if type(self.budget_tokens) is not int or self.budget_tokens <= 0:
            raise ValueError(f"budget_tokens must be a positive int, got {self.budget_tokens!r}")
        if not 0 < self.utilisation <= 10:
            raise ValueError(f"utilisation must be in (0, 10], got {self.utilisation!r}")
        if not self.summary_period_s > 0:
            raise ValueError(f"summary_period_s must be > 0, got {self.summary_period_s!r}")
        if self.replica_model not in REPLICA_MODELS:
            raise ValueError(f"replica_model must be one of {REPLICA_MODELS}, got {self.replica_model!r}")
        if self.max_tokens is not None and (type(self.max_tokens) is not int or self.max_tokens <= 0):
            raise ValueError(f"max_tokens must be None or a positive int, got {self.max_tokens!r}")
        if self.summary_mode not in SIM_SUMMARY_MODES:
            raise ValueError(f"summary_mode must be one of {SIM_SUMMARY_MODES}, got {self.summary_mode!r}")
        if type(self.num_routers) is not int or self.num_routers <= 0:
            raise ValueError(f"num_routers must be a positive int, got {self.num_routers!r}")
        if not 0.0 <= self.cache_protected_share <= 1.0:
            raise ValueError(f"cache_protected_share must be within [0, 1], got {self.cache_protected_share!r}")

    @property
    def timing(self) -> CostModel | StepProfile:
        """What prices a request's work: the FIFO cost model or the step profile."""
        return self.cost if self.replica_model == "fifo" else self.profile


REPLICA_MODELS = ("fifo", "cb")
TRACE_MAX_TOKENS = 2048  # a trace's requests carry no max_tokens; a chat default (its outputs reach 893)


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
    summary. A decision's fetch hint goes to the chosen replica as a
    :class:`SimFetch` (:meth:`take_fetch`); ``fetch=False`` (``ours_nofetch``)
    turns fetch off in the policy."""

    name = "ours"

    def __init__(self, workload: Workload, replicas: list, config: SimConfig, fetch: bool = True) -> None:
        self.now = 0.0
        self._replicas, self._fetch_model, self._fetch = replicas, config.fetch, None
        self.num_fetch_hints = 0
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

    def routing_request(self, request) -> RoutingRequest:
        """What the ingress knows: block hashes, prompt length, token ids, max_tokens."""
        token_ids = request.units if request.unit_tokens == 1 else ()  # a trace has no tokens
        return RoutingRequest(request.block_hashes, request.num_prompt_tokens,
                              num_output_tokens=self._max_tokens, token_ids=token_ids)

    def on_summary(self, summary, now: float) -> None:
        self.now = now
        for router in self.routers:
            router.on_summary(summary)

    def on_completed(self, number: int, now: float) -> None:
        self.now = now
        router = self._router_of.pop(str(number), None)
        if router is not None:
            router.on_completed(str(number))

    def choose(self, number: int, request, now: float) -> int:
        self.now = now
        router = self.routers[number % len(self.routers)]
        routing = self.routing_request(request)
        decision = router.decide(routing, request_id=str(number))
        replica_id = decision.ranked[0]
        router.on_routed(routing, replica_id, str(number))
        self._router_of[str(number)] = router
        hint = decision.fetch
        replica_of = lambda replica_id: self._replicas[self._index_of[replica_id]]  # noqa: E731
        self._fetch = None if hint is None else SimFetch(replica_of(hint.owner), hint.num_tokens, self._fetch_model,
                                                         tuple(map(replica_of, hint.alternates)))
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
    unknown = [n for n in names if n not in factories]
    if unknown:
        raise ValueError(f"unknown policies {unknown}; choose from {sorted(factories)}")
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
    for number, now in sends:
        request = workload.requests[number]
        catch_up(now)
        started = time.thread_time()  # CPU time: other processes on a shared machine do not count
        index = policy.choose(number, request, now)
        decision_us.append((time.thread_time() - started) * 1e6)
        replicas[index].submit(number, request, now, policy.take_fetch() if hears else None)
    run_to(math.inf)
    figures = replay_figures(workload, config, replicas, decision_us)
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
            "num_routers": config.num_routers,
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


def build_parser(prog: str = "python -m router.simulate", description: str | None = None) -> argparse.ArgumentParser:
    """The replay's command line (shared with :mod:`router.seed_sweep`)."""
    parser = argparse.ArgumentParser(prog=prog, description=description or __doc__.split("\n\n")[0])
    parser.add_argument("--trace", help="Mooncake-format JSONL trace")
    parser.add_argument("--workload", choices=("mooncake", "shared-prefix", "multi-turn"), default=None)
    parser.add_argument("--replicas", type=int, required=True)
    parser.add_argument("--budget-tokens", type=int, required=True)
    parser.add_argument("--json", required=True, help="output JSON path")
    parser.add_argument("--plot", help="output PNG path")
    parser.add_argument("--utilisation", type=float, default=0.9)
    parser.add_argument("--prefill-tokens-per-s", type=float, default=20_000.0)
    parser.add_argument("--decode-s-per-token", type=float, default=0.002)
    parser.add_argument("--summary-period-s", type=float, default=1.0)
    parser.add_argument("--policies", default=",".join(POLICY_NAMES))
    parser.add_argument("--limit", type=int, help="replay only the first N trace rows")
    parser.add_argument("--block-tokens", type=int, default=PolicyConfig().block_size,
                        help="router block size for generated workloads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seeds", type=int, default=1, help="run randomised baselines with seeds 0..N-1, report means")
    parser.add_argument("--workload-args", default="{}",
                        help='JSON overrides of a generated workload, e.g. {"question_tokens": 100}')
    parser.add_argument("--policy-args", default="{}",
                        help='JSON PolicyConfig overrides for ours, e.g. {"sub_block_tokens": 0}')
    parser.add_argument("--replica-model", choices=REPLICA_MODELS, default="fifo",
                        help="fifo: one request at a time (CostModel); cb: continuous batching (--profile)")
    parser.add_argument("--profile", help="step-profile JSON for --replica-model cb (default: Llama-3.1-8B on H100)")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="max_tokens of every request, all a router knows of its output "
                             "(default: 2048 for a trace, the output length for generated workloads)")
    parser.add_argument("--routers", type=int, default=1, help="independent routers for ours")
    parser.add_argument("--summary-mode", choices=SIM_SUMMARY_MODES, default="full",
                        help="full: every cached block each period; stream: snapshots + chained deltas; "
                             "reference: a live Worker's stream (deltas naming their base by an object ref)")
    parser.add_argument("--decode-token-cost", type=float, default=None,  # a prior: the replicas report theirs
                        help="ours' prior prefill-token price of an output token (default: from the cost model/"
                             "profile); the replicas' measured prices replace it unless --policy-args "
                             "'{\"learn_token_costs\": false}'")
    parser.add_argument("--arrivals", choices=("open", "closed"), default="open",
                        help="open: the workload's arrival times, scaled to --utilisation; closed: --concurrency "
                             "sessions, each sending its next request when the previous completes")
    parser.add_argument("--concurrency", type=int, default=8, help="--arrivals closed: client sessions")
    parser.add_argument("--ingress-s", type=float, default=0.0,
                        help="--arrivals closed: measured client TTFT less engine TTFT, between a completion and "
                             "the next request at the engine")
    parser.add_argument("--kv-bytes-per-token", type=int, default=FetchModel().kv_bytes_per_token,
                        help="KV bytes per token a fetch moves (default: Llama-3.1-8B bf16, 128 KiB)")
    parser.add_argument("--fetch-bandwidth-gbps", type=float, default=FetchModel().bandwidth_bytes_per_s / 1e9,
                        help="fetch bandwidth in GB/s (default 25: RDMA-class)")
    parser.add_argument("--fetch-export-fraction", type=float, default=FetchModel().export_fraction,
                        help="the owner's busy time per fetch, as a fraction of the transfer time")
    parser.add_argument("--cache-protected-share", type=float, default=SERVING_PROTECTED_SHARE,
                        help="replicas' eviction, as the engine runs it: adaptive segmented LRU whose protected "
                             "segment for reused prefixes starts at this share of the budget (0: plain LRU)")
    parser.add_argument("--no-progress", action="store_true")
    return parser


def workload_kind(args: argparse.Namespace) -> str:
    """mooncake, shared-prefix or multi-turn; ValueError when the command names none."""
    kind = args.workload or ("mooncake" if args.trace else None)
    if kind is None:
        raise ValueError("give --trace FILE or --workload")
    if kind == "mooncake" and not args.trace:
        raise ValueError("--workload mooncake needs --trace FILE")
    return kind


def build_run(args: argparse.Namespace) -> tuple[Workload, SimConfig, list[str]]:
    """The workload (generated from ``args.seed``), the simulator's config
    and the policy names a parsed command line asks for."""
    kind = workload_kind(args)
    if kind == "mooncake":
        workload = load_mooncake(args.trace, args.limit)
    elif kind == "shared-prefix":
        workload = shared_prefix(block_tokens=args.block_tokens, seed=args.seed, **json.loads(args.workload_args))
    else:
        workload = multi_turn(block_tokens=args.block_tokens, seed=args.seed, **json.loads(args.workload_args))
    config = SimConfig(
        num_replicas=args.replicas,
        budget_tokens=args.budget_tokens,
        utilisation=args.utilisation,
        cost=CostModel(args.prefill_tokens_per_s, args.decode_s_per_token),
        summary_period_s=args.summary_period_s,
        seed=args.seed,
        policy=PolicyConfig(**json.loads(args.policy_args)),
        replica_model=args.replica_model,
        profile=StepProfile.load(args.profile) if args.profile else H100_LLAMA_8B,
        max_tokens=args.max_tokens or (TRACE_MAX_TOKENS if kind == "mooncake" else None),
        num_routers=args.routers,
        decode_token_cost=args.decode_token_cost,
        summary_mode=args.summary_mode,
        closed_loop=ClosedLoopConfig(args.concurrency, ingress_s=args.ingress_s) if args.arrivals == "closed" else None,
        fetch=FetchModel(args.kv_bytes_per_token, args.fetch_bandwidth_gbps * 1e9,
                         export_fraction=args.fetch_export_fraction),
        cache_protected_share=args.cache_protected_share,
    )
    names = [n.strip() for n in args.policies.split(",") if n.strip()]
    return workload, config, names


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
