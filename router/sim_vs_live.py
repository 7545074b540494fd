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
prompt tokens per replica); and whether the routers rank alike on each.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from dataclasses import asdict, dataclass, field, fields, replace

from harness.loadstats import percentile
from harness.workloads import build_workload
from router.batching import StepProfile
from router.closed_loop import ClosedLoopConfig, client_ttft
from router.policy_config import PolicyConfig
from router.sim_fetch import FetchModel
from router.simulate import SimConfig, simulate
from router.workload import from_sessions

ROUTERS = {"kvroute": "ours", "pow2": "pow2", "prefix_affinity": "ray_prefix_tree"}  # live name -> simulated
GOALS = {"hit": 0.02, "ttft_p50": 0.25, "ttft_p99": 0.40}  # absolute; relative; relative
DEFAULT_PROFILE = "router/profiles/tiny_llama_cpu.json"
LIVE_SUMMARY_PERIOD_S = 1.0  # deploy/config.yaml's routing_stats_period_s, for an arm that does not set it
MODELLED_APP_ARGS = frozenset({"routing_stats_period_s"})  # the app args an arm's replay follows


@dataclass(frozen=True)
class SimArm:
    """How the replay runs one live arm: the simulated ``policy``, the arm's
    ``ingress_replicas`` (each with its own request router, so our policy
    runs as that many independent routers: :attr:`num_routers`; a peer is
    replayed as one), ``policy_args``, the arm's router kwargs (ours only),
    and ``summary_period_s``, the arm's ``routing_stats_period_s`` (how often
    the routers hear the Workers' summaries)."""

    policy: str
    ingress_replicas: int = 1
    policy_args: dict = field(default_factory=dict)
    summary_period_s: float = LIVE_SUMMARY_PERIOD_S

    @property
    def num_routers(self) -> int:
        return self.ingress_replicas if self.policy == "ours" else 1


def live_arms(report: dict) -> dict[str, SimArm]:
    """Each live arm's :class:`SimArm`, by label: from the load test's
    recorded arms (``meta["arms"]``; router, router kwargs, Ingress replicas
    from its deployment options or ``--ingress-replicas``), or, for a run
    that recorded none, from its labels read as router names. ValueError for
    a router the simulator has no counterpart of."""
    meta = report["meta"]
    specs = meta.get("arms") or [{"label": label, "router": label} for label in report["results"]]
    default_ingress = meta.get("ingress_replicas") or 1
    arms = {}
    for spec in specs:
        label, router = spec["label"], spec.get("router", spec["label"])
        if router not in ROUTERS:
            raise ValueError(f"arm {label!r}: router {router!r} has no simulated counterpart ({sorted(ROUTERS)})")
        ingress = ((spec.get("deployments") or {}).get("Ingress") or {}).get("num_replicas", default_ingress)
        kwargs = dict(spec.get("router_kwargs") or {}) if router == "kvroute" else {}
        period_s = (spec.get("app_args") or {}).get("routing_stats_period_s", LIVE_SUMMARY_PERIOD_S)
        arms[label] = SimArm(ROUTERS[router], int(ingress), kwargs, float(period_s))
    return arms


def live_figures(report: dict) -> dict[str, dict]:
    """Per live router: hit rate, TTFT p50/p99, imbalance, and the measured ingress and engine TTFTs."""
    figures = {}
    for router, result in report["results"].items():
        figures[router] = {
            "hit": result["cluster_hit_rate"],
            "ttft_p50": result["ttft_s"]["p50"],
            "ttft_p99": result["ttft_s"]["p99"],
            "imbalance": result["load_imbalance"],
            "ingress_p50": (result.get("ingress_overhead_s") or {}).get("p50"),
            "engine_ttft_p50": (result.get("server_ttft_s") or {}).get("p50"),
            "engine_ttft_p99": (result.get("server_ttft_s") or {}).get("p99"),
            "ttft_p99_rounds": _median_of_rounds(result, "ttft_s"),
            "engine_ttft_p99_rounds": _median_of_rounds(result, "server_ttft_s"),
            "load_average": [r.get("load_average") for r in result.get("rounds", [])],
            "rounds": {key: [v for v in (_round_value(r, key) for r in result.get("rounds", [])) if v is not None]
                       for key, *_ in METRICS},
        }
    return figures


