"""Load test across the replicas, and the same workload under several request
routers side by side.

    python -m harness.loadtest --url http://127.0.0.1:8000 --workload shared-prefix
    python -m harness.loadtest --compare-routers pow2,prefix_affinity,kvroute \\
        --workload shared-prefix --rounds 3 --json results/loadtest.json --plot results/loadtest.png
    python -m harness.loadtest --compare-fetch --workload hot-prefix --nodes 2 --rounds 2 \\
        --tiny-llama-shape 125m --json results/fetch.json

Every request is a streamed ``POST /generate`` so the client measures TTFT and
inter-token latency itself. ``--compare-routers`` deploys ``deploy/config.yaml``
once per router and round (``serve run --non-blocking`` with ``args.router``
replaced, fresh replicas and caches each time), warms it up with a few
unrelated requests, runs the identical workload, and shuts the app down
again; the router order rotates from round to round (whoever runs first on a
fresh cluster has an edge) and each router's requests pool over its rounds. It needs a running Ray cluster (``ray start --head``) or
starts one itself and stops it at the end. Targets 127.0.0.1 by default; every
loop is bounded in request count and wall time.

``--compare-fetch`` does the same with our router twice, the app's
``fetch_enabled`` on and off (issue 13: a replica may fetch a hot prefix's
KV from the replica holding it instead of recomputing it). ``--nodes 2``
starts a second Ray node on this machine with one Worker per node, so the
KV crosses two object stores. Every run reports, from the replicas' own
/stats counters before and after it (harness/replica_counters.py), the
prompt tokens computed, reused and fetched, and the bandwidth the workers
measured. ``--compare-summaries`` runs our router with the Workers'
``summary_mode`` stream and full (issue 14, item 5: the replicas' counters
give the summaries' bytes per message; the hit rates and TTFTs show what
streaming costs the routing). ``--compare-stream-intervals 0,50`` runs our
router with the app's ``stream_interval_ms`` at each value: tokens per
second, TTFT and inter-token gaps of streamed requests when each token is
its own message against tokens gathered for up to that long.
``--compare-arms`` takes the arms themselves as JSON (label, router, its
kwargs, app args, Ingress replicas, deployment options), e.g. one Ingress
replica against two (two independent routers, each seeing only its own
decisions and the shared summaries) with and without a policy knob::

    python -m harness.loadtest --workload multi-turn --rounds 3 --compare-arms \
        '[{"label": "1-ingress"}, {"label": "2-ingress", "ingress_replicas": 2},
          {"label": "2-ingress-peer", "ingress_replicas": 2, "router_kwargs": {"load_peer_estimate": true}}]'
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections import Counter
from dataclasses import asdict, replace

import yaml

from deploy.settings import AppConfig
from harness.loadstats import RequestRecord, request_log, summarize
from harness.loadtest_arms import (ARM_KEYS, Arm, custom_arms, fetch_arms, fetch_patience_arms, router_arms,
                                   stream_interval_arms, summary_arms, token_price_arms)
from harness.loadtest_arms import kvroute_kwargs_of  # noqa: F401 - re-exported
from harness.loadtest_client import RunOptions, run_one, warm_up
from harness.loadtest_client import STATS_SETTLE_S, fetch_stats, run_workload  # noqa: F401 - re-exported
from harness.replica_counters import pool_counters
from harness.resources import cpu_s_by_role
from harness.workloads import WORKLOADS, Session, build_workload


def _rank_replicas(records: list[RequestRecord]) -> list[RequestRecord]:
    """Replica ids → "busiest", "2nd", ... so rounds on fresh replicas pool."""
    counts = Counter(r.replica_id for r in records if r.ok)
    rank = {replica: f"rank-{i + 1}" for i, (replica, _) in enumerate(counts.most_common())}
    return [dataclasses.replace(r, replica_id=rank.get(r.replica_id, r.replica_id)) for r in records]


def cpu_ms_per_request(rounds: list[dict]) -> dict[str, float]:
    """CPU milliseconds per completed request by role (Serve's HTTP proxy, the
    Ingress, the Workers, the rest of Ray: ``harness.resources.role_of``),
    pooled over rounds that recorded ``cpu_s_by_role``; {} when none did."""
    rounds = [r for r in rounds if r.get("cpu_s_by_role") and r.get("num_ok")]
    num_ok = sum(r["num_ok"] for r in rounds)
    if not num_ok:
        return {}
    return {role: 1e3 * sum(r["cpu_s_by_role"][role] for r in rounds) / num_ok for role in rounds[0]["cpu_s_by_role"]}


def app_for(args):
    """The ServeApp every arm deploys on: ``--nodes``, the engine as the
    config has it with ``--engine-args`` and ``--tiny-llama-shape`` applied."""
    from harness.serving import ServeApp, config_engine_args

    engine_changes = json.loads(args.engine_args)
    if args.tiny_llama_shape:
        from worker.bench import MODELS  # torch: only when a shape is asked for

        engine_changes["tiny_llama"] = asdict(MODELS[args.tiny_llama_shape])
    overrides = {"engine": config_engine_args(args.config, **engine_changes)} if engine_changes else {}
    memory = args.object_store_mb * 2**20 if args.object_store_mb else None
    deployments = {"Ingress": {"num_replicas": args.ingress_replicas}} if args.ingress_replicas else {}
    return ServeApp(args.config, num_nodes=args.nodes, object_store_memory=memory, args_overrides=overrides,
                    deployment_overrides=deployments)


def compare_arms(args, options: RunOptions, sessions: list[Session], slo: dict, arms: list[Arm]) -> dict[str, dict]:
    """Each round deploys every arm in turn (fresh replicas and caches),
    rotating the order so none always goes first; records pool per arm."""
    labels = [arm.label for arm in arms]
    pooled: dict[str, list] = {label: [] for label in labels}
    per_round: dict[str, list] = {label: [] for label in labels}
    with app_for(args) as app:
        options = replace(options, url=app.url)
        num_workers = None
        for round_index in range(args.rounds):
            shift = round_index % len(arms)
            for arm in arms[shift:] + arms[:shift]:
                app.deploy(router=arm.router, router_kwargs=arm.router_kwargs, app_args=arm.app_args,
                           deployments=arm.deployments)
                warm_up(options, args.warmup_requests, args.seed)
                pids = app.ray_pids()
                cpu_before = cpu_s_by_role(pids)
                records, wall_s, stats = run_one(options, sessions, f"{arm.label} (round {round_index + 1})")
                cpu_used = {role: used - cpu_before[role] for role, used in cpu_s_by_role(pids).items()}
                num_workers = app.expected_workers()
                if args.nodes > 1:
                    stats["replica_nodes"] = app.replica_nodes()
                app.shutdown_app()
                pooled[arm.label].append((records, wall_s))
                round_summary = summarize(records, wall_s, slo, num_workers) | {"request_log": request_log(records)}
                round_summary["replica_counters"] = stats.pop("run_counters")
                round_summary["server_stats"] = stats
                round_summary["load_average"] = os.getloadavg()  # 1/5/15 min, at the round's end
                round_summary["cpu_s_by_role"] = cpu_used  # the run and the /stats reads around it
                per_round[arm.label].append(round_summary)
    results = {}
    for label in labels:
        records = [r for round_records, _ in pooled[label] for r in _rank_replicas(round_records)]
        summary = summarize(records, sum(wall for _, wall in pooled[label]), slo, num_workers)
        summary["rounds"] = per_round[label]
        summary["replica_counters"] = pool_counters([r["replica_counters"] for r in per_round[label]])
        summary["cpu_ms_per_request_by_role"] = cpu_ms_per_request(per_round[label])
        results[label] = summary
    return results


def main(argv: list[str] | None = None) -> int:
    from harness.loadreport import print_table, write_plot

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--compare-routers", default=None, help="comma list, e.g. pow2,prefix_affinity,kvroute")
    parser.add_argument("--compare-fetch", action="store_true", help="our router with fetch_enabled on and off")
    parser.add_argument("--compare-fetch-patience", action="store_true",
                        help="our router with the Workers' fetch_patience 1 (the default) and 0")
    parser.add_argument("--compare-summaries", action="store_true",
                        help="our router with the Workers' summary_mode stream and full")
    parser.add_argument("--compare-stream-intervals", default=None,
                        help="our router with the app's stream_interval_ms at each value, e.g. 0,50")
    parser.add_argument("--compare-token-prices", action="store_true",
                        help="our router with learn_token_costs on (the Workers' measured prices) and off")
    parser.add_argument("--compare-arms", default=None,
                        help='JSON list (or @file) of arms: [{"label": "1-ingress"}, {"label": "2-ingress", '
                             '"ingress_replicas": 2, "router_kwargs": {...}}, ...]; keys: ' + ", ".join(sorted(ARM_KEYS)))
    parser.add_argument("--ingress-replicas", type=int, default=None,
                        help="comparisons: Ingress replicas (each its own router) for every arm; default the config's")
    parser.add_argument("--nodes", type=int, default=1, help="comparisons: Ray nodes on this machine, one Worker each")
    parser.add_argument("--object-store-mb", type=int, default=None, help="comparisons: object store per node (MiB)")
    parser.add_argument("--engine-args", default="{}", help='comparisons: JSON engine changes, e.g. {"max_batch_tokens": 256}')
    parser.add_argument("--tiny-llama-shape", default=None, choices=["bench", "tiny", "125m"],
                        help="comparisons: the built-in random Llama's shape (worker/bench.py's MODELS)")
    parser.add_argument("--config", default="deploy/config.yaml")
    parser.add_argument("--rounds", type=int, default=3, help="--compare-routers: rounds, router order rotated")
    parser.add_argument("--warmup-requests", type=int, default=8, help="untimed requests before each run")
    parser.add_argument("--kvroute-kwargs", default=None, help="JSON request_router_kwargs for our router")
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="shared-prefix")
    parser.add_argument("--trace", default=None, help="Mooncake-format JSONL for --workload mooncake")
    parser.add_argument("--scale", default="cpu", choices=["cpu", "gpu"], help="workload size preset")
    parser.add_argument("--workload-args", default="{}", help='JSON overrides, e.g. {"num_groups": 4}')
    parser.add_argument("--mode", choices=["closed", "open"], default="closed")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rate", type=float, default=None, help="open loop: Poisson arrivals per second")
    parser.add_argument("--time-scale", type=float, default=1.0)
    parser.add_argument("--timeout-s", type=float, default=300.0)
    parser.add_argument("--max-duration-s", type=float, default=900.0)
    parser.add_argument("--slo-ttft-s", type=float, default=2.0)
    parser.add_argument("--slo-itl-s", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    parser.add_argument("--plot", default=None)
    args = parser.parse_args(argv)

    sessions = build_workload(args.workload, args.scale, json.loads(args.workload_args), args.trace, args.seed)
    options = RunOptions(args.url, args.mode, args.concurrency, args.rate, args.time_scale, args.timeout_s, args.max_duration_s)
    slo = {"ttft_s": args.slo_ttft_s, "itl_s": args.slo_itl_s}
    meta = {"workload": args.workload, "scale": args.scale, "mode": args.mode, "concurrency": args.concurrency,
            "rate_rps": args.rate, "num_sessions": len(sessions), "num_requests": sum(len(s.turns) for s in sessions),
            "options": asdict(options), "slo": slo,
            # what an arm that does not set it deploys with (router.live_arms replays it)
            "share_decisions_period_s": _config_arg(args.config, "share_decisions_period_s",
                                                    AppConfig.share_decisions_period_s)}
    flags = ("compare_routers", "compare_fetch", "compare_summaries", "compare_stream_intervals",
             "compare_token_prices", "compare_fetch_patience", "compare_arms")
    comparisons = [flag for flag in flags if getattr(args, flag)]
    if len(comparisons) > 1:
        parser.error("--compare-routers, --compare-fetch, --compare-summaries, --compare-stream-intervals, "
                     "--compare-token-prices, --compare-fetch-patience and --compare-arms are separate comparisons: "
                     "pick one")
    if args.ingress_replicas is not None and args.ingress_replicas < 1:
        parser.error(f"--ingress-replicas must be positive, got {args.ingress_replicas}")
    if comparisons:
        meta.update(rounds=args.rounds, nodes=args.nodes, engine_args=json.loads(args.engine_args),
                    tiny_llama_shape=args.tiny_llama_shape, ingress_replicas=args.ingress_replicas)
        make_arms = {"compare_routers": router_arms, "compare_fetch": fetch_arms,
                     "compare_summaries": summary_arms, "compare_stream_intervals": stream_interval_arms,
                     "compare_token_prices": token_price_arms,
                     "compare_fetch_patience": fetch_patience_arms, "compare_arms": custom_arms}[comparisons[0]]
        try:
            arms = make_arms(args)
        except ValueError as error:
            parser.error(str(error))
        meta["arms"] = [asdict(arm) for arm in arms]
        results = compare_arms(args, options, sessions, slo, arms)
    else:
        warm_up(options, args.warmup_requests, args.seed)
        records, wall_s, stats = run_one(options, sessions, "server")
        counters = stats.pop("run_counters")
        results = {"server": summarize(records, wall_s, slo) | {"server_stats": stats, "replica_counters": counters,
                                                               "request_log": request_log(records)}}
    report = {"meta": meta, "results": results}
    print_table(report)
    if args.json:
        with open(args.json, "w") as file:
            json.dump(report, file, indent=2)
    if args.plot:
        write_plot(report, args.plot)
    return 0


def _config_arg(config_path: str, name: str, default):
    """The app arg ``name`` of the config file's first application (``default`` where it sets none)."""
    with open(config_path) as file:
        return (yaml.safe_load(file)["applications"][0].get("args") or {}).get(name, default)


if __name__ == "__main__":
    sys.exit(main())
