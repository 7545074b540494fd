"""router.simulate and its parts: cost model, workloads, baselines, the CLI contract."""

import json
import random
from pathlib import Path

import pytest

from router.baselines import DynamoKV, LlmdScorers, PowerOfTwo, RayPrefixAffinity, RoundRobin, SGLangCacheAware
from router.cluster import CostModel, SimReplica
import router.simulate as simulate_module
from router.simulate import (POLICY_NAMES, SimConfig, arrival_scale, cache_bound_hit_rate, main, make_policies, replay,
                             simulate)
from router.workload import SimRequest, Workload, load_mooncake, multi_turn, scale_arrivals, shared_prefix

TRACE = Path(__file__).resolve().parent / "data" / "mooncake_head400.jsonl"  # first 400 rows


def token_request(arrival_s, tokens, num_output_tokens=4):
    return SimRequest(arrival_s, tuple(tokens), 1, len(tokens), num_output_tokens, (), tuple(tokens))


def test_cost_model_fifo_queue_and_ttft():
    cost = CostModel(prefill_tokens_per_s=100.0, decode_s_per_token=0.5)
    replica = SimReplica("r", 1000, cost)
    first = replica.submit(0, token_request(0.0, range(100), 2), now=0.0)
    assert (first.cached_tokens, first.ttft_s) == (0, 1.0)
    # Arrives while the first still runs; reuses 99 of 100 tokens (at most T - 1).
    second = replica.submit(1, token_request(0.5, range(100), 2), now=0.5)
    assert second.cached_tokens == 99
    assert second.ttft_s == pytest.approx(1.5 + 0.01)
    assert replica.queue_len(0.5) == 2 and replica.queue_len(2.5) == 1 and replica.queue_len(3.1) == 0
    assert replica.busy_s == pytest.approx(2.0 + 1.01)
    assert [(c.number, c.finish_s) for c in replica.advance(2.0)] == [(0, 2.0)]
    assert [c.number for c in replica.advance(10.0)] == [1]


def test_mooncake_units_count_the_partial_last_block():
    request = SimRequest(0.0, (1, 2, 3), 512, 1100, 1, (), (1, 2, 3))
    assert [request.cached_tokens(n) for n in range(4)] == [0, 512, 1024, 1099]


def test_a_trace_request_stands_in_for_its_tokens_with_its_hash_ids():
    """One token per prompt token; a unit's tokens are its hash id, so two
    prompts share a unit's tokens exactly when they share its hash id, and
    a partial last unit shares with the same partial unit only."""
    first = SimRequest(0.0, (1, 2, 3), 4, 10, 1, (), (1, 2, 3))
    assert first.token_ids() == (1, 1, 1, 1, 2, 2, 2, 2, 3, 3)
    again = SimRequest(1.0, (1, 2, 3), 4, 10, 1, (), (1, 2, 3))
    other_tail = SimRequest(1.0, (1, 2, 5), 4, 10, 1, (), (1, 2, 5))
    assert again.token_ids() == first.token_ids() and other_tail.token_ids()[:8] == first.token_ids()[:8]
    assert other_tail.token_ids()[8] != first.token_ids()[8]
    generated = SimRequest(0.0, (7, 8, 9), 1, 3, 1, (), (7, 8, 9))
    assert generated.token_ids() == (7, 8, 9)  # generated workloads carry their tokens


def tiny_trace(tmp_path, rows):
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_load_mooncake_chains_only_full_blocks(tmp_path):
    path = tiny_trace(tmp_path, [
        {"timestamp": 1000, "input_length": 1024, "output_length": 3, "hash_ids": [7, 8]},
        {"timestamp": 0, "input_length": 600, "output_length": 0, "hash_ids": [7, 9]},
    ])
    workload = load_mooncake(path)
    first, second = workload.requests  # sorted by arrival
    assert (first.arrival_s, second.arrival_s) == (0.0, 1.0)
    assert len(first.block_hashes) == 1 and len(second.block_hashes) == 2
    assert first.block_hashes[0] == second.block_hashes[0]
    assert first.num_output_tokens == 1  # at least one token is generated