def _round_value(round_: dict, key: str) -> float | None:
    """One round's value of a compared figure (its p99 stands for the pooled and the median-round p99)."""
    picks = {"hit": ("cluster_hit_rate", None), "imbalance": ("load_imbalance", None),
             "ttft_p50": ("ttft_s", "p50"), "ttft_p99": ("ttft_s", "p99"), "ttft_p99_rounds": ("ttft_s", "p99"),
             "engine_ttft_p50": ("server_ttft_s", "p50"), "engine_ttft_p99_rounds": ("server_ttft_s", "p99")}
    name, quantile = picks[key]
    value = round_.get(name)
    return value.get(quantile) if quantile and isinstance(value, dict) else value


def _median_of_rounds(result: dict, key: str) -> float | None:
    """The median over rounds of each round's p99 (a stall in one round moves the pooled p99 alone)."""
    values = [r[key]["p99"] for r in result.get("rounds", []) if (r.get(key) or {}).get("p99") is not None]
    return statistics.median(values) if values else None


def measured_slowdown(report: dict, profile: StepProfile) -> float:
    """Live mean inter-token latency / the profile's mean step for the steps the live engines ran."""
    itl_sum = itl_count = steps = prefill = decode = 0
    for result in report["results"].values():
        for round_ in result.get("rounds", []):
            if round_["itl_s"]["mean"] is None:
                continue
            num_itl = round_["output_tokens_per_s"] * round_["wall_s"] - round_["num_ok"]  # gaps: tokens - 1 each
            itl_sum += round_["itl_s"]["mean"] * num_itl
            itl_count += num_itl
            for replica in round_["server_stats"].get("replicas", {}).values():
                steps += replica["num_steps"]
                prefill += replica["prefill_tokens"]
                decode += replica["decode_tokens"]
    if not steps or not itl_count:
        raise ValueError("the live run has no inter-token latencies or engine step counts; give --engine-slowdown")
    profile_step_s = (steps * profile.base_s + prefill * profile.prefill_token_s
                      + decode * profile.decode_seq_s) / steps
    return (itl_sum / itl_count) / profile_step_s


@dataclass(frozen=True)
class VariableSteps(StepProfile):
    """A profile whose prefill and mixed steps (the ones a request's first
    token comes from) each take a factor drawn from ``factors`` (mean 1) times
    the profile's time; decode-only runs, taken in closed form, keep the mean.
    The factors are the live run's inter-token gaps over their mean: how
    unevenly the shared machine lets an engine step (a stall of another
    process lands on whichever step runs then)."""

    factors: tuple[float, ...] = (1.0,)
    seed: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.factors or min(self.factors) < 0:
            raise ValueError("factors must be a non-empty tuple of numbers >= 0")
        object.__setattr__(self, "_draws", random.Random(self.seed))

    def step_s(self, num_prefill_tokens: int, num_decode_seqs: int, num_context_tokens: int) -> float:
        return super().step_s(num_prefill_tokens, num_decode_seqs, num_context_tokens) * self._draws.choice(self.factors)


def workers_profile(report: dict, profile: StepProfile) -> StepProfile:
    """``profile`` with the step model the live Workers fitted to their own
    steps in the run (``worker.step_costs``; medians over every arm's rounds
    and Workers of what ``/stats`` reports: ``prefill_s_per_token`` = the
    per-token term, ``queue_token_cost`` x it = the per-sequence term,
    ``decode_token_cost - queue_token_cost`` x it = the base), keeping its
    context term and limits. Measured from the engines' step timings under
    the run's own contention, not from the compared TTFTs; ValueError when no
    Worker reported both prices (an older load test, too few steps)."""
    rows = [stats for result in report["results"].values() for round_ in result.get("rounds", ())
            for stats in round_.get("server_stats", {}).get("replicas", {}).values()
            if stats.get("decode_token_cost", 0.0) > 0 and (stats.get("prefill_s_per_token") or 0.0) > 0]
    if not rows:
        raise ValueError("the live run's Workers reported no fitted step prices; use --engine-slowdown")
    per_token = statistics.median(r["prefill_s_per_token"] for r in rows)
    busy = statistics.median(r["decode_token_cost"] for r in rows)
    queue = statistics.median(r.get("queue_token_cost", 0.0) for r in rows)
    return replace(profile, base_s=max(busy - queue, 0.0) * per_token, prefill_token_s=per_token,
                   decode_seq_s=queue * per_token, name=f"{profile.name}, the live Workers' own step fit")


def step_factors(report: dict) -> tuple[float, ...]:
    """The live inter-token gaps over their mean, every router pooled (empty: not recorded)."""
    gaps = [x for result in report["results"].values() for x in result.get("itl_samples_s", ())]
    if not gaps:
        return ()
    mean = statistics.fmean(gaps)
    return tuple(x / mean for x in gaps)


