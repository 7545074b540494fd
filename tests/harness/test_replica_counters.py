"""A run's figures from two /stats snapshots (harness/replica_counters.py)."""

from __future__ import annotations

import pytest

from harness.replica_counters import pool_counters, replica_deltas, run_counters


def snapshot(**replicas) -> dict:
    return {"replicas": replicas, "totals": {}}


BEFORE = snapshot(
    a={"prefill_tokens": 100, "tokens_saved": 0, "hits": 0, "misses": 2, "fetch_count": 0, "fetch_tokens": 0,
       "fetch_bytes": 0, "fetch_seconds": 0.0, "fetch_exports": 0, "fetch_fallback_slower": 0,
       "fetch_fallback_timeout": 0, "fetch_bandwidth_bytes_per_s": 1e9, "fetch_enabled": True, "fetch_hints": 1,
       "summary_messages": 10, "summary_bytes": 1000, "summary_snapshots": 1, "summary_bases_put": 2},
    b={"prefill_tokens": 50, "tokens_saved": 10, "hits": 1, "misses": 1, "fetch_count": 0, "fetch_tokens": 0,
       "fetch_bytes": 0, "fetch_seconds": 0.0, "fetch_exports": 0, "fetch_fallback_slower": 0,
       "fetch_fallback_timeout": 0, "fetch_bandwidth_bytes_per_s": 2e9, "fetch_enabled": True},
    gone={"prefill_tokens": 7},
)
AFTER = snapshot(
    a={"prefill_tokens": 1100, "tokens_saved": 3000, "hits": 4, "misses": 3, "fetch_count": 2, "fetch_tokens": 2048,
       "fetch_bytes": 2048 * 1024, "fetch_seconds": 0.5, "fetch_exports": 0, "fetch_fallback_slower": 0,
       "fetch_fallback_timeout": 1, "fetch_bandwidth_bytes_per_s": 5e8, "fetch_overhead_s": 0.04,
       "fetch_enabled": True, "fetch_hints": 4, "fetch_token_cost": 0.25, "fetch_overhead_tokens": 12.0,
       "summary_messages": 20, "summary_bytes": 5000, "summary_snapshots": 1, "summary_bases_put": 5},
    b={"prefill_tokens": 2050, "tokens_saved": 1010, "hits": 2, "misses": 3, "fetch_count": 0, "fetch_tokens": 0,
       "fetch_bytes": 0, "fetch_seconds": 0.0, "fetch_exports": 2, "fetch_fallback_slower": 3,
       "fetch_fallback_timeout": 0, "fetch_bandwidth_bytes_per_s": 2e9, "fetch_enabled": True},
    new={"prefill_tokens": 9},
)


def test_counters_are_differences_and_gauges_are_the_last_value():
    deltas = replica_deltas(BEFORE, AFTER)
    assert sorted(deltas) == ["a", "b"]
    assert deltas["a"]["prefill_tokens"] == 1000 and deltas["a"]["fetch_tokens"] == 2048
    assert deltas["a"]["fetch_fallback_timeout"] == 1 and deltas["b"]["fetch_fallback_slower"] == 3
    assert deltas["a"]["fetch_bandwidth_bytes_per_s"] == 5e8 and deltas["b"]["fetch_enabled"] is True


def test_the_run_splits_prompt_tokens_into_computed_fetched_and_reused_and_names_the_bandwidths():
    run = run_counters(BEFORE, AFTER)
    assert run["computed_prompt_tokens"] == 3000
    assert run["fetched_tokens"] == 2048 and run["reused_local_tokens"] == 4000 - 2048
    assert (run["num_fetches"], run["num_exports"], run["num_fallbacks"]) == (2, 2, 4)
    assert run["fallbacks"] == {"slower": 3, "timeout": 1}
    assert run["fetch_bandwidth_bytes_per_s"] == pytest.approx(2048 * 1024 / 0.5)
    assert run["estimated_bandwidth_bytes_per_s"] == {"a": 5e8, "b": 2e9} and run["estimated_overhead_s"] == {"a": 0.04}
    assert run["reported_fetch_costs"] == {"a": [0.25, 12.0]}  # "b" is a build from before the figure
    assert run["fetch_enabled"] == [True] and run["missing"] == ["fetch_exported_bytes", "fetch_hints_ignored", "fetch_joined"]
    assert (run["summary_messages"], run["summary_bytes"], run["summary_snapshots"], run["summary_bases_put"]) == (10, 4000, 0, 3)
    assert run["summary_bytes_per_message"] == 400
    assert run["num_hints"] == 3 and run["num_hints_ignored"] is None
    assert run["replicas_not_in_both"] == ["gone", "new"]


