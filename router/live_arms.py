"""The live load test's arms as the replay runs them: :class:`SimArm` (the
simulated policy, one router per Ingress replica for ours, the arm's router
kwargs and summary period), read from the report's recorded arms
(:func:`live_arms`), and the line that says what each replays
(:func:`describe_arms`)."""

from __future__ import annotations

from dataclasses import dataclass, field

ROUTERS = {"kvroute": "ours", "pow2": "pow2", "prefix_affinity": "ray_prefix_tree"}  # live name -> simulated
LIVE_SUMMARY_PERIOD_S = 1.0  # deploy/config.yaml's routing_stats_period_s, for an arm that does not set it
MODELLED_APP_ARGS = frozenset({"routing_stats_period_s", "share_decisions_period_s"})  # the app args a replay follows


@dataclass(frozen=True)
class SimArm:
    """How the replay runs one live arm: the simulated ``policy``, the arm's
    ``ingress_replicas`` (each with its own request router, so our policy
    runs as that many independent routers: :attr:`num_routers`; a peer is
    replayed as one), ``policy_args``, the arm's router kwargs (ours only),
    ``summary_period_s``, the arm's ``routing_stats_period_s`` (how often
    the routers hear the Workers' summaries), and ``share_decisions_s``, its
    ``share_decisions_period_s`` (how late each router books the others'
    decisions; None: not shared)."""

    policy: str
    ingress_replicas: int = 1
    policy_args: dict = field(default_factory=dict)
    summary_period_s: float = LIVE_SUMMARY_PERIOD_S
    share_decisions_s: float | None = None

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
        app_args = spec.get("app_args") or {}
        period_s = app_args.get("routing_stats_period_s", LIVE_SUMMARY_PERIOD_S)
        # a run from before shared decisions recorded no default: they were not shared
        share_s = app_args.get("share_decisions_period_s", meta.get("share_decisions_period_s", 0.0))
        arms[label] = SimArm(ROUTERS[router], int(ingress), kwargs, float(period_s),
                             float(share_s) if share_s and router == "kvroute" and int(ingress) > 1 else None)
    return arms


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
        if arm.share_decisions_s is not None:
            line += f", decisions shared every {arm.share_decisions_s:g} s"
        unmodelled = {k: v for k, v in (app_args.get(label) or {}).items() if k not in MODELLED_APP_ARGS}
        if unmodelled:
            line += f"; app args not modelled: {unmodelled}"
        if several_ingress_counts:
            line += (f"; ingress {ingress_s[label] * 1e3:.1f} ms (median), drawn from the arms with "
                     f"{arm.ingress_replicas} Ingress replica(s)")
        lines.append(line)
    return lines