def slowed(profile: StepProfile, factor: float) -> StepProfile:
    """``profile`` with every time ``factor`` times longer (limits unchanged)."""
    if not factor > 0:
        raise ValueError(f"slowdown must be > 0, got {factor!r}")
    return replace(profile, base_s=profile.base_s * factor, prefill_token_s=profile.prefill_token_s * factor,
                   decode_seq_s=profile.decode_seq_s * factor, context_token_s=profile.context_token_s * factor,
                   name=f"{profile.name} x{factor:.2f}")


def ingress_samples(report: dict) -> list[float]:
    """Every live request's client TTFT less the engine's, all routers pooled (empty: not recorded)."""
    return sorted(x for result in report["results"].values() for x in result.get("ingress_overhead_samples_s", ()))


def _our_rounds(report: dict, arms: dict[str, SimArm] | None) -> list[dict]:
    """Every round of the arms our router ran (``arms`` None: the one labelled kvroute)."""
    ours = [label for label, arm in arms.items() if arm.policy == "ours"] if arms is not None else ["kvroute"]
    return [round_ for label in ours for round_ in report["results"].get(label, {}).get("rounds", ())]


def live_token_costs(report: dict, arms: dict[str, SimArm] | None = None) -> tuple[float, float] | None:
    """The (busy, queue) token prices our router learned live: the median over
    every round's Workers of the prices they reported in ``/stats`` (with
    ``decode_token_cost`` > 0: measured), in the arms our router ran
    (``arms``: :func:`live_arms`; None: the one labelled kvroute). The live
    router took the median of its Workers' reports, so the simulated replicas
    report this instead of the profile's prices (the profile was calibrated
    on cold single-chunk prompts, the Workers measure what they serve). None
    when the run recorded none (an older load test)."""
    reports = [(stats["decode_token_cost"], stats.get("queue_token_cost", 0.0))
               for round_figures in _our_rounds(report, arms)
               for stats in round_figures.get("server_stats", {}).get("replicas", {}).values()
               if stats.get("decode_token_cost", 0.0) > 0]
    if not reports:
        return None
    return statistics.median(d for d, _ in reports), statistics.median(q for _, q in reports)


def live_fetch_model(report: dict, arms: dict[str, SimArm] | None = None) -> FetchModel | None:
    """The KV transfer the live Workers measured, as the replay's
    :class:`FetchModel`: the served model's ``kv_bytes_per_token`` (the
    engines' ``/stats``; else the run's fetched bytes over fetched tokens),
    and the medians over our arms' rounds and Workers of each Worker's
    transfer model after the round (``estimated_bandwidth_bytes_per_s`` and
    ``estimated_overhead_s``: its start-up probe, refined by the fetches it
    made). The owner's export share stays the model's default. None when
    the run recorded no bandwidth or no bytes per token (an older load
    test, fetch off)."""
    rounds = _our_rounds(report, arms)
    per_token = [stats["kv_bytes_per_token"] for round_ in rounds
                 for stats in round_.get("server_stats", {}).get("replicas", {}).values()
                 if isinstance(stats.get("kv_bytes_per_token"), int) and stats["kv_bytes_per_token"] > 0]
    counters = [round_.get("replica_counters") or {} for round_ in rounds]
    if not per_token:
        fetched = [(c["fetched_bytes"], c["fetched_tokens"]) for c in counters
                   if c.get("fetched_bytes") and c.get("fetched_tokens")]
        per_token = [round(sum(b for b, _ in fetched) / sum(t for _, t in fetched))] if fetched else []
    bandwidths = [v for c in counters for v in (c.get("estimated_bandwidth_bytes_per_s") or {}).values() if v > 0]
    overheads = [v for c in counters for v in (c.get("estimated_overhead_s") or {}).values() if v >= 0]
    if not per_token or not bandwidths:
        return None
    return FetchModel(int(statistics.median(per_token)), float(statistics.median(bandwidths)),
                      latency_s=float(statistics.median(overheads)) if overheads else FetchModel().latency_s)


