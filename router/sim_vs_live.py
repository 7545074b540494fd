"""The simulator against the live cluster: a load-test run beside the
simulator's closed-loop replay of the same sessions, router by router.

    python -m router.sim_vs_live --live results/loadtest_shared_prefix.json \\
        [--workload-args JSON] [--trace FILE] [--profile router/profiles/tiny_llama_cpu.json] \\
        [--ingress-s measured|SECONDS] [--seeds 3] [--json OUT]

The live side is ``python -m harness.loadtest --compare-routers
kvroute,pow2,prefix_affinity --mode closed`` (its JSON: per router, the
pooled rounds). The simulated side rebuilds the identical sessions
(``harness.workloads.build_workload`` with the run's workload, scale,
overrides and seed), replays them with :mod:`router.closed_loop` at the
run's concurrency through ``--replica-model cb`` replicas under the step
profile, with the deployment's settings (2 replicas, the engine's cache
budget, 64-token routing blocks, our router with the same
:class:`PolicyConfig` the live one is built with), under ours, pow2 and
Ray's prefix-affinity rule on its own router-side tree of routed prompts, as
it runs live (``ray_prefix_tree``; the simulator's ``ray_prefix_affinity``
reads the replicas' true caches instead, which lag a queued request).

The live engines share the machine's two cores with the HTTP proxy, the
ingress, the load generator (and, on a shared machine, whatever else runs),
so a step takes longer than the profile measured on an idle core.
``--engine-slowdown measured`` (the default) takes that factor from the same
live run, from quantities the comparison does not score: the clients' mean
inter-token latency (each token is one engine step) over the mean step time
the profile gives for the steps the live engines reported (``/stats``:
steps, prefill tokens, decode tokens, summed over replicas and rounds); the
profile's times are multiplied by it. ``--step-variability measured`` also
multiplies each prefill or mixed step by a live inter-token gap over their
mean; that overstates the tail (the gaps' spread already holds the prefill
steps' own extra length, which the profile models), so it is an upper bound,
not the default.

Between the engine and the client lies the ingress (HTTP proxy, FastAPI,
tokenising, routing, the Ray call, streaming back). It is *measured* in the
live run — each response's done event carries the engine's own TTFT, and the
load test reports the client's TTFT less it (``ingress_overhead_s``) — and
``--ingress-s measured`` (the default) takes the median of the routers'
medians: the simulated requests reach the engine that long after their
session's previous one ended. A simulated client TTFT is the engine's plus
one draw from the live run's per-request overheads, every router's pooled
(the router's own cost in the ingress is not modelled: pooling keeps it out
of the comparison), or plus the median where the run did not record them.
Nothing is fitted to the live TTFTs.

A ``--compare-arms`` run (or any comparison the load test recorded its
arms for) is replayed arm by arm (:func:`live_arms`): our router with the
arm's router kwargs as :class:`PolicyConfig` changes and one independent
router per Ingress replica (``SimConfig.num_routers``: each Ingress replica
has its own request router, which sees its own decisions and every
summary); a peer as one router. An arm's app args (e.g. ``fetch_enabled``)
are printed as not modelled.

Fetches (issue 13) move KV as the live run measured it: ``--fetch
measured`` (the default) replays them with the live Workers' own transfer
model (:func:`live_fetch_model`: the served model's KV bytes per token, the
medians of each Worker's estimated bandwidth and fixed cost after its
rounds) and has the simulated Workers report the fetch costs the live ones
reported (:func:`live_fetch_costs`), so our router weighs a fetch as it did
live; ``--fetch model`` keeps the simulator's default link (Llama-3.1-8B
over 25 GB/s with 1 ms fixed), whose fixed cost is ~50 × below what the
CPU demo's Workers measure.

Compared: token hit rate (goal: within 0.02), TTFT p50 (within 25 %) and
p99 (within 40 %), and imbalance as the load test measures it (max / mean
prompt tokens per replica) and as the simulator does (max / mean busy time:
live, the union of each Worker's request spans as the client saw them,
HTTP included; simulated, the engine's steps); and whether the routers
rank alike on each.

Its parts: the arms (:mod:`router.live_arms`), the step times
(:mod:`router.live_steps`), the other measured inputs
(:mod:`router.live_measures`), the comparison (:mod:`router.live_comparison`).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from dataclasses import asdict, fields, replace

from harness.loadstats import percentile
from harness.workloads import build_workload
from router.batching import StepProfile
from router.closed_loop import ClosedLoopConfig, client_ttft
from router.live_arms import SimArm, describe_arms, live_arms
from router.live_arms import LIVE_SUMMARY_PERIOD_S, MODELLED_APP_ARGS, ROUTERS  # re-exported
from router.live_comparison import compare, live_figures, print_markdown
from router.live_comparison import GOALS, METRICS, ranking, separated_pairs  # re-exported
from router.live_measures import (ingress_by_arm, ingress_samples, live_fetch_costs, live_fetch_model,
                                  live_token_costs, measured_ingress_s)
from router.live_steps import VariableSteps, measured_slowdown, slowed, step_factors, workers_profile
from router.policy_config import PolicyConfig
from router.sim_fetch import FetchModel
from router.simulate import SimConfig, simulate
from router.workload import from_sessions

DEFAULT_PROFILE = "router/profiles/tiny_llama_cpu.json"


def simulated_figures(report: dict, profile: StepProfile, ingress_s: float | dict[str, float], *,
                      workload_args: dict, trace: str | None, seed: int, num_replicas: int, budget_tokens: int,
                      block_tokens: int, seeds: int, ingress_samples: list[float] | dict[str, list[float]] = (),
                      token_costs: tuple[float, float] | None = None,
                      arms: dict[str, SimArm] | None = None, fetch: FetchModel | None = None,
                      fetch_costs: tuple[float, float] | None = None) -> tuple[dict[str, dict], dict]:
    """Each arm (``arms``; None: :func:`live_arms` of ``report``) replayed on
    ``seeds`` seeds. ``ingress_s`` / ``ingress_samples``: one for every arm,
    or per arm label (:func:`ingress_by_arm`). ``token_costs``: the (busy, queue) prices the simulated
    replicas report (:func:`live_token_costs`: what the live Workers
    reported); None: the profile's. ``fetch``: the KV transfer of a fetch
    (:func:`live_fetch_model`; None: the simulator's default link);
    ``fetch_costs``: what the simulated replicas report a fetch costs them
    (:func:`live_fetch_costs`; None: ``fetch``'s own)."""
    meta = report["meta"]
    if meta.get("mode", "closed") != "closed":
        raise ValueError(f"the live run was {meta['mode']}-loop; this compares closed-loop runs")
    arms = live_arms(report) if arms is None else arms
    sessions = build_workload(meta["workload"], meta["scale"], workload_args, trace, seed)
    workload = from_sessions(sessions, block_tokens, meta["workload"], seed)
    if len(workload.requests) != meta["num_requests"]:
        raise ValueError(f"rebuilt {len(workload.requests)} requests, the live run sent {meta['num_requests']}: "
                         "give the run's --workload-args / --trace / --seed")
    draws = random.Random(seed)
    figures, first_runs, per_seed, setups = {}, {}, [{} for _ in range(seeds - 1)], {}
    for label, arm in arms.items():
        arm_ingress_s = ingress_s[label] if isinstance(ingress_s, dict) else ingress_s
        arm_samples = ingress_samples[label] if isinstance(ingress_samples, dict) else ingress_samples
        # what deploy/app.py builds from the arm's router kwargs
        live_policy = replace(PolicyConfig(block_size=block_tokens), **arm.policy_args)
        queue_cost = live_policy.queue_decode_token_cost
        config = SimConfig(
            num_replicas=num_replicas, budget_tokens=budget_tokens, replica_model="cb", profile=profile,
            policy=replace(live_policy, queue_decode_token_cost=queue_cost if queue_cost is not None
                           else live_policy.decode_token_cost),
            decode_token_cost=live_policy.decode_token_cost,
            closed_loop=ClosedLoopConfig(meta["concurrency"], ingress_s=arm_ingress_s,
                                         ingress_samples_s=tuple(arm_samples), seed=seed),
            reported_token_costs=token_costs, num_routers=arm.num_routers, summary_period_s=arm.summary_period_s,
            share_decisions_s=arm.share_decisions_s,
            **({"fetch": fetch} if fetch is not None else {}), reported_fetch_costs=fetch_costs,
        )
        runs = [simulate(workload, config, [arm.policy], seeds=[s]) for s in range(seed, seed + seeds)]
        setups[label] = runs[0]["setup"]
        seed_figures = [run["policies"][arm.policy] for run in runs]
        engine = sorted(t for f in seed_figures for t in f["ttft_samples_s"])  # the seeds' requests pooled
        if arm_samples:  # each request's trip through the ingress drawn from the live run's own
            client = sorted(client_ttft(t, draws.choice(arm_samples)) for t in engine)
        else:
            client = [client_ttft(t, arm_ingress_s) for t in engine]
        figures[label] = {"hit": statistics.fmean(f["hit_rate"] for f in seed_figures),
                          "imbalance": statistics.fmean(f["prompt_imbalance"] for f in seed_figures),
                          "busy_imbalance": statistics.fmean(f["load_imbalance"] for f in seed_figures),
                          "ttft_p50": percentile(client, 50), "ttft_p99": percentile(client, 99),
                          "engine_ttft_p50": percentile(engine, 50), "engine_ttft_p99": percentile(engine, 99)}
        for f in seed_figures:
            f.pop("ttft_samples_s", None)
        first_runs[label] = seed_figures[0]
        for later, f in zip(per_seed, seed_figures[1:]):
            later[label] = f
    result = {"setup": next(iter(setups.values()), None), "setups": setups, "policies": first_runs,
              "per_seed": per_seed, "arms": {label: asdict(arm) for label, arm in arms.items()}}
    return figures, result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m router.sim_vs_live", description=__doc__.split("\n\n")[0])
    parser.add_argument("--live", required=True,
                        help="JSON of python -m harness.loadtest --compare-routers (or --compare-arms: each arm's "
                             "router, router kwargs and Ingress replicas replayed)")
    parser.add_argument("--workload-args", default="{}", help="the live run's --workload-args")
    parser.add_argument("--trace", default=None, help="the live run's --trace (mooncake)")
    parser.add_argument("--seed", type=int, default=0, help="the live run's --seed")
    parser.add_argument("--profile", default=DEFAULT_PROFILE)
    parser.add_argument("--ingress-s", default="measured", help="'measured' (from the live run) or seconds")
    parser.add_argument("--engine-slowdown", default="measured",
                        help="'measured' (live mean ITL / the profile's mean step), 'workers' (the step model the live "
                             "Workers fitted to their own steps, in place of the profile's terms), or a factor (1: "
                             "the profile as is)")
    parser.add_argument("--replicas", type=int, default=2, help="deploy/config.yaml: Worker num_replicas")
    parser.add_argument("--budget-tokens", type=int, default=65536, help="deploy/config.yaml: cache_budget_tokens")
    parser.add_argument("--block-tokens", type=int, default=64, help="deploy/config.yaml: router_block_size")
    parser.add_argument("--seeds", type=int, default=3, help="pow2's random draws: seeds, figures averaged")
    parser.add_argument("--step-variability", choices=("measured", "none"), default="none",
                        help="measured: prefill/mixed steps drawn from the live inter-token gaps (when recorded; "
                             "an upper bound: the gaps' spread already holds the prefill steps' own length)")
    parser.add_argument("--token-costs", choices=("measured", "profile"), default="measured",
                        help="the token prices the simulated Workers report: the live Workers' median (when "
                             "recorded) or the profile's")
    parser.add_argument("--fetch", choices=("measured", "model"), default="measured",
                        help="the KV transfer of a fetch and the fetch costs the simulated Workers report: the live "
                             "Workers' (when recorded) or the simulator's default link")
    parser.add_argument("--policy-args", default="{}",
                        help="what-if: JSON PolicyConfig changes for our router in every arm, over the arm's own "
                             "(the live figures stay what ran)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    with open(args.live) as handle:
        report = json.load(handle)
    live = live_figures(report)
    try:
        arms = live_arms(report)
        what_if = json.loads(args.policy_args)
        unknown = set(what_if) - {f.name for f in fields(PolicyConfig)}
        if unknown:
            raise ValueError(f"--policy-args: not PolicyConfig fields: {sorted(unknown)}")
    except ValueError as error:
        parser.error(str(error))
    arms = {label: replace(arm, policy_args={**arm.policy_args, **what_if}) if arm.policy == "ours" else arm
            for label, arm in arms.items()}
    ingress_s = measured_ingress_s(live) if args.ingress_s == "measured" else float(args.ingress_s)
    arm_ingress_s, arm_samples = ingress_by_arm(report, live, arms) if args.ingress_s == "measured" else (ingress_s, ())
    profile = StepProfile.load(args.profile)
    try:
        if args.engine_slowdown == "workers":
            profile, slowdown = workers_profile(report, profile), 1.0
        else:
            slowdown = (measured_slowdown(report, profile) if args.engine_slowdown == "measured"
                        else float(args.engine_slowdown))
    except ValueError as error:
        parser.error(str(error))
    engine = slowed(profile, slowdown)
    factors = step_factors(report) if args.step_variability == "measured" else ()
    token_costs = live_token_costs(report, arms) if args.token_costs == "measured" else None
    fetch = live_fetch_model(report, arms) if args.fetch == "measured" else None
    fetch_costs = live_fetch_costs(report, arms) if args.fetch == "measured" else None
    if factors:
        engine = VariableSteps(**engine.to_dict(), factors=factors, seed=args.seed)
    sim, result = simulated_figures(report, engine, arm_ingress_s,
                                    workload_args=json.loads(args.workload_args), trace=args.trace, seed=args.seed,
                                    num_replicas=args.replicas, budget_tokens=args.budget_tokens,
                                    block_tokens=args.block_tokens, seeds=args.seeds,
                                    ingress_samples=arm_samples,
                                    token_costs=token_costs, arms=arms, fetch=fetch, fetch_costs=fetch_costs)
    comparison = compare(live, sim)
    print(f"step times: x{slowdown:.2f} {profile.name}'s"
          + (f", prefill/mixed steps varied by {len(factors)} live inter-token gaps" if factors else ", fixed"))
    print("token prices the simulated Workers report: " + (
        f"the live Workers' median, {token_costs[0]:.1f} busy / {token_costs[1]:.2f} queued" if token_costs
        else f"the profile's, {profile.decode_token_cost:.1f} busy / {profile.queue_token_cost:.2f} queued"))
    print("fetches: " + (f"the live Workers' link, {fetch.kv_bytes_per_token} B/token at "
                         f"{fetch.bandwidth_bytes_per_s / 1e6:.1f} MB/s + {fetch.latency_s * 1e3:.1f} ms" if fetch
                         else "the simulator's default link")
          + (f"; reported costs {fetch_costs[0]:.3g} per token + {fetch_costs[1]:.3g}" if fetch_costs else ""))
    per_arm_ingress = arm_ingress_s if isinstance(arm_ingress_s, dict) else None
    for line in describe_arms(report, arms, per_arm_ingress):
        print(line)
    print_markdown(report["meta"]["workload"], comparison, ingress_s, slowdown,
                   drawn=args.ingress_s == "measured" and bool(ingress_samples(report)))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"ingress_s": ingress_s, "ingress_s_by_arm": arm_ingress_s if isinstance(arm_ingress_s, dict)
                       else None, "engine_slowdown": slowdown, "profile": args.profile,
                       "step_profile": StepProfile.to_dict(engine),
                       "token_costs": token_costs,
                       "fetch_model": asdict(fetch) if fetch else None, "fetch_costs": fetch_costs,
                       "step_variability": bool(factors), "comparison": comparison,
                       "simulated": result, "live_meta": report["meta"]}, handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
