"""router.floors: the pooled-queue and honest-dispatch TTFT references, and the hit ceiling."""

import random
from dataclasses import replace
from pathlib import Path

import pytest

from router.cluster import CostModel
from router.floors import _OutputLengths, floors, hit_ceiling, honest_dispatch, main, pooled_fifo
from router.workload import SimRequest, Workload

TRACE = Path(__file__).resolve().parent / "data" / "mooncake_head400.jsonl"


def request(arrival_s, tokens, num_output_tokens):
    return SimRequest(arrival_s, tuple(tokens), 1, len(tokens), num_output_tokens, (), tuple(tokens))


def random_workload(seed, num_requests=300, mean_gap_s=0.05):
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1000) for _ in range(rng.randrange(20, 200))] for _ in range(6)]
    now, requests = 0.0, []
    for _ in range(num_requests):
        now += rng.expovariate(1 / mean_gap_s)
        prompt = rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randrange(1, 60))]
        requests.append(request(now, prompt, int(rng.paretovariate(1.2) * 8)))
    return Workload(tuple(requests), 1, 16, "random")


def test_one_replica_is_a_fifo_queue_with_a_shared_cache():
    cost = CostModel(prefill_tokens_per_s=100.0, decode_s_per_token=0.5)
    workload = Workload((request(0.0, range(100), 2), request(0.5, range(100), 2), request(10.0, range(50), 1)),
                        1, 16, "hand")
    hit_rate, ttfts = pooled_fifo(workload, 1, cost)
    # First: 1 s of prefill. Second waits until 2.0 s, reuses 99 tokens: 0.01 s. Third starts on arrival, all cached.
    assert ttfts == pytest.approx([1.0, 1.5 + 0.01, 0.01])
    assert hit_rate == pytest.approx((99 + 49) / 250)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dispatch_with_exact_work_is_the_pooled_queue(seed):
    """Least work left with true output lengths = one FCFS queue, request for request."""
    workload = random_workload(seed)
    cost = CostModel(prefill_tokens_per_s=2000.0, decode_s_per_token=0.01)
    for budget, share in ((None, 0.0), (400, 0.0), (400, 0.8)):
        _, pooled = pooled_fifo(workload, 4, cost, budget, share)
        assert honest_dispatch(workload, 4, cost, budget, estimate="oracle", protected_share=share) \
            == pytest.approx(pooled)


def test_the_shared_cache_evicts_as_the_replicas_do_when_asked():
    """Six reused prefixes among one-off prompts, in a cache that holds about
    three of them: the segmented LRU keeps more of the reused ones than plain
    LRU (its hits read as the replicas' would); plain LRU is the default."""
    workload = random_workload(4, num_requests=400)
    cost = CostModel(prefill_tokens_per_s=2000.0, decode_s_per_token=0.01)
    lru_hit, _ = pooled_fifo(workload, 4, cost, 400)
    assert pooled_fifo(workload, 4, cost, 400, 0.0)[0] == lru_hit
    segmented_hit, _ = pooled_fifo(workload, 4, cost, 400, 0.8)
    assert segmented_hit != lru_hit
    unbounded_hit, _ = pooled_fifo(workload, 4, cost)
    assert lru_hit <= unbounded_hit and segmented_hit <= unbounded_hit


@pytest.mark.parametrize("estimate", ["mean", "residual"])
def test_estimated_dispatch_queues_where_the_oracle_does_not(estimate):
    """Each request's TTFT is at least its own prefill (the hits are the
    shared cache's in both); estimating outputs queues some requests behind
    long decodes that exact work would have avoided."""
    workload = random_workload(3, num_requests=600, mean_gap_s=0.03)
    cost = CostModel(prefill_tokens_per_s=2000.0, decode_s_per_token=0.01)
    _, pooled = pooled_fifo(workload, 4, cost)
    _, own_prefill = pooled_fifo(Workload(tuple(replace(r, arrival_s=1e3 * i) for i, r in enumerate(workload.requests)),
                                          1, 16, "spaced"), 4, cost)  # nobody waits
    honest = honest_dispatch(workload, 4, cost, estimate=estimate)
    assert all(h >= own - 1e-9 for h, own in zip(honest, own_prefill))
    assert all(p >= own - 1e-9 for p, own in zip(pooled, own_prefill))
    assert sum(h - own for h, own in zip(honest, own_prefill)) > sum(p - own for p, own in zip(pooled, own_prefill))


def test_residual_output_is_the_mean_of_longer_finished_outputs_less_the_decoded():
    lengths = _OutputLengths(prior_tokens=256)
    assert lengths.mean() == 256 and lengths.residual(10) == 256
    for n in (4, 8, 100, 300):
        lengths.add(n)
    assert lengths.mean() == pytest.approx(103)
    assert lengths.residual(0) == pytest.approx(103)
    assert lengths.residual(8) == pytest.approx(200 - 8)  # 100 and 300 are longer than 8
    assert lengths.residual(300) == 256  # none longer: the prior


def test_bad_arguments_raise_value_error():
    workload = random_workload(0, num_requests=5)
    with pytest.raises(ValueError):
        honest_dispatch(workload, 2, CostModel(), estimate="psychic")
    with pytest.raises(ValueError):
        pooled_fifo(workload, 0, CostModel())


