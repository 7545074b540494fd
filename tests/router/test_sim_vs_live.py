"""router.sim_vs_live and the faithful Ray prefix-tree peer it compares against."""

import json
from dataclasses import asdict, replace
import statistics

import pytest

from harness.loadstats import RequestRecord, summarize
from router.baselines import RayPrefixTree
from router.batching import BatchingReplica, StepProfile
from router.sim_vs_live import GOALS, compare, live_figures, main, measured_ingress_s, ranking
from router.workload import SimRequest

PROFILE = StepProfile(0.002, 10e-6, 50e-6, 0.0, 512, 65536, name="test")


def request(tokens):
    return SimRequest(0.0, tuple(tokens), 1, len(tokens), 4, (), tuple(tokens))


def test_ray_prefix_tree_follows_a_prompt_routed_but_not_yet_cached():
    replicas = [BatchingReplica(f"r{i}", 10_000, PROFILE) for i in range(2)]
    rule = RayPrefixTree()
    system = list(range(1000, 1256))
    first = rule.choose(request(system + [1, 2, 3]), replicas, 0.0)
    replicas[first].submit(0, request(system + [1, 2, 3]), 0.0)  # queued: no replica has cached anything yet
    assert all(r.radix.num_tokens == 0 for r in replicas)
    # the router's own tree already holds the first prompt: the second follows it despite the longer queue
    assert rule.choose(request(system + [4, 5, 6]), replicas, 0.0) == first
    # a cold prompt (match < 10 %) goes to the replica with the smaller tree
    assert rule.choose(request(list(range(5000, 5300))), replicas, 0.0) == 1 - first


def live_report(tmp_path, hit_by_router, ttft_by_router, engine_ttft=0.01):
    results = {}
    for router, (hit, ttft) in {r: (hit_by_router[r], ttft_by_router[r]) for r in hit_by_router}.items():
        records = []
        for i in range(20):
            rec = RequestRecord(session_id=i, turn=0, prompt_tokens=100, start_s=0.0, end_s=1.0,
                                replica_id=f"rank-{1 + i % 2}", cached_tokens=int(100 * hit), output_tokens=4,
                                ttft_s=ttft, server_ttft_s=engine_ttft)
            records.append(rec)
        results[router] = summarize(records, 1.0, {"ttft_s": 1.0, "itl_s": 1.0}, 2)
    return {"meta": {"workload": "shared-prefix", "scale": "cpu", "mode": "closed", "concurrency": 2,
                     "num_requests": 20}, "results": results}


def test_live_figures_and_the_measured_ingress(tmp_path):
    report = live_report(tmp_path, {"kvroute": 0.8, "pow2": 0.5, "prefix_affinity": 0.7},
                         {"kvroute": 0.05, "pow2": 0.07, "prefix_affinity": 0.09})
    live = live_figures(report)
    assert live["pow2"]["hit"] == pytest.approx(0.5)
    assert live["kvroute"]["imbalance"] == pytest.approx(1.0)
    assert live["kvroute"]["busy_imbalance"] == pytest.approx(1.0)  # both Workers busy for the whole second
    assert measured_ingress_s(live) == pytest.approx(0.06)  # median of 0.04, 0.06, 0.08
    assert ranking(live, "hit") == ["kvroute", "prefix_affinity", "pow2"]
    assert ranking(live, "ttft_p99") == ["kvroute", "pow2", "prefix_affinity"]


def test_compare_marks_each_goal_and_the_rankings():
    live = {"kvroute": {"hit": 0.80, "ttft_p50": 0.10, "ttft_p99": 0.20, "imbalance": 1.0},
            "pow2": {"hit": 0.60, "ttft_p50": 0.10, "ttft_p99": 0.30, "imbalance": 1.1},
            "prefix_affinity": {"hit": 0.70, "ttft_p50": 0.10, "ttft_p99": 0.25, "imbalance": 1.2}}
    sim = {"kvroute": {"hit": 0.81, "ttft_p50": 0.12, "ttft_p99": 0.27, "imbalance": 1.0},
           "pow2": {"hit": 0.63, "ttft_p50": 0.13, "ttft_p99": 0.30, "imbalance": 1.0},
           "prefix_affinity": {"hit": 0.70, "ttft_p50": 0.10, "ttft_p99": 0.36, "imbalance": 1.3}}
    result = compare(live, sim)
    met = {router: {k: cell["met"] for k, cell in row.items() if "met" in cell}
           for router, row in result["rows"].items()}
    assert met["kvroute"] == {"hit": True, "ttft_p50": True, "ttft_p99": True}
    assert met["pow2"] == {"hit": False, "ttft_p50": False, "ttft_p99": True}
    assert met["prefix_affinity"]["ttft_p99"] is False  # 1.44 > 1 + 0.40
    assert result["rows"]["pow2"]["hit"]["diff"] == pytest.approx(0.03)
    assert "engine_ttft_p50" not in result["rows"]["pow2"]  # not recorded: left out, not guessed
    assert GOALS["ttft_p99"] == 0.40
    assert result["rankings"]["hit"]["same"]
    assert not result["rankings"]["ttft_p99"]["same"]


