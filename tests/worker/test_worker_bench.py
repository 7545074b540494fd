"""worker/bench.py: its bounds are exact, and a tiny run works end to end (not timed)."""

from worker import bench


def test_prefill_bounds_count_unique_tokens_and_repeats():
    prompts = [[1, 2, 3, 4], [1, 2, 3, 9], [1, 2], [1, 2, 3, 4], [7]]
    # trie nodes: 1,2,3,4,9,7 = 6; one exact repeat needs one more token
    assert bench.prefill_bounds(prompts) == (7, 6 + 5)


def test_shared_prefix_workload_shape():
    workload = bench.shared_prefix_workload(3, 4, 20, 5, 7, seed=1)
    assert len(workload.prompts) == 12 and all(len(p) == 25 for p in workload.prompts)
    assert len({tuple(p[:20]) for p in workload.prompts}) == 3
    assert bench.prefill_bounds(workload.prompts)[0] == 3 * 20 + 12 * 5


def test_tiny_run_reaches_the_lower_bound_and_matches_the_reference():
    figures = bench.main([
        "--groups", "2", "--prompts-per-group", "3", "--system-tokens", "40", "--question-tokens", "6",
        "--output-tokens", "3", "--equality-samples", "2", "--skip-baselines",
        "--repeats", "2", "--warmup-rounds", "0",
    ])
    assert figures["prefill_over_lower_bound"] == 1.0
    assert figures["reference_equality"]["deterministic"]["tokens_and_logprobs_equal"] == 2
    assert set(figures["runs"]) == {"engine (default)", "engine (deterministic)"}