@pytest.mark.parametrize("row, message", [
    ({"timestamp": 0, "input_length": 2000, "output_length": 1, "hash_ids": [1]}, "does not fit"),
    ({"timestamp": 0, "input_length": 10, "output_length": 1}, "not a Mooncake trace row"),
    ({"timestamp": "x", "input_length": 10, "output_length": 1, "hash_ids": [1]}, "not a Mooncake trace row"),
])
def test_bad_trace_rows_name_the_line(tmp_path, row, message):
    with pytest.raises(ValueError, match=rf"trace.jsonl:1: .*{message}|{message}"):
        load_mooncake(tiny_trace(tmp_path, [row]))


def test_generators_share_what_they_should():
    groups = shared_prefix(num_groups=3, prompts_per_group=4, system_tokens=64, question_tokens=8, output_tokens=4)
    assert len({r.units[:64] for r in groups.requests}) == 3
    chats = multi_turn(num_conversations=3, num_turns=3, system_tokens=32, question_tokens=8, output_tokens=8)
    assert len({r.units[:32] for r in chats.requests}) == 1  # one system prompt for all
    extended = sum(any(b.units[: len(a.cache_units)] == a.cache_units for a in chats.requests)
                   for b in chats.requests)
    assert extended == 3 * 2  # every later turn extends an earlier turn's prompt + answer


def test_arrivals_are_scaled_to_the_target_utilisation():
    requests = tuple(token_request(float(t), range(1000), 0) for t in range(11))
    workload = Workload(requests, 1, 16, "flat")
    config = SimConfig(num_replicas=2, budget_tokens=10, utilisation=0.5, cost=CostModel(1000.0, 0.001))
    factor = arrival_scale(workload, config)
    assert factor == pytest.approx(11 * 1.0 / (2 * 0.5 * 10))
    scaled = scale_arrivals(workload, factor)
    assert scaled.requests[-1].arrival_s == pytest.approx(10 * factor)


def small_mooncake(limit=400):
    return load_mooncake(TRACE, limit)


def test_round_robin_with_infinite_caches_stays_under_the_infinite_cache_bound():
    workload = small_mooncake()
    huge = 10**9
    config = SimConfig(num_replicas=4, budget_tokens=huge)
    scaled = scale_arrivals(workload, arrival_scale(workload, config))
    infinite = cache_bound_hit_rate(scaled, None)
    round_robin = replay(scaled, config, "round_robin")["hit_rate"]
    ours = replay(scaled, config, "ours")["hit_rate"]
    assert 0 < round_robin < infinite
    assert round_robin <= ours <= infinite + 1e-12
    alone = replay(scaled, SimConfig(num_replicas=1, budget_tokens=huge), "round_robin")["hit_rate"]
    assert alone == pytest.approx(infinite)  # one replica with room for everything is the bound


def test_global_lru_at_the_total_capacity_is_between_nothing_and_infinite():
    workload = small_mooncake()
    tight = cache_bound_hit_rate(workload, 200)
    assert 0 <= tight < cache_bound_hit_rate(workload, None)


def test_simulate_reports_every_policy_in_the_contract_shape():
    workload = shared_prefix(num_groups=4, prompts_per_group=6, system_tokens=128, question_tokens=16,
                             output_tokens=8)
    result = simulate(workload, SimConfig(num_replicas=3, budget_tokens=600))
    assert set(result) >= {"global_lru_hit_rate", "infinite_hit_rate", "policies"}
    assert set(result["policies"]) == set(POLICY_NAMES)
    for figures in result["policies"].values():
        assert {"hit_rate", "load_imbalance", "ttft_p50_s", "ttft_p99_s"} <= set(figures)
        assert 0 <= figures["hit_rate"] <= result["infinite_hit_rate"] + 1e-12
        assert figures["load_imbalance"] >= 1.0
        assert 0 <= figures["ttft_p50_s"] <= figures["ttft_p99_s"]
    for name in ("round_robin", "ours"):  # per replica, the prompt tokens it computed: the misses, all of them
        figures = replay(workload, SimConfig(num_replicas=3, budget_tokens=600), name)
        prompt_total = sum(request.num_prompt_tokens for request in workload.requests)
        assert len(figures["computed_tokens"]) == 3
        assert sum(figures["computed_tokens"]) == pytest.approx(prompt_total * (1.0 - figures["hit_rate"]))