def test_cli_replays_the_live_sessions_and_refuses_a_mismatched_workload(tmp_path, capsys):
    report = live_report(tmp_path, {"kvroute": 0.8, "pow2": 0.5, "prefix_affinity": 0.7},
                         {"kvroute": 0.05, "pow2": 0.07, "prefix_affinity": 0.09})
    args = {"num_groups": 2, "prompts_per_group": 10}
    report["meta"]["num_requests"] = 20
    path = tmp_path / "live.json"
    path.write_text(json.dumps(report))
    out = tmp_path / "cmp.json"
    assert main(["--live", str(path), "--workload-args", json.dumps(args), "--seeds", "1", "--json", str(out),
                 "--engine-slowdown", "1"]) == 0
    saved = json.loads(out.read_text())
    assert saved["ingress_s"] == pytest.approx(0.06)
    assert set(saved["comparison"]["rows"]) == {"kvroute", "pow2", "prefix_affinity"}
    assert saved["simulated"]["setup"]["closed_loop"]["concurrency"] == 2
    assert "- hit: live" in capsys.readouterr().out
    with pytest.raises(ValueError, match="rebuilt"):
        main(["--live", str(path), "--seeds", "1", "--engine-slowdown", "1"])  # the cpu preset's 128 requests, not the run's 20


def test_the_engine_slowdown_is_live_inter_token_latency_over_the_profiles_step():
    from router.sim_vs_live import measured_slowdown, slowed

    profile = StepProfile(0.002, 10e-6, 50e-6, 0.0, 512, 65536, name="test")
    # 100 steps, 2,000 prefill tokens, 300 decode tokens: the profile's mean step is 2.35 ms
    replicas = {"a": {"num_steps": 60, "prefill_tokens": 1500, "decode_tokens": 200},
                "b": {"num_steps": 40, "prefill_tokens": 500, "decode_tokens": 100}}
    round_ = {"itl_s": {"mean": 0.0235}, "output_tokens_per_s": 100.0, "wall_s": 3.0, "num_ok": 20,
              "server_stats": {"replicas": replicas}}
    report = {"results": {"kvroute": {"rounds": [round_]}}}
    assert measured_slowdown(report, profile) == pytest.approx(10.0)
    slow = slowed(profile, 10.0)
    assert slow.step_s(100, 2, 0) == pytest.approx(10 * profile.step_s(100, 2, 0))
    assert slow.max_batch_tokens == profile.max_batch_tokens
    with pytest.raises(ValueError, match="slowdown"):
        slowed(profile, 0.0)
    with pytest.raises(ValueError, match="inter-token"):
        measured_slowdown({"results": {}}, profile)


def test_variable_steps_draw_live_gaps_over_their_mean_for_prefill_steps_only():
    from router.sim_vs_live import VariableSteps, step_factors

    report = {"results": {"a": {"itl_samples_s": [0.01, 0.01]}, "b": {"itl_samples_s": [0.04]}}}
    factors = step_factors(report)
    assert factors == pytest.approx((0.5, 0.5, 2.0))  # pooled, mean 0.02
    assert step_factors({"results": {"a": {}}}) == ()
    profile = StepProfile(0.002, 10e-6, 50e-6, 0.0, 512, 65536, name="test")
    varied = VariableSteps(**profile.to_dict(), factors=factors, seed=3)
    draws = {round(varied.step_s(100, 0, 0) / profile.step_s(100, 0, 0), 6) for _ in range(50)}
    assert draws == {0.5, 2.0}
    assert (varied.base_s, varied.decode_seq_s) == (profile.base_s, profile.decode_seq_s)  # closed-form decodes: mean
    with pytest.raises(ValueError, match="factors"):
        VariableSteps(**profile.to_dict(), factors=())


