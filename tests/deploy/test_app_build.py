"""``build_app`` checks the whole config before Serve starts anything: the
kvroute router's PolicyConfig is built at build time (no cluster needed)."""

from __future__ import annotations

import pytest

from deploy.app import build_app, checked_router_kwargs
from deploy.settings import AppConfig


def test_the_router_block_size_and_fetch_switch_default_to_the_apps():
    assert checked_router_kwargs(AppConfig(router_block_size=32)) == {"block_size": 32, "fetch_enabled": True}
    assert checked_router_kwargs(AppConfig(router_kwargs={"load_factor": 1.5}, fetch_enabled=False)) == {
        "load_factor": 1.5, "block_size": 64, "fetch_enabled": False}


@pytest.mark.parametrize("args,message", [
    ({"router_kwargs": {"nope": 1}}, r"unknown router_kwargs \['nope'\] for the kvroute router"),
    ({"router_block_size": 64, "router_kwargs": {"block_size": 32}}, "differs from router_block_size 64"),
    ({"router_kwargs": {"load_factor": 0.5}}, "load_factor must be a finite number >= 1.0"),
    ({"router": "router.serve:KVRouteRouter", "router_kwargs": {"nope": 1}}, "unknown router_kwargs"),
    ({"fetch_enabled": True, "router_kwargs": {"fetch_enabled": False}}, "set fetch_enabled once"),
    ({"fetch_timeout_s": 0}, "fetch_timeout_s must be a positive number"),
    ({"fetch_timeout_s": 900}, r"fetch timeout_s must be a number in \(0, 600\]"),
    ({"fetch_enabled": "yes"}, "fetch_enabled must be true or false"),
    ({"fetch_prior_overhead_s": -0.1}, r"fetch prior_overhead_s must be a number in \[0, 60\]"),
    ({"fetch_prior_overhead_s": "1"}, "fetch prior_overhead_s must be"),
    ({"fetch_patience": -1}, r"fetch patience must be a number in \[0, 1000\]"),
    ({"fetch_prefill_patience": "3"}, r"fetch prefill_patience must be a number in \[0, 1000\]"),
    ({"stream_interval_ms": -1}, r"stream_interval_ms must be a number of milliseconds in \[0, 1000\]"),
    ({"stream_interval_ms": 5000}, "stream_interval_ms must be"),
    ({"stream_interval_ms": True}, "stream_interval_ms must be"),
    ({"share_decisions_period_s": -0.05}, "share_decisions_period_s must be a finite number >= 0"),
    ({"share_decisions_period_s": True}, "share_decisions_period_s must be"),
])
def test_a_bad_router_config_fails_the_build_with_a_clear_error(args, message):
    with pytest.raises(ValueError, match=message):
        build_app(args)


def test_other_routers_get_their_kwargs_unchecked():
    assert checked_router_kwargs(AppConfig(router="pow2", router_kwargs={"anything": 1})) == {"anything": 1}


def test_a_good_config_builds_without_a_cluster():
    assert AppConfig().stream_interval_ms == 100.0 and AppConfig(stream_interval_ms=0).stream_interval_ms == 0
    app = build_app({"router_kwargs": {"load_factor": 1.5}})
    assert type(app).__name__ == "Application"


def test_the_kvroute_router_gets_the_apps_decision_sharing_period_and_other_routers_do_not():
    def router_kwargs(app):
        worker = app._bound_deployment.init_args[0]  # Ingress.bind(worker, config)
        return worker._bound_deployment._deployment_config.request_router_config.request_router_kwargs

    assert router_kwargs(build_app({}))["share_decisions_period_s"] == 0.05  # the default
    assert router_kwargs(build_app({"share_decisions_period_s": 0}))["share_decisions_period_s"] == 0
    assert "share_decisions_period_s" not in router_kwargs(build_app({"router": "pow2"}))