def test_replicas_evict_as_the_engine_does_and_the_cli_can_say_plain_lru(tmp_path):
    """The simulated replicas run the engine's segmented LRU (worker.EngineConfig.cache_protected_share's
    default) unless told otherwise; the report gives one cache of the fleet's budget under both orders."""
    from cache.segmented_lru import SERVING_PROTECTED_SHARE
    from router.batching import H100_LLAMA_8B
    from router.simulate import make_replicas
    from worker import EngineConfig

    assert SimConfig(num_replicas=2, budget_tokens=100).cache_protected_share == SERVING_PROTECTED_SHARE
    assert EngineConfig().cache_protected_share == SERVING_PROTECTED_SHARE
    for model in ("fifo", "cb"):
        config = SimConfig(num_replicas=2, budget_tokens=100, replica_model=model, profile=H100_LLAMA_8B,
                           cache_protected_share=0.5)
        assert [r.radix.protected_share for r in make_replicas(config, 100)] == [0.5, 0.5]
    with pytest.raises(ValueError, match="cache_protected_share"):
        SimConfig(num_replicas=2, budget_tokens=100, cache_protected_share=1.5)
    args = ["--trace", str(TRACE), "--limit", "300", "--replicas", "4", "--budget-tokens", "60000",
            "--no-progress", "--policies", "ours"]
    results = {}
    for share in ("0.8", "0"):
        out = tmp_path / f"share-{share}.json"
        assert main(args + ["--json", str(out), "--cache-protected-share", share]) == 0
        results[share] = json.loads(out.read_text())
        assert results[share]["setup"]["cache_protected_share"] == float(share)
    assert results["0"]["global_cache_hit_rate"] == results["0"]["global_lru_hit_rate"]
    assert results["0.8"]["global_lru_hit_rate"] == results["0"]["global_lru_hit_rate"]  # the LRU reference stays
    assert results["0.8"]["global_cache_hit_rate"] != results["0.8"]["global_lru_hit_rate"]  # budget-bound here


def test_cli_writes_json_and_plot(tmp_path):
    small_mooncake()
    out, png = tmp_path / "out.json", tmp_path / "out.png"
    code = main(["--trace", str(TRACE), "--limit", "300", "--replicas", "4", "--budget-tokens", "200000",
                 "--json", str(out), "--plot", str(png), "--no-progress", "--policies", "ours,round_robin,llm_d"])
    assert code == 0
    result = json.loads(out.read_text())
    assert set(result["policies"]) == {"ours", "round_robin", "llm_d"}
    assert png.stat().st_size > 10_000


def test_cli_rejects_an_unknown_policy_before_any_replay(tmp_path, capsys, monkeypatch):
    def no_replay(*args, **kwargs):
        raise AssertionError("a replay started before the policy names were checked")

    monkeypatch.setattr(simulate_module, "replay", no_replay)
    with pytest.raises(SystemExit) as exit_info:
        main(["--workload", "shared-prefix", "--replicas", "2", "--budget-tokens", "1000",
              "--json", str(tmp_path / "x.json"), "--no-progress", "--policies", "ours,nope"])
    assert exit_info.value.code == 2
    assert "unknown policies ['nope']" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


def test_the_library_rejects_an_unknown_policy():
    with pytest.raises(ValueError, match="unknown policies"):
        make_policies(["ours", "nope"], shared_prefix(seed=0), [], SimConfig(num_replicas=2, budget_tokens=1000))


# ----------------------------------------------------------------- baselines
def replicas_with(caches, queues, budget=100_000):
    """Fake cluster state: replica i caches ``caches[i]`` and has ``queues[i]`` requests waiting."""
    replicas = []
    for i, (cached, queue) in enumerate(zip(caches, queues)):
        replica = SimReplica(f"r{i}", budget, CostModel())
        if cached:
            replica.radix.insert(cached)
        for k in range(queue):  # 1000-token prompts, one output token each
            replica.submit(k, token_request(0.0, range(10**6 * (i + 1) + 1000 * k, 10**6 * (i + 1) + 1000 * (k + 1)), 1),
                           now=0.0)
        replicas.append(replica)
    return replicas