def live_fetch_costs(report: dict, arms: dict[str, SimArm] | None = None) -> tuple[float, float] | None:
    """The fetch costs our router heard live (``CacheSummary.fetch_token_cost``
    / ``fetch_overhead_tokens``, prefill tokens per fetched token and fixed):
    the medians over our arms' rounds and Workers of what each reported
    (``replica_counters["reported_fetch_costs"]``). None when none was
    recorded."""
    reports = [cost for round_ in _our_rounds(report, arms)
               for cost in ((round_.get("replica_counters") or {}).get("reported_fetch_costs") or {}).values()]
    if not reports:
        return None
    return float(statistics.median(c[0] for c in reports)), float(statistics.median(c[1] for c in reports))


def measured_ingress_s(live: dict[str, dict]) -> float:
    """Median over routers of the median client-less-engine TTFT; ValueError if the run did not record it."""
    values = [f["ingress_p50"] for f in live.values() if f["ingress_p50"] is not None]
    if not values:
        raise ValueError("the live run has no ingress_overhead_s (an older load test); give --ingress-s SECONDS")
    return statistics.median(values)


def ingress_by_arm(report: dict, live: dict[str, dict],
                   arms: dict[str, SimArm]) -> tuple[dict[str, float], dict[str, list[float]]]:
    """Per arm, the measured ingress time (:func:`measured_ingress_s`) and
    per-request samples (:func:`ingress_samples`), pooled over the arms with
    as many Ingress replicas: pooling keeps each router's own cost out of the
    comparison, but a second Ingress replica is capacity the arm really had.
    With one Ingress count in the run, every arm gets the whole run's."""
    groups: dict[int, list[str]] = {}
    for label, arm in arms.items():
        groups.setdefault(arm.ingress_replicas, []).append(label)
    seconds, samples = {}, {}
    for labels in groups.values():
        group_s = measured_ingress_s({label: live[label] for label in labels if label in live})
        group_samples = ingress_samples({"results": {label: report["results"].get(label, {}) for label in labels}})
        for label in labels:
            seconds[label], samples[label] = group_s, group_samples
    return seconds, samples


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
            closed_loop=ClosedLoopConfig(meta["concurrency"], ingress_s=arm_ingress_s),
            reported_token_costs=token_costs, num_routers=arm.num_routers, summary_period_s=arm.summary_period_s,
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


def ranking(figures: dict[str, dict], key: str) -> list[str]:
    """Routers best first: higher hit rate, lower TTFT and imbalance."""
    sign = -1 if key == "hit" else 1
    return sorted(figures, key=lambda r: sign * figures[r][key])


# (figure, label, goal kind, goal): "abs" = |sim - live| <= goal; "rel" = |sim / live - 1| <= goal
METRICS = (
    ("hit", "hit rate", "abs", GOALS["hit"]),
    ("ttft_p50", "TTFT p50 s", "rel", GOALS["ttft_p50"]),
    ("ttft_p99", "TTFT p99 s", "rel", GOALS["ttft_p99"]),
    ("ttft_p99_rounds", "TTFT p99 s, median round", "rel", GOALS["ttft_p99"]),
    ("engine_ttft_p50", "engine TTFT p50 s", "rel", GOALS["ttft_p50"]),
    ("engine_ttft_p99_rounds", "engine TTFT p99 s, median round", "rel", GOALS["ttft_p99"]),
    ("imbalance", "imbalance", None, None),
)


def compare(live: dict[str, dict], sim: dict[str, dict]) -> dict:
    """Per arm (the labels both sides have) and figure: live, sim, the
    difference or ratio, whether the goal is met; and the rankings. A
    simulated run has no rounds: its p99 stands beside both the live pooled
    p99 and the median round's."""
    labels = [label for label in live if label in sim]
    rows = {}
    for label in labels:
        lv, sm = live[label], dict(sim[label])
        sm.setdefault("ttft_p99_rounds", sm["ttft_p99"])
        sm.setdefault("engine_ttft_p99_rounds", sm.get("engine_ttft_p99"))
        row = {}
        for key, _, kind, goal in METRICS:
            if lv.get(key) is None or sm.get(key) is None:
                continue
            cell = {"live": lv[key], "sim": sm[key]}
            if kind == "abs":
                cell["diff"] = sm[key] - lv[key]
                cell["met"] = abs(cell["diff"]) <= goal
            elif kind == "rel":
                cell["ratio"] = sm[key] / lv[key]
                cell["met"] = abs(cell["ratio"] - 1) <= goal
            row[key] = cell
        rows[label] = row
    keys = [key for key, *_ in METRICS if all(key in rows[r] for r in labels)]
    ranks = {}
    for key in keys:
        ranks[key] = {"live": ranking({r: {key: rows[r][key]["live"]} for r in labels}, key),
                      "sim": ranking({r: {key: rows[r][key]["sim"]} for r in labels}, key)}
        ranks[key]["same"] = ranks[key]["live"] == ranks[key]["sim"]
        separated = separated_pairs({r: live[r].get("rounds", {}).get(key, []) for r in labels}, key)
        sim_better = (lambda a, b: a > b) if key == "hit" else (lambda a, b: a < b)
        ranks[key]["separated"] = separated
        ranks[key]["contradicted"] = [(a, b) for a, b in separated
                                      if not sim_better(rows[a][key]["sim"], rows[b][key]["sim"])]
    return {"rows": rows, "rankings": ranks}


