"""Replay a workload through every routing policy on simulated replicas.

    python -m router.simulate --trace FILE --replicas N --budget-tokens B --json OUT [--plot PNG]
    python -m router.simulate --workload shared-prefix|multi-turn --replicas N --budget-tokens B --json OUT

Cost model: :class:`router.cluster.CostModel` (prefill time ∝ tokens
computed, a decode time per output token, one FIFO queue per replica).
Arrivals are rescaled so round robin with no cache hits would keep the
replicas ``--utilisation`` busy: ``factor = no-hit work / (N × utilisation ×
trace span)``. Writes ``{"global_lru_hit_rate", "infinite_hit_rate",
"policies": {NAME: {"hit_rate", "load_imbalance", "ttft_p50_s",
"ttft_p99_s", ...}}, "setup": {...}}``. Hit rates count prompt tokens.
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import sys
import time
from dataclasses import asdict, dataclass, field, replace

from cache import RadixCache
from router.baselines import DynamoKV, LlmdScorers, PowerOfTwo, RayPrefixAffinity, RoundRobin, SGLangCacheAware
from router.cluster import CostModel, SimReplica
from router.policy import PolicyConfig, PrefixAffinityPolicy
from router.request import RoutingRequest
from router.workload import Workload, load_mooncake, multi_turn, scale_arrivals, shared_prefix

POLICY_NAMES = ("ours", "round_robin", "pow2", "ray_prefix_affinity", "sglang_cache_aware", "dynamo_kv", "llm_d")


@dataclass(frozen=True, slots=True)
class SimConfig:
    num_replicas: int
    budget_tokens: int
    utilisation: float = 0.9
    cost: CostModel = field(default_factory=CostModel)
    summary_period_s: float = 1.0
    seed: int = 0
    policy: PolicyConfig = field(default_factory=PolicyConfig)  # block size/decode cost set from the workload

    def __post_init__(self) -> None:
        if type(self.num_replicas) is not int or self.num_replicas <= 0:
            raise ValueError(f"num_replicas must be a positive int, got {self.num_replicas!r}")
        if type(self.budget_tokens) is not int or self.budget_tokens <= 0:
            raise ValueError(f"budget_tokens must be a positive int, got {self.budget_tokens!r}")
        if not 0 < self.utilisation <= 10:
            raise ValueError(f"utilisation must be in (0, 10], got {self.utilisation!r}")
        if not self.summary_period_s > 0:
            raise ValueError(f"summary_period_s must be > 0, got {self.summary_period_s!r}")


class Ours:
    """:class:`PrefixAffinityPolicy` driven as a router would: it learns from
    its own decisions, hears completions when they happen and a summary from
    every replica each ``summary_period_s``; it never reads a replica's cache."""

    name = "ours"

    def __init__(self, workload: Workload, replicas: list[SimReplica], config: SimConfig) -> None:
        self.now = 0.0
        policy_config = replace(
            config.policy, block_size=workload.router_block_tokens, decode_token_cost=config.cost.decode_token_cost
        )
        self.policy = PrefixAffinityPolicy(policy_config, clock=lambda: self.now)
        self.policy.set_replicas(r.replica_id for r in replicas)
        self._index_of = {r.replica_id: i for i, r in enumerate(replicas)}
        self._workload, self._replicas = workload, replicas
        self._period_s = config.summary_period_s
        self._next_summary_s = workload.requests[0].arrival_s if workload.requests else 0.0
        self._version = 0
        self._completions: list[tuple[float, str]] = []
        self._routing = {id(r): _routing_request(r) for r in workload.requests}

    def advance(self, now: float) -> None:
        while self._completions and self._completions[0][0] <= now:
            finish_s, request_id = heapq.heappop(self._completions)
            self.now = finish_s
            self.policy.on_completed(request_id)
        while self._next_summary_s <= now:
            self.now = self._next_summary_s
            self._version += 1
            for replica in self._replicas:
                summary = replica.summary(
                    self._version, self.now, self._workload.unit_tokens, self._workload.units_per_block)
                self.policy.on_summary(summary)
            self._next_summary_s += self._period_s
        self.now = now

    def choose(self, request, replicas, now: float) -> int:
        ranked = self.policy.rank(self._routing[id(request)])
        return self._index_of[ranked[0]]

    def on_served(self, number: int, request, replica: int, finish_s: float) -> None:
        request_id = str(number)
        self.policy.on_routed(self._routing[id(request)], self._replicas[replica].replica_id, request_id)
        heapq.heappush(self._completions, (finish_s, request_id))


