"""The arms a load-test comparison deploys side by side (``python -m
harness.loadtest --compare-*``): :class:`Arm` (label, router, the router's
kwargs, app args, deployment options) and one maker per comparison flag,
each taking the parsed command line (``--compare-arms``: arms as JSON).
"""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Arm:
    """One side of a comparison: its label, the router, the router's kwargs
    (None: the config's), app args replacing the config's for it, and
    deployment options replacing the config's (``{"Ingress": {"num_replicas": 2}}``)."""

    label: str
    router: str
    router_kwargs: dict | None = None
    app_args: dict | None = None
    deployments: dict | None = None


def kvroute_kwargs_of(args) -> dict | None:
    """``--kvroute-kwargs`` parsed (None: not given, the config's kwargs)."""
    return json.loads(args.kvroute_kwargs) if args.kvroute_kwargs else None


def router_arms(args) -> list[Arm]:
    """``--compare-routers``: one arm per router; ``--kvroute-kwargs`` for ours."""
    kvroute_kwargs = kvroute_kwargs_of(args)
    return [Arm(router, router, kvroute_kwargs if router == "kvroute" else None)
            for router in args.compare_routers.split(",")]


def fetch_arms(args) -> list[Arm]:
    """``--compare-fetch``: our router with the app's ``fetch_enabled`` on, then off."""
    kvroute_kwargs = kvroute_kwargs_of(args)
    return [Arm(f"fetch-{state}", "kvroute", kvroute_kwargs, {"fetch_enabled": state == "on"})
            for state in ("on", "off")]


def summary_arms(args) -> list[Arm]:
    """``--compare-summaries``: our router with the Workers' ``summary_mode`` stream, then full."""
    kvroute_kwargs = kvroute_kwargs_of(args)
    return [Arm(f"summary-{mode}", "kvroute", kvroute_kwargs, {"summary_mode": mode}) for mode in ("stream", "full")]


def token_price_arms(args) -> list[Arm]:
    """``--compare-token-prices``: our router pricing output tokens at what the
    Workers measure (``learn_token_costs``), then at its configured priors only."""
    kvroute_kwargs = kvroute_kwargs_of(args) or {}
    return [Arm(f"prices-{label}", "kvroute", kvroute_kwargs | {"learn_token_costs": learn})
            for label, learn in (("measured", True), ("configured", False))]


def fetch_patience_arms(args) -> list[Arm]:
    """``--compare-fetch-patience``: our router, the Workers' ``fetch_patience``
    at its default 1 (a request waits for a fetch at most its estimated
    recompute time), then 0 (up to ``fetch_timeout_s``)."""
    kvroute_kwargs = kvroute_kwargs_of(args)
    return [Arm(f"patience-{value:g}", "kvroute", kvroute_kwargs, {"fetch_patience": value}) for value in (1.0, 0.0)]


ARM_KEYS = {"label", "router", "router_kwargs", "app_args", "ingress_replicas", "deployments"}


def custom_arms(args) -> list[Arm]:
    """``--compare-arms``: a JSON list (or ``@file``) of arms, each an object with
    ``label`` and optionally ``router`` (default kvroute), ``router_kwargs``
    (``--kvroute-kwargs`` for kvroute when absent), ``app_args``,
    ``ingress_replicas`` and ``deployments``; e.g. one against two Ingress
    replicas (two independent routers) with and without a policy knob. An
    arm's ``router_kwargs`` replace deploy/config.yaml's (they are not merged
    with them): an A/B of one knob repeats the config's other knobs in both
    arms (e.g. ``replicate_hot_prefixes: false``), and ``{}`` is the library's
    defaults."""
    text = args.compare_arms
    if text.startswith("@"):
        with open(text[1:]) as file:
            text = file.read()
    specs = json.loads(text)
    if not isinstance(specs, list) or len(specs) < 2 or not all(isinstance(spec, dict) for spec in specs):
        raise ValueError("--compare-arms takes a JSON list of at least two arm objects")
    kvroute_kwargs = kvroute_kwargs_of(args)
    arms = []
    for spec in specs:
        unknown = set(spec) - ARM_KEYS
        if unknown or not isinstance(spec.get("label"), str) or not spec["label"]:
            raise ValueError(f"arm {spec!r}: needs a label; known keys {sorted(ARM_KEYS)}, unknown {sorted(unknown)}")
        router = spec.get("router", "kvroute")
        deployments = dict(spec.get("deployments") or {})
        if "ingress_replicas" in spec:
            replicas = spec["ingress_replicas"]
            if type(replicas) is not int or replicas < 1:
                raise ValueError(f"arm {spec['label']!r}: ingress_replicas must be a positive int, got {replicas!r}")
            deployments["Ingress"] = {**deployments.get("Ingress", {}), "num_replicas": replicas}
        default_kwargs = kvroute_kwargs if router == "kvroute" else None
        arms.append(Arm(spec["label"], router, spec.get("router_kwargs", default_kwargs), spec.get("app_args"),
                        deployments or None))
    labels = [arm.label for arm in arms]
    if len(set(labels)) != len(labels):
        raise ValueError(f"--compare-arms: labels must differ, got {labels}")
    return arms


def stream_interval_arms(args) -> list[Arm]:
    """``--compare-stream-intervals 0,50``: our router with the app's
    ``stream_interval_ms`` at each value (how often a stream's tokens leave
    its Worker)."""
    kvroute_kwargs = kvroute_kwargs_of(args)
    intervals = [float(value) for value in args.compare_stream_intervals.split(",")]
    return [Arm(f"stream-{value:g}ms", "kvroute", kvroute_kwargs, {"stream_interval_ms": value}) for value in intervals]