def separated_pairs(live_rounds: dict[str, list[float]], key: str) -> list[tuple[str, str]]:
    """``(a, b)`` where the live run orders a before b beyond its own noise:
    every round of a better than every round of b. Pairs whose rounds
    overlap are ties the live run does not rank; the simulator must keep the
    order of the separated pairs (a pair it ties or reverses is contradicted)."""
    better = (lambda a, b: a > b) if key == "hit" else (lambda a, b: a < b)
    out = []
    for a in live_rounds:
        for b in live_rounds:
            if a == b or not live_rounds[a] or not live_rounds[b]:
                continue
            worst_a = min(live_rounds[a]) if key == "hit" else max(live_rounds[a])
            best_b = max(live_rounds[b]) if key == "hit" else min(live_rounds[b])
            if better(worst_a, best_b):
                out.append((a, b))
    return out


def describe_arms(report: dict, arms: dict[str, SimArm], ingress_s: dict[str, float] | None) -> list[str]:
    """One line per arm: what the replay runs for it, the app args it does not
    model, and its ingress time where the run's arms differ in Ingress replicas."""
    app_args = {spec["label"]: spec.get("app_args") for spec in report["meta"].get("arms", ())}
    several_ingress_counts = ingress_s is not None and len({arm.ingress_replicas for arm in arms.values()}) > 1
    lines = []
    for label, arm in arms.items():
        line = f"{label}: simulated {arm.policy}"
        if arm.num_routers > 1:
            line += f", {arm.num_routers} independent routers"
        if arm.policy_args:
            line += f", {arm.policy_args}"
        if arm.summary_period_s != LIVE_SUMMARY_PERIOD_S:
            line += f", summaries every {arm.summary_period_s:g} s"
        unmodelled = {k: v for k, v in (app_args.get(label) or {}).items() if k not in MODELLED_APP_ARGS}
        if unmodelled:
            line += f"; app args not modelled: {unmodelled}"
        if several_ingress_counts:
            line += (f"; ingress {ingress_s[label] * 1e3:.1f} ms (median), drawn from the arms with "
                     f"{arm.ingress_replicas} Ingress replica(s)")
        lines.append(line)
    return lines


def print_markdown(workload: str, comparison: dict, ingress_s: float, slowdown: float, drawn: bool) -> None:
    ingress = "a draw from the live per-request ingress times" if drawn else "the live median ingress"
    print(f"{workload} (engine steps x{slowdown:.2f} the profile's; sessions' next turns "
          f"{ingress_s * 1e3:.1f} ms after a completion; simulated client TTFT = engine TTFT + {ingress}). "
          f"Each cell: live / sim (difference or ratio); ✗: outside the goal\n")
    keys = [m for m in METRICS if all(m[0] in row for row in comparison["rows"].values())]
    print("| router | " + " | ".join(label for _, label, *_ in keys) + " |")
    print("|---|" + "---|" * len(keys))
    for router, row in comparison["rows"].items():
        cells = []
        for key, _, kind, _ in keys:
            cell = row[key]
            text = f"{cell['live']:.3f} / {cell['sim']:.3f}"
            if kind == "abs":
                text += f" ({cell['diff']:+.3f})"
            elif kind == "rel":
                text += f" ({cell['ratio']:.2f})"
            cells.append(text + ("" if cell.get("met", True) else " ✗"))
        print(f"| {router} | " + " | ".join(cells) + " |")
    print()
    for key, rank in comparison["rankings"].items():
        verdict = "same order" if rank["same"] else "another order"
        separated = ", ".join(f"{a} > {b}" for a, b in rank["separated"]) or "none"
        against = ", ".join(f"{a} > {b}" for a, b in rank["contradicted"]) or "none"
        print(f"- {key}: live {' > '.join(rank['live'])}; sim {' > '.join(rank['sim'])} ({verdict}). "
              f"Separated in every live round: {separated}; of those the sim reverses: {against}")


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