def _routing_request(request) -> RoutingRequest:
    token_ids = request.units if request.unit_tokens == 1 else ()  # a trace has no tokens
    return RoutingRequest(request.block_hashes, request.num_prompt_tokens,
                          num_output_tokens=request.num_output_tokens, token_ids=token_ids)


def _percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    position = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[position]


def make_policies(names, workload: Workload, replicas: list[SimReplica], config: SimConfig):
    rng = random.Random(config.seed)
    factories = {
        "ours": lambda: Ours(workload, replicas, config),
        "round_robin": RoundRobin,
        "pow2": lambda: PowerOfTwo(rng),
        "ray_prefix_affinity": RayPrefixAffinity,
        "sglang_cache_aware": SGLangCacheAware,
        "dynamo_kv": lambda: DynamoKV(workload.router_block_tokens, rng),
        "llm_d": lambda: LlmdScorers(rng),
    }
    unknown = [n for n in names if n not in factories]
    if unknown:
        raise ValueError(f"unknown policies {unknown}; choose from {sorted(factories)}")
    return [factories[n]() for n in names]


def replay(workload: Workload, config: SimConfig, name: str, progress: bool = False) -> dict:
    """Run one policy over ``workload`` (already scaled); returns its figures."""
    budget_units = config.budget_tokens // workload.unit_tokens
    replicas = [SimReplica(f"replica-{i}", budget_units, config.cost) for i in range(config.num_replicas)]
    (policy,) = make_policies([name], workload, replicas, config)
    advance = getattr(policy, "advance", None)
    on_served = getattr(policy, "on_served", None)
    cached_total = prompt_total = num_hits = 0
    ttfts, waits, decision_us = [], [], []
    requests = workload.requests
    if progress:
        from tqdm import tqdm
        requests = tqdm(requests, desc=f"{name:>20}", unit="req", leave=False, file=sys.stderr)
    for number, request in enumerate(requests):
        now = request.arrival_s
        if advance is not None:
            advance(now)
        started = time.perf_counter()
        index = policy.choose(request, replicas, now)
        decision_s = time.perf_counter() - started
        served = replicas[index].serve(request, now)
        if on_served is not None:
            started = time.perf_counter()
            on_served(number, request, index, served.finish_s)
            decision_s += time.perf_counter() - started
        decision_us.append(decision_s * 1e6)
        cached_total += served.cached_tokens
        prompt_total += request.num_prompt_tokens
        num_hits += served.cached_tokens > 0
        ttfts.append(served.ttft_s)
        waits.append(served.ttft_s - (request.num_prompt_tokens - served.cached_tokens) / config.cost.prefill_tokens_per_s)
    ttfts.sort()
    waits.sort()
    decision_us.sort()
    busy = [r.busy_s for r in replicas]
    mean_busy = sum(busy) / len(busy)
    return {
        "hit_rate": cached_total / max(prompt_total, 1),
        "request_hit_rate": num_hits / max(len(ttfts), 1),
        "load_imbalance": max(busy) / mean_busy if mean_busy > 0 else 1.0,
        "ttft_p50_s": _percentile(ttfts, 0.50),
        "ttft_p99_s": _percentile(ttfts, 0.99),
        "ttft_mean_s": sum(ttfts) / max(len(ttfts), 1),
        "wait_p99_s": _percentile(waits, 0.99),
        "decision_us_p50": _percentile(decision_us, 0.50),
        "decision_us_p99": _percentile(decision_us, 0.99),
        "busy_s": busy,
    }


def cache_bound(workload: Workload, budget_units: int | None, cost: CostModel) -> tuple[float, float]:
    """One LRU radix cache of ``budget_units`` (None: unbounded) seeing every
    request: ``(token hit rate, p99 of the prefill time it leaves)``. With an
    unbounded cache the second is a floor under any policy's TTFT p99: each
    request's TTFT is at least its own prefill of what no cache could hold."""
    if budget_units is None:
        budget_units = sum(len(r.cache_units) for r in workload.requests) + 1
    radix = RadixCache(budget_units, block_size=1)
    cached = total = 0
    prefill_s = []
    for request in workload.requests:
        hit = request.cached_tokens(radix.match(request.units).num_tokens)
        cached += hit
        total += request.num_prompt_tokens
        prefill_s.append((request.num_prompt_tokens - hit) / cost.prefill_tokens_per_s)
        radix.insert(request.cache_units)
    prefill_s.sort()
    return cached / max(total, 1), _percentile(prefill_s, 0.99)


