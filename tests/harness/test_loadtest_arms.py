"""``harness.loadtest --compare-arms`` / ``--ingress-replicas``: arms parsed
from JSON (ingress replicas become the Ingress deployment's ``num_replicas``,
kvroute arms default to ``--kvroute-kwargs``), bad arm lists refused with a
usage error, and each arm's deployment options written into the config it
deploys, over the app-wide ones."""

import json
import os
from types import SimpleNamespace

import pytest
import yaml

from harness.loadtest import Arm, custom_arms, main
from harness.serving import ServeApp


def _args(arms, kvroute_kwargs=None):
    return SimpleNamespace(compare_arms=json.dumps(arms), kvroute_kwargs=kvroute_kwargs)


def test_arms_from_json_with_ingress_replicas_and_default_kwargs():
    arms = custom_arms(_args([
        {"label": "one"},
        {"label": "two", "ingress_replicas": 2, "router_kwargs": {"load_peer_estimate": True}},
        {"label": "pow2", "router": "pow2", "deployments": {"Worker": {"num_replicas": 3}}},
    ], kvroute_kwargs='{"balance_weight": 0.3}'))
    assert arms == [
        Arm("one", "kvroute", {"balance_weight": 0.3}),
        Arm("two", "kvroute", {"load_peer_estimate": True}, None, {"Ingress": {"num_replicas": 2}}),
        Arm("pow2", "pow2", None, None, {"Worker": {"num_replicas": 3}}),
    ]


def test_arms_from_a_file(tmp_path):
    path = tmp_path / "arms.json"
    path.write_text(json.dumps([{"label": "a"}, {"label": "b", "app_args": {"fetch_enabled": False}}]))
    arms = custom_arms(SimpleNamespace(compare_arms=f"@{path}", kvroute_kwargs=None))
    assert [arm.app_args for arm in arms] == [None, {"fetch_enabled": False}]


@pytest.mark.parametrize("arms, message", [
    ([{"label": "a"}], "at least two"),
    ({"label": "a"}, "at least two"),
    ([{"label": "a"}, {"label": "a"}], "labels must differ"),
    ([{"label": "a"}, {"router": "pow2"}], "needs a label"),
    ([{"label": "a"}, {"label": "b", "ingress": 2}], "unknown"),
    ([{"label": "a"}, {"label": "b", "ingress_replicas": 0}], "positive int"),
])
def test_bad_arm_lists_are_refused(arms, message):
    with pytest.raises(ValueError, match=message):
        custom_arms(_args(arms))


def test_the_command_line_turns_a_bad_arm_list_into_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--compare-arms", '[{"label": "a"}]', "--workload", "shared-prefix"])
    assert exit_info.value.code == 2
    assert "at least two" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--compare-arms", '[{"label": "a"}, {"label": "b"}]', "--compare-fetch"])
    with pytest.raises(SystemExit):
        main(["--compare-fetch", "--ingress-replicas", "0"])


def test_an_arms_deployment_options_are_written_over_the_app_wide_ones():
    app = ServeApp(deployment_overrides={"Ingress": {"num_replicas": 3, "max_ongoing_requests": 7}})
    path = app.write_config(deployments={"Ingress": {"num_replicas": 2}})
    deployments = {d["name"]: d for d in yaml.safe_load(open(path))["applications"][0]["deployments"]}
    assert deployments["Ingress"]["num_replicas"] == 2
    assert deployments["Ingress"]["max_ongoing_requests"] == 7
    assert deployments["Worker"]["num_replicas"] == 2  # the config's
    plain = app.write_config()
    assert {d["name"]: d for d in yaml.safe_load(open(plain))["applications"][0]["deployments"]}[
        "Ingress"]["num_replicas"] == 3
    os.unlink(path)
    os.unlink(plain)


def test_a_peer_router_does_not_inherit_the_configs_kvroute_kwargs():
    app = ServeApp()
    written = {}
    for router, kwargs in (("kvroute", None), ("pow2", None), ("pow2", {"x": 1}), (None, None)):
        path = app.write_config(router=router, router_kwargs=kwargs)
        written[(router, str(kwargs))] = yaml.safe_load(open(path))["applications"][0]["args"].get("router_kwargs")
        os.unlink(path)
    ours = written[("kvroute", "None")]
    assert ours == written[(None, "None")] and "replicate_hot_prefixes" in ours  # deploy/config.yaml's
    assert written[("pow2", "None")] is None
    assert written[("pow2", str({"x": 1}))] == {"x": 1}


def test_cpu_per_request_by_role_pools_the_rounds_that_recorded_it(capsys):
    from harness.loadreport import _cpu_by_role
    from harness.loadtest import cpu_ms_per_request

    rounds = [{"num_ok": 100, "cpu_s_by_role": {"proxy": 2.0, "ingress": 4.0, "workers": 6.0, "ray": 1.0}},
              {"num_ok": 300, "cpu_s_by_role": {"proxy": 6.0, "ingress": 8.0, "workers": 10.0, "ray": 1.0}},
              {"num_ok": 50}]  # an older round without the figures: left out
    cpu = cpu_ms_per_request(rounds)
    assert cpu == {"proxy": 20.0, "ingress": 30.0, "workers": 40.0, "ray": 5.0}
    assert _cpu_by_role({"cpu_ms_per_request_by_role": cpu}) == "20/30/40"
    assert cpu_ms_per_request([{"num_ok": 10}]) == {} and _cpu_by_role({}) == "-"