def test_floors_order_and_cli(capsys):
    from router.simulate import SimConfig, arrival_scale
    from router.workload import load_mooncake, scale_arrivals

    workload = load_mooncake(TRACE)
    config = SimConfig(num_replicas=4, budget_tokens=200_000, utilisation=0.9, cost=CostModel())
    scaled = scale_arrivals(workload, arrival_scale(workload, config))
    figures = floors(scaled, 4, config.cost, 200_000 // workload.unit_tokens, protected_share=0.8)
    assert figures["unbounded"]["hit_rate"] >= figures["global_lru"]["hit_rate"]
    assert figures["unbounded"]["hit_rate"] >= figures["global_cache"]["hit_rate"]
    assert "global_cache" not in floors(scaled, 4, config.cost, 200_000 // workload.unit_tokens)
    for label in ("unbounded", "global_lru", "global_cache"):
        pooled = figures[label]["pooled_ttft_p99_s"]
        assert figures[label]["honest_mean_ttft_p99_s"] >= pooled - 1e-9
    assert main(["--trace", str(TRACE), "--replicas", "4", "--budget-tokens", "200000"]) == 0
    out = capsys.readouterr().out
    assert "no-queue floor" in out and "pooled FCFS p99" in out and "honest dispatch p99" in out
    assert "hit ceiling" in out
    assert figures["unbounded"]["hit_rate"] >= figures["hit_ceiling"] >= figures["global_cache"]["hit_rate"]
    assert "global_cache" in out  # the replicas' eviction rule, by default


def test_cli_takes_a_generated_workload_and_exactly_one_source(capsys):
    assert main(["--workload", "shared-prefix", "--replicas", "8", "--budget-tokens", "8000"]) == 0
    assert "pooled FCFS p99" in capsys.readouterr().out
    for argv in (["--replicas", "8", "--budget-tokens", "8000"],
                 ["--trace", str(TRACE), "--workload", "multi-turn", "--replicas", "8", "--budget-tokens", "8000"]):
        with pytest.raises(SystemExit):
            main(argv)


def test_the_ceiling_keeps_what_is_read_soonest_and_caches_nothing_read_later():
    """a, b and c are each read twice, in that order. With room for two, LRU
    keeps none long enough (each is gone when read again); the ceiling keeps
    a and b and never caches c, read again later than both: two hits. With
    room for three, three."""
    prompts = [[1], [2], [3], [1], [2], [3]]
    workload = Workload(tuple(request(float(i), p + [100 + i], 1) for i, p in enumerate(prompts)), 1, 16, "hand")
    # every prompt is 2 tokens (the shared unit + its own), a hit reuses at most T - 1 = 1 token
    assert hit_ceiling(workload, 2) == pytest.approx(2 / 12)
    assert hit_ceiling(workload, 3) == pytest.approx(3 / 12)
    assert hit_ceiling(workload, 0) == 0
    assert pooled_fifo(workload, 1, CostModel(), 2)[0] == 0  # LRU: each unit is gone when read again


def test_units_are_told_apart_by_their_prefix():
    """The same token after different prefixes is a different cache unit."""
    workload = Workload((request(0.0, [1, 7, 9], 1), request(1.0, [2, 7, 9], 1)), 1, 16, "hand")
    assert hit_ceiling(workload, None) == 0


def test_an_answer_cached_unread_counts_when_the_next_turn_reads_it():
    first = SimRequest(0.0, (1, 2), 1, 2, 2, (), (1, 2, 3, 4))  # its answer 3, 4 is cached for the next turn
    second = SimRequest(1.0, (1, 2, 3, 4, 5), 1, 5, 1, (), (1, 2, 3, 4, 5))
    workload = Workload((first, second), 1, 16, "chat")
    assert hit_ceiling(workload, None) == pytest.approx(4 / 7)
    assert hit_ceiling(workload, 4) == pytest.approx(4 / 7)
    assert hit_ceiling(workload, 2) == pytest.approx(2 / 7)
    # what a request caches need not extend its prompt: every cached unit is an opportunity
    elsewhere = SimRequest(0.0, (1, 2), 1, 2, 1, (), (7, 8))
    reader = SimRequest(1.0, (7, 8, 9), 1, 3, 1, (), (7, 8, 9))
    assert hit_ceiling(Workload((elsewhere, reader), 1, 16, "apart"), None) == pytest.approx(2 / 5)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_no_one_cache_evicting_online_passes_the_ceiling_and_unbounded_it_is_the_infinite_cache(seed):
    workload = random_workload(seed, num_requests=400)
    cost = CostModel(prefill_tokens_per_s=2000.0, decode_s_per_token=0.01)
    unbounded = pooled_fifo(workload, 4, cost)[0]
    assert hit_ceiling(workload, None) == pytest.approx(unbounded)
    for budget in (50, 200, 400, 800):
        ceiling = hit_ceiling(workload, budget)
        for share in (0.0, 0.8):
            assert pooled_fifo(workload, 4, cost, budget, share)[0] <= ceiling + 1e-12
        assert ceiling <= unbounded + 1e-12
        assert hit_ceiling(workload, budget // 2) <= ceiling + 1e-12  # more room never lowers it


def test_the_ceiling_on_the_mooncake_head_reads_partial_last_units_by_their_tokens():
    from router.workload import load_mooncake

    workload = load_mooncake(TRACE)
    unbounded = pooled_fifo(workload, 4, CostModel())[0]
    assert hit_ceiling(workload, None) == pytest.approx(unbounded)
    budget = 200_000 // workload.unit_tokens
    assert pooled_fifo(workload, 4, CostModel(), budget * 4, 0.8)[0] <= hit_ceiling(workload, budget * 4)
