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
    shared = figures["workloads"]["shared"]
    assert shared["prefill_over_lower_bound"] == 1.0
    assert shared["reference_equality"]["engine (deterministic)"]["tokens_and_logprobs_equal"] == 2
    assert set(shared["runs"]) == {"engine (default)", "engine (deterministic)"}


def test_distinct_workload_and_a_static_batch_peer_agree_on_greedy_tokens():
    figures = bench.main([
        "--model", "tiny", "--workload", "both", "--groups", "2", "--prompts-per-group", "2",
        "--system-tokens", "20", "--question-tokens", "4", "--output-tokens", "3", "--peers", "static",
        "--no-deterministic", "--repeats", "1", "--warmup-rounds", "0",
    ])
    distinct = figures["workloads"]["distinct"]
    assert distinct["prefill_lower_bound"] == 4 * 24 and distinct["prefill_over_lower_bound"] == 1.0
    for name in ("shared", "distinct"):
        assert figures["workloads"][name]["greedy_tokens_equal_to_engine"] == {
            "transformers generate (static batch)": "4/4"
        }