def test_a_build_without_fetch_counters_reads_absent_not_zero():
    before = snapshot(a={"prefill_tokens": 10, "tokens_saved": 0})
    after = snapshot(a={"prefill_tokens": 30, "tokens_saved": 5})
    run = run_counters(before, after)
    assert run["computed_prompt_tokens"] == 20 and run["reused_local_tokens"] == 5
    assert run["fetched_tokens"] is None and run["fetch_bandwidth_bytes_per_s"] is None
    assert run["num_fallbacks"] is None and "fetch_tokens" in run["missing"]
    assert run["estimated_bandwidth_bytes_per_s"] == {} and run["fetch_enabled"] == []
    assert run_counters({"error": "down"}, after)["computed_prompt_tokens"] is None


def test_pooled_runs_sum_their_counts_and_pool_the_bandwidth_over_bytes_and_seconds():
    run = run_counters(BEFORE, AFTER)
    bare = run_counters(snapshot(a={"prefill_tokens": 1}), snapshot(a={"prefill_tokens": 4}))
    pooled = pool_counters([run, run, bare])
    assert pooled["computed_prompt_tokens"] == 2 * 3000 + 3
    assert pooled["fetched_tokens"] == 4096 and pooled["num_fallbacks"] == 8
    assert pooled["fallbacks"] == {"slower": 6, "timeout": 2}
    assert pooled["fetch_bandwidth_bytes_per_s"] == pytest.approx(2 * 2048 * 1024 / 1.0)
    assert pooled["estimated_bandwidth_bytes_per_s"] == [[5e8, 2e9], [5e8, 2e9], []]
    assert pooled["estimated_overhead_s"] == [[0.04], [0.04], []] and pooled["num_joined"] is None
    assert pool_counters([bare])["fetched_tokens"] is None
    assert pooled["summary_bytes"] == 8000 and pooled["summary_bytes_per_message"] == 400
    assert pool_counters([bare])["summary_bytes_per_message"] is None


def test_where_the_fetch_seconds_went_is_summed_where_reported_and_pooled():
    phases = {"fetch_call_seconds": 0.3, "fetch_import_seconds": 0.1}
    before = snapshot(a={**BEFORE["replicas"]["a"], "fetch_call_seconds": 0.0, "fetch_import_seconds": 0.0},
                      b={**BEFORE["replicas"]["b"], "fetch_export_wait_seconds": 0.0})
    after = snapshot(a={**AFTER["replicas"]["a"], **phases}, b={**AFTER["replicas"]["b"], "fetch_export_wait_seconds": 0.01})
    run = run_counters(before, after)
    assert run["fetch_phase_seconds"] == {**phases, "fetch_export_wait_seconds": 0.01}
    assert run["missing"] == run_counters(BEFORE, AFTER)["missing"]  # phases are never "missing"
    assert run_counters(BEFORE, AFTER)["fetch_phase_seconds"] == {}
    assert pool_counters([run, run])["fetch_phase_seconds"] == {"fetch_call_seconds": 0.6, "fetch_import_seconds": 0.2,
                                                                "fetch_export_wait_seconds": 0.02}


def test_outwaited_fetches_are_summed_where_reported_and_pooled():
    before = snapshot(a={"prefill_tokens": 0, "tokens_saved": 0, "fetch_outwaited": 1}, b={"prefill_tokens": 0})
    after = snapshot(a={"prefill_tokens": 5, "tokens_saved": 0, "fetch_outwaited": 4}, b={"prefill_tokens": 5})
    run = run_counters(before, after)
    assert run["num_outwaited"] == 3  # b, an older build, reports none: not counted as 0
    assert run_counters(snapshot(b={"prefill_tokens": 0}), snapshot(b={"prefill_tokens": 1}))["num_outwaited"] is None
    assert pool_counters([run, run_counters(snapshot(b={}), snapshot(b={}))])["num_outwaited"] == 3