def test_only_pairs_every_live_round_separates_bind_the_simulators_ranking():
    from router.sim_vs_live import separated_pairs

    rounds = {"kvroute": [0.20, 0.25, 0.22], "pow2": [0.30, 0.40, 0.35], "prefix_affinity": [0.24, 0.50, 0.30]}
    assert separated_pairs(rounds, "ttft_p99") == [("kvroute", "pow2")]  # prefix_affinity overlaps both
    assert separated_pairs({"a": [0.9, 0.8], "b": [0.7]}, "hit") == [("a", "b")]  # higher hit is better
    live = {r: {"hit": 0.5, "ttft_p50": 0.1, "ttft_p99": statistics.median(v), "imbalance": 1.0,
                "rounds": {"ttft_p99": v}} for r, v in rounds.items()}
    sim = {r: {"hit": 0.5, "ttft_p50": 0.1, "ttft_p99": p99, "imbalance": 1.0}
           for r, p99 in (("kvroute", 0.33), ("pow2", 0.31), ("prefix_affinity", 0.2))}
    ranks = compare(live, sim)["rankings"]["ttft_p99"]
    assert ranks["separated"] == [("kvroute", "pow2")] and ranks["contradicted"] == [("kvroute", "pow2")]


def test_the_simulated_workers_report_the_prices_the_live_workers_measured(tmp_path):
    """Our router learned the live Workers' median token prices; the replay's
    replicas report that median (measured ones only), not the profile's."""
    from router.sim_vs_live import live_token_costs

    def round_with(*prices):
        return {"server_stats": {"replicas": {f"w{i}": {"decode_token_cost": d, "queue_token_cost": q}
                                              for i, (d, q) in enumerate(prices)}}}

    report = {"results": {"kvroute": {"rounds": [round_with((50.0, 0.0), (0.0, 0.0)),  # 0: not measured yet
                                                 round_with((70.0, 4.0), (60.0, 1.0))]},
                          "pow2": {"rounds": [round_with((900.0, 90.0))]}}}  # another router's run: not ours
    assert live_token_costs(report) == (60.0, 1.0)
    assert live_token_costs({"results": {"kvroute": {"rounds": [round_with((0.0, 0.0))]}}}) is None
    assert live_token_costs({"results": {}}) is None

    report = live_report(tmp_path, {"kvroute": 0.8, "pow2": 0.5, "prefix_affinity": 0.7},
                         {"kvroute": 0.05, "pow2": 0.07, "prefix_affinity": 0.09})
    report["meta"]["num_requests"] = 20
    report["results"]["kvroute"]["rounds"] = [round_with((50.0, 2.0))]
    path, out = tmp_path / "live.json", tmp_path / "cmp.json"
    path.write_text(json.dumps(report))
    args = json.dumps({"num_groups": 2, "prompts_per_group": 10})
    assert main(["--live", str(path), "--workload-args", args, "--seeds", "1", "--json", str(out),
                 "--engine-slowdown", "1"]) == 0
    assert json.loads(out.read_text())["token_costs"] == [50.0, 2.0]
    assert main(["--live", str(path), "--workload-args", args, "--seeds", "1", "--json", str(out),
                 "--engine-slowdown", "1", "--token-costs", "profile"]) == 0
    assert json.loads(out.read_text())["token_costs"] is None


def test_live_arms_from_the_recorded_arms_or_the_labels():
    """A --compare-arms run replays each arm as it ran: our policy with its
    router kwargs and one router per Ingress replica; a peer as one router;
    an older run's labels read as router names."""
    from router.sim_vs_live import SimArm, live_arms

    meta = {"ingress_replicas": None, "arms": [
        {"label": "one", "router": "kvroute", "router_kwargs": None, "app_args": None, "deployments": None},
        {"label": "two", "router": "kvroute", "router_kwargs": {"load_peer_estimate": True},
         "deployments": {"Ingress": {"num_replicas": 2}}},
        {"label": "p", "router": "pow2", "router_kwargs": {"x": 1}, "deployments": {"Ingress": {"num_replicas": 2}}},
    ]}
    assert live_arms({"meta": meta, "results": {}}) == {
        "one": SimArm("ours"), "two": SimArm("ours", 2, {"load_peer_estimate": True}), "p": SimArm("pow2", 2)}
    assert [arm.num_routers for arm in live_arms({"meta": meta, "results": {}}).values()] == [1, 2, 1]
    older = {"meta": {}, "results": {"kvroute": {}, "prefix_affinity": {}}}
    assert live_arms(older) == {"kvroute": SimArm("ours"), "prefix_affinity": SimArm("ray_prefix_tree")}
    every_arm_two = {"meta": {"ingress_replicas": 2}, "results": {"kvroute": {}}}
    assert live_arms(every_arm_two) == {"kvroute": SimArm("ours", 2)}
    with pytest.raises(ValueError, match="no simulated counterpart"):
        live_arms({"meta": {}, "results": {"prices-measured": {}}})