def cache_bound_hit_rate(workload: Workload, budget_units: int | None) -> float:
    return cache_bound(workload, budget_units, CostModel())[0]


def arrival_scale(workload: Workload, config: SimConfig) -> float:
    """Factor that makes no-hit round robin run at ``config.utilisation``."""
    requests = workload.requests
    work_s = sum(config.cost.service_s(r.num_prompt_tokens, r.num_output_tokens) for r in requests)
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
    factor = arrival_scale(workload, config)
    scaled = scale_arrivals(workload, factor)
    budget_units = config.budget_tokens // workload.unit_tokens
    infinite_hit_rate, ttft_floor_s = cache_bound(scaled, None, config.cost)
    result = {
        "global_lru_hit_rate": cache_bound_hit_rate(scaled, budget_units * config.num_replicas),
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
            "router_block_tokens": workload.router_block_tokens,
            "policy_config": asdict(config.policy),
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


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["policies"])
    figures = result["policies"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    positions = range(len(names))
    axes[0].bar(positions, [figures[n]["hit_rate"] for n in names], color="tab:blue")
    axes[0].axhline(result["global_lru_hit_rate"], color="tab:green", ls="--", label="global LRU")
    axes[0].axhline(result["infinite_hit_rate"], color="tab:gray", ls=":", label="infinite cache")
    axes[0].set_title("token hit rate")
    axes[0].legend(loc="lower right")
    width = 0.4
    axes[1].bar([p - width / 2 for p in positions], [figures[n]["ttft_p50_s"] for n in names], width, label="p50")
    axes[1].bar([p + width / 2 for p in positions], [figures[n]["ttft_p99_s"] for n in names], width, label="p99")
    if "ttft_p99_floor_s" in result:
        axes[1].axhline(result["ttft_p99_floor_s"], color="tab:red", ls="--", label="p99 floor (any policy)")
    axes[1].set_yscale("log")
    axes[1].set_title("TTFT (s)")
    axes[1].legend()
    axes[2].bar(positions, [figures[n]["load_imbalance"] for n in names], color="tab:orange")
    axes[2].axhline(1.10, color="tab:red", ls="--", label="goal 1.10")
    axes[2].set_ylim(bottom=1.0)
    axes[2].set_title("load imbalance (max / mean work)")
    axes[2].legend()
    for axis in axes:
        axis.set_xticks(list(positions))
        axis.set_xticklabels(names, rotation=35, ha="right", fontsize=8)
    setup = result["setup"]
    fig.suptitle(
        f"{setup['workload']}: {setup['num_replicas']} replicas × {setup['budget_tokens']:,} tokens, "
        f"prefill {setup['prefill_tokens_per_s']:,.0f} tok/s, decode {setup['decode_s_per_token']} s/token, "
        f"no-hit utilisation {setup['utilisation']}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m router.simulate", description=__doc__.split("\n\n")[0])
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
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    kind = args.workload or ("mooncake" if args.trace else None)
    if kind is None:
        parser.error("give --trace FILE or --workload")
    if kind == "mooncake":
        if not args.trace:
            parser.error("--workload mooncake needs --trace FILE")
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
    )
    names = [n.strip() for n in args.policies.split(",") if n.strip()]
    seeds = range(args.seed, args.seed + args.seeds)
    result = simulate(workload, config, names, progress=not args.no_progress, seeds=seeds)
    with open(args.json, "w") as handle:
        json.dump(result, handle, indent=2)
    if args.plot:
        plot(result, args.plot)
    print(f"global LRU hit rate {result['global_lru_hit_rate']:.4f}, infinite {result['infinite_hit_rate']:.4f}, "
          f"TTFT p99 floor {result['ttft_p99_floor_s']:.3f} s")
    print(f"{'policy':>20} {'hit':>7} {'imbal':>6} {'p50 s':>7} {'p99 s':>7} {'wait p99':>8} {'dec p99 us':>10}")
    for name, f in result["policies"].items():
        print(f"{name:>20} {f['hit_rate']:7.4f} {f['load_imbalance']:6.3f} {f['ttft_p50_s']:7.3f}"
              f" {f['ttft_p99_s']:7.3f} {f['wait_p99_s']:8.3f} {f['decision_us_p99']:10.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
