"""What else the replay takes measured from the live run: the ingress time
(per-request samples and medians, pooled per Ingress count:
:func:`ingress_by_arm`), the token prices and fetch costs our router heard,
and the Workers' KV transfer link (:func:`live_fetch_model`)."""

from __future__ import annotations

import statistics

from router.live_arms import SimArm
from router.sim_fetch import FetchModel


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
