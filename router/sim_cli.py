"""Replay a workload through every routing policy on simulated replicas.

The command line of that replay (``python -m router.simulate``; the line
above is its ``--help`` description, which :func:`build_parser` reads),
shared with :mod:`router.seed_sweep`: its flags, and the workload,
:class:`SimConfig` and policy names a parsed command line asks for;
:mod:`router.simulate` runs them.
"""

from __future__ import annotations

import argparse
import json

from cache.segmented_lru import SERVING_PROTECTED_SHARE
from router.batching import H100_LLAMA_8B, StepProfile
from router.closed_loop import ClosedLoopConfig
from router.cluster import CostModel
from router.policy_config import PolicyConfig
from router.sim_config import (POLICY_NAMES, REPLICA_MODELS, SIM_SUMMARY_MODES, TRACE_MAX_TOKENS, SimConfig,
                               check_policy_names)
from router.sim_fetch import FetchModel
from router.workload import Workload, load_mooncake, multi_turn, shared_prefix


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
    parser.add_argument("--share-decisions-s", type=float, default=None,
                        help="with several routers, each books the others' decisions this many seconds later "
                             "(the live Ingresses' share_decisions_period_s); default: none shared")
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
        num_routers=args.routers, share_decisions_s=args.share_decisions_s,
        decode_token_cost=args.decode_token_cost,
        summary_mode=args.summary_mode,
        closed_loop=ClosedLoopConfig(args.concurrency, ingress_s=args.ingress_s) if args.arrivals == "closed" else None,
        fetch=FetchModel(args.kv_bytes_per_token, args.fetch_bandwidth_gbps * 1e9,
                         export_fraction=args.fetch_export_fraction),
        cache_protected_share=args.cache_protected_share,
    )
    names = [n.strip() for n in args.policies.split(",") if n.strip()]
    check_policy_names(names)  # before any replay starts, not after the first policy's
    return workload, config, names