def test_an_arms_summary_period_is_replayed_and_no_longer_called_unmodelled(tmp_path, capsys):
    """An arm that set ``routing_stats_period_s`` is replayed with summaries
    that often; the app args the replay does not follow are still named."""
    from router.sim_vs_live import SimArm, describe_arms, live_arms

    meta = {"arms": [
        {"label": "slow", "router": "kvroute"},
        {"label": "fast", "router": "kvroute", "app_args": {"routing_stats_period_s": 0.25, "fetch_enabled": False},
         "deployments": {"Ingress": {"num_replicas": 2}}},
    ]}
    arms = live_arms({"meta": meta, "results": {}})
    assert arms == {"slow": SimArm("ours"), "fast": SimArm("ours", 2, {}, 0.25)}
    slow, fast = describe_arms({"meta": meta}, arms, None)
    assert "summaries every" not in slow and "not modelled" not in slow
    assert "summaries every 0.25 s" in fast and "not modelled: {'fetch_enabled': False}" in fast
    report = live_report(tmp_path, {"slow": 0.8, "fast": 0.8}, {"slow": 0.05, "fast": 0.05})
    report["meta"]["arms"] = meta["arms"]
    path, out = tmp_path / "live.json", tmp_path / "cmp.json"
    path.write_text(json.dumps(report))
    args = json.dumps({"num_groups": 2, "prompts_per_group": 10})
    assert main(["--live", str(path), "--workload-args", args, "--seeds", "1", "--json", str(out),
                 "--engine-slowdown", "1"]) == 0
    setups = json.loads(out.read_text())["simulated"]["setups"]
    assert (setups["slow"]["summary_period_s"], setups["fast"]["summary_period_s"]) == (1.0, 0.25)


def test_cli_replays_each_arm_with_its_routers_and_kwargs(tmp_path, capsys):
    report = live_report(tmp_path, {"one": 0.8, "two": 0.8}, {"one": 0.05, "two": 0.06})
    report["meta"]["arms"] = [
        {"label": "one", "router": "kvroute"},
        {"label": "two", "router": "kvroute", "router_kwargs": {"load_peer_estimate": True},
         "deployments": {"Ingress": {"num_replicas": 2}}},
    ]
    path, out = tmp_path / "live.json", tmp_path / "cmp.json"
    path.write_text(json.dumps(report))
    args = json.dumps({"num_groups": 2, "prompts_per_group": 10})
    assert main(["--live", str(path), "--workload-args", args, "--seeds", "1", "--json", str(out),
                 "--engine-slowdown", "1"]) == 0
    saved = json.loads(out.read_text())
    setups = saved["simulated"]["setups"]
    assert (setups["one"]["num_routers"], setups["two"]["num_routers"]) == (1, 2)
    assert (setups["one"]["policy_config"]["load_peer_estimate"], setups["two"]["policy_config"]["load_peer_estimate"]) \
        == (False, True)
    assert set(saved["comparison"]["rows"]) == {"one", "two"}
    assert "two: simulated ours, 2 independent routers" in capsys.readouterr().out
    report["meta"]["arms"][1]["router"] = "least_loaded"
    path.write_text(json.dumps(report))
    with pytest.raises(SystemExit):
        main(["--live", str(path), "--workload-args", args, "--seeds", "1", "--engine-slowdown", "1"])