PROMPT = list(range(100))


def test_ray_prefix_affinity_takes_the_deepest_match_above_ten_percent():
    replicas = replicas_with([PROMPT[:50], PROMPT[:80], []], [5, 9, 0])
    assert RayPrefixAffinity().choose(token_request(0, PROMPT), replicas, 0.0) == 1  # ignores its queue
    cold = replicas_with([PROMPT[:5], [], [7] * 30], [0, 0, 0])
    assert RayPrefixAffinity().choose(token_request(0, PROMPT), cold, 0.0) == 1  # the smallest tree


def test_sglang_cache_aware_switches_to_least_loaded_when_imbalanced():
    balanced = replicas_with([PROMPT[:60], []], [3, 0])
    assert SGLangCacheAware().choose(token_request(0, PROMPT), balanced, 0.0) == 0
    imbalanced = replicas_with([PROMPT[:60], []], [70, 1])
    assert SGLangCacheAware().choose(token_request(0, PROMPT), imbalanced, 0.0) == 1
    weak = replicas_with([PROMPT[:20], []], [3, 0])
    assert SGLangCacheAware().choose(token_request(0, PROMPT), weak, 0.0) == 1


def test_dynamo_trades_prefill_blocks_against_active_blocks():
    replicas = replicas_with([PROMPT[:96], []], [0, 0])
    assert DynamoKV(16, random.Random(0)).choose(token_request(0, PROMPT), replicas, 0.0) == 0
    busy = replicas_with([PROMPT[:96], []], [2, 0])  # 2 x 1000 active tokens outweigh 96 cached
    assert DynamoKV(16, random.Random(0)).choose(token_request(0, PROMPT), busy, 0.0) == 1


def test_llm_d_weighs_prefix_over_a_short_queue():
    replicas = replicas_with([PROMPT[:99], []], [1, 0], budget=100_000)
    assert LlmdScorers(random.Random(0)).choose(token_request(0, PROMPT), replicas, 0.0) == 0
    replicas = replicas_with([PROMPT[:20], []], [1, 0], budget=100_000)
    assert LlmdScorers(random.Random(0)).choose(token_request(0, PROMPT), replicas, 0.0) == 1


def test_round_robin_and_pow2():
    replicas = replicas_with([[], [], []], [4, 0, 4])
    assert [RoundRobin().choose(None, replicas, 0.0) for _ in range(1)] == [0]
    robin = RoundRobin()
    assert [robin.choose(None, replicas, 0.0) for _ in range(4)] == [0, 1, 2, 0]
    pow2 = PowerOfTwo(random.Random(1))
    picks = [pow2.choose(None, replicas, 0.0) for _ in range(30)]
    assert picks.count(1) >= 15  # whenever it is drawn it wins


def test_every_summary_mode_replays_to_the_same_figures(tmp_path):
    """A full summary each period, a chained delta stream, and what a Worker
    sends (cumulative deltas naming their base by reference) tell a router
    the same block sets, so they must route alike. A multi-turn replay whose
    index trims reported blocks for learned ones (8 replicas × 16k tokens):
    before deltas put back the trimmed blocks the replica still reported,
    the Worker's stream lost 0.0012 of hit rate here."""
    figures = {}
    for mode in ("full", "stream", "reference"):
        out = tmp_path / f"{mode}.json"
        assert main(["--workload", "multi-turn", "--seed", "0", "--replicas", "8", "--budget-tokens", "16000",
                     "--policies", "ours", "--summary-mode", mode, "--no-progress", "--json", str(out)]) == 0
        ours = json.loads(out.read_text())["policies"]["ours"]
        figures[mode] = {k: ours[k] for k in ("hit_rate", "load_imbalance", "ttft_p50_s", "ttft_p99_s",
                                              "num_fetches", "num_fetch_hints")}
    assert figures["stream"] == figures["full"]
    assert figures["reference"] == figures["full"]