def test_ingress_times_pool_over_arms_with_as_many_ingress_replicas(tmp_path):
    """Arms with one Ingress replica draw from each other's ingress times, not
    from a two-replica arm's (capacity that arm had); one count: the whole run."""
    from router.sim_vs_live import SimArm, ingress_by_arm

    report = live_report(tmp_path, {"a": 0.8, "b": 0.8, "c": 0.8}, {"a": 0.05, "b": 0.07, "c": 0.21})
    for label, samples in {"a": [0.04], "b": [0.06], "c": [0.20]}.items():
        report["results"][label]["ingress_overhead_samples_s"] = samples
    live = live_figures(report)
    seconds, samples = ingress_by_arm(report, live, {"a": SimArm("ours"), "b": SimArm("pow2"), "c": SimArm("ours", 2)})
    assert seconds["a"] == seconds["b"] == pytest.approx(0.05) and seconds["c"] == pytest.approx(0.20)
    assert samples["a"] == samples["b"] == [0.04, 0.06] and samples["c"] == [0.20]
    seconds, samples = ingress_by_arm(report, live, {label: SimArm("ours") for label in "abc"})
    assert list(seconds.values()) == [measured_ingress_s(live)] * 3
    assert samples["a"] == [0.04, 0.06, 0.20]


def test_policy_args_change_our_router_in_every_arm_of_the_replay(tmp_path):
    report = live_report(tmp_path, {"kvroute": 0.8, "pow2": 0.5}, {"kvroute": 0.05, "pow2": 0.07})
    report["meta"]["num_requests"] = 20
    path, out = tmp_path / "live.json", tmp_path / "cmp.json"
    path.write_text(json.dumps(report))
    args = ["--live", str(path), "--workload-args", json.dumps({"num_groups": 2, "prompts_per_group": 10}),
            "--seeds", "1", "--engine-slowdown", "1", "--json", str(out)]
    assert main(args + ["--policy-args", '{"balance_weight": 0.5}']) == 0
    setups = json.loads(out.read_text())["simulated"]["setups"]
    assert setups["kvroute"]["policy_config"]["balance_weight"] == 0.5
    with pytest.raises(SystemExit):
        main(args + ["--policy-args", '{"balance": 0.5}'])


def test_the_replay_fetches_over_the_link_the_live_workers_measured(tmp_path):
    """The replay's fetches take the live Workers' transfer model (bytes per
    token of the served model, the medians of their estimated bandwidth and
    fixed cost), and its Workers report the fetch costs the live ones did;
    ``--fetch model`` keeps the simulator's default link."""
    from router.sim_fetch import FetchModel
    from router.sim_vs_live import live_fetch_costs, live_fetch_model

    def round_with(bandwidths, overheads, costs, per_token=1024):
        return {"server_stats": {"replicas": {r: {"kv_bytes_per_token": per_token} for r in bandwidths}},
                "replica_counters": {"estimated_bandwidth_bytes_per_s": bandwidths,
                                     "estimated_overhead_s": overheads, "reported_fetch_costs": costs}}

    report = {"results": {
        "kvroute": {"rounds": [round_with({"w0": 6e6, "w1": 8e6}, {"w0": 0.010, "w1": 0.030},
                                          {"w0": [2.0, 40.0], "w1": [3.0, 60.0]}),
                               round_with({"w0": 7e6}, {"w0": 0.020}, {"w0": [2.5, 50.0]})]},
        "pow2": {"rounds": [round_with({"w0": 9e9}, {"w0": 9.0}, {"w0": [0.001, 0.0]}, per_token=8)]}}}
    assert live_fetch_model(report) == FetchModel(1024, 7e6, latency_s=0.020)
    assert live_fetch_costs(report) == (2.5, 50.0)
    # no bytes per token in /stats: the run's fetched bytes over its fetched tokens
    older = round_with({"w0": 6e6}, {}, {}) | {"server_stats": {"replicas": {"w0": {}}}}
    older["replica_counters"] |= {"fetched_bytes": 3 * 2048, "fetched_tokens": 3}
    assert live_fetch_model({"results": {"kvroute": {"rounds": [older]}}}) == FetchModel(2048, 6e6)
    assert live_fetch_model({"results": {"kvroute": {"rounds": [{"server_stats": {}}]}}}) is None
    assert live_fetch_costs({"results": {"kvroute": {"rounds": [{}]}}}) is None

    report = live_report(tmp_path, {"kvroute": 0.8, "pow2": 0.5, "prefix_affinity": 0.7},
                         {"kvroute": 0.05, "pow2": 0.07, "prefix_affinity": 0.09})
    report["results"]["kvroute"]["rounds"] = [round_with({"w0": 6e6}, {"w0": 0.01}, {"w0": [4.0, 30.0]})]
    path, out = tmp_path / "live.json", tmp_path / "cmp.json"
    path.write_text(json.dumps(report))
    args = ["--live", str(path), "--workload-args", json.dumps({"num_groups": 2, "prompts_per_group": 10}),
            "--seeds", "1", "--json", str(out), "--engine-slowdown", "1"]
    assert main(args) == 0
    replayed = json.loads(out.read_text())
    assert replayed["fetch_model"]["bandwidth_bytes_per_s"] == 6e6 and replayed["fetch_costs"] == [4.0, 30.0]
    assert replayed["simulated"]["setup"]["fetch"]["bandwidth_bytes_per_s"] == 6e6
    assert replayed["simulated"]["setup"]["reported_fetch_costs"] == [4.0, 30.0]
    assert main(args + ["--fetch", "model"]) == 0
    replayed = json.loads(out.read_text())
    assert replayed["fetch_model"] is None and replayed["fetch_costs"] is None
    assert replayed["simulated"]["setup"]["fetch"] == asdict(FetchModel())


def test_simulated_replicas_report_the_fetch_costs_they_are_given():
    from router.simulate import SimConfig, make_replicas

    given = make_replicas(SimConfig(num_replicas=2, budget_tokens=1000, reported_fetch_costs=(3.0, 70.0)), 100)
    assert [r.reported_fetch_costs for r in given] == [(3.0, 70.0)] * 2
    own = make_replicas(SimConfig(num_replicas=1, budget_tokens=1000), 100)
    assert own[0].reported_fetch_costs == SimConfig(num_replicas=1, budget_tokens=1).fetch.reported_costs(
        1.0 / SimConfig(num_replicas=1, budget_tokens=1).cost.prefill_tokens_per_s)


def test_the_replay_can_step_at_the_live_workers_own_step_fit(tmp_path):
    """``--engine-slowdown workers``: the profile's per-token, per-sequence and
    base terms become those the live Workers fitted to their own steps (the
    medians of what /stats reports), its context term and limits kept."""
    from router.sim_vs_live import workers_profile

    def round_with(*rows):
        return {"server_stats": {"replicas": {f"w{i}": dict(zip(("prefill_s_per_token", "decode_token_cost",
                                                                 "queue_token_cost"), row))
                                              for i, row in enumerate(rows)}}}

    profile = replace(PROFILE, context_token_s=1e-9)
    report = {"results": {"kvroute": {"rounds": [round_with((2e-3, 30.0, 0.5), (0.0, 0.0, 0.0))]},  # 2nd: unmeasured
                          "pow2": {"rounds": [round_with((4e-3, 20.0, 1.5), (3e-3, 25.0, 1.0))]}}}
    fitted = workers_profile(report, profile)
    assert fitted.prefill_token_s == pytest.approx(3e-3)
    assert fitted.decode_seq_s == pytest.approx(1.0 * 3e-3)
    assert fitted.base_s == pytest.approx((25.0 - 1.0) * 3e-3)
    assert (fitted.context_token_s, fitted.max_batch_tokens, fitted.kv_capacity_tokens) == (
        1e-9, profile.max_batch_tokens, profile.kv_capacity_tokens)
    with pytest.raises(ValueError, match="no fitted step prices"):
        workers_profile({"results": {"kvroute": {"rounds": [round_with((0.0, 0.0, 0.0))]}}}, profile)

    report = live_report(tmp_path, {"kvroute": 0.8, "pow2": 0.5, "prefix_affinity": 0.7},
                         {"kvroute": 0.05, "pow2": 0.07, "prefix_affinity": 0.09})
    report["results"]["kvroute"]["rounds"] = [round_with((2e-5, 60.0, 0.5))]
    path, out = tmp_path / "live.json", tmp_path / "cmp.json"
    path.write_text(json.dumps(report))
    assert main(["--live", str(path), "--workload-args", json.dumps({"num_groups": 2, "prompts_per_group": 10}),
                 "--seeds", "1", "--json", str(out), "--engine-slowdown", "workers"]) == 0
    replayed = json.loads(out.read_text())
    assert replayed["engine_slowdown"] == 1.0
    assert replayed["step_profile"]["prefill_token_s"] == pytest.approx(2e-5)
    assert replayed["step_profile"]["base_s"] == pytest.approx(59.5 * 2e-5)
