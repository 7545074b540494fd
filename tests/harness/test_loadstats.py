"""Load-test summary figures (pure): percentiles, hit rates, goodput, imbalance."""

import pytest

from harness.loadstats import RequestRecord, busy_s, percentile, request_log, summarize

SLO = {"ttft_s": 1.0, "itl_s": 0.5}


def record(replica: str, prompt: int, cached: int, ttft: float = 0.1, status: int = 200, itl=()) -> RequestRecord:
    return RequestRecord(session_id=0, turn=0, prompt_tokens=prompt, start_s=0.0, end_s=1.0, status=status,
                         replica_id=replica, cached_tokens=cached, output_tokens=4, ttft_s=ttft, itl_s=list(itl))


def test_percentile_is_nearest_rank():
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50.0
    assert percentile(values, 99) == 99.0
    assert percentile(values, 100) == 100.0
    assert percentile([], 50) is None


def test_hit_rates_count_tokens_and_requests_of_successful_requests_only():
    records = [record("a", 100, 50), record("a", 100, 0), record("b", 200, 200, status=503)]
    summary = summarize(records, wall_s=2.0, slo=SLO)
    assert summary["num_ok"] == 2
    assert summary["cluster_hit_rate"] == pytest.approx(0.25)
    assert summary["request_hit_rate"] == pytest.approx(0.5)
    assert summary["errors"] == {503: 1}
    assert summary["throughput_rps"] == pytest.approx(1.0)


def test_goodput_drops_requests_over_either_slo():
    records = [record("a", 10, 0, ttft=0.5), record("a", 10, 0, ttft=1.5), record("a", 10, 0, itl=[0.1, 0.9])]
    assert summarize(records, wall_s=1.0, slo=SLO)["goodput_rps"] == pytest.approx(1.0)


def test_imbalance_counts_replicas_that_served_nothing():
    records = [record("a", 100, 0), record("a", 100, 0)]
    assert summarize(records, 1.0, SLO)["load_imbalance"] == pytest.approx(1.0)
    assert summarize(records, 1.0, SLO, num_replicas=2)["load_imbalance"] == pytest.approx(2.0)
    balanced = [record("a", 100, 0), record("b", 100, 0)]
    assert summarize(balanced, 1.0, SLO, num_replicas=2)["load_imbalance"] == pytest.approx(1.0)


def test_busy_time_is_the_union_of_a_replicas_request_spans():
    assert busy_s([]) == 0.0
    assert busy_s([(0.0, 1.0), (0.5, 2.0), (3.0, 4.0), (3.2, 3.5)]) == pytest.approx(3.0)
    spans = {"a": [(0.0, 1.0), (0.0, 1.0)], "b": [(0.0, 1.0), (1.0, 2.0)]}  # equal prompts, b busy twice as long
    records = [RequestRecord(0, 0, 100, start, end, replica_id=replica)
               for replica, replica_spans in spans.items() for start, end in replica_spans]
    summary = summarize(records, 2.0, SLO)
    assert summary["load_imbalance"] == pytest.approx(1.0)
    assert summary["busy_imbalance"] == pytest.approx(2.0 / 1.5)
    assert summarize(records[:2], 2.0, SLO, num_replicas=2)["busy_imbalance"] == pytest.approx(2.0)


def test_percentile_of_two_values():
    assert percentile([2.0, 1.0], 50) == 1.0
    assert percentile([2.0, 1.0], 51) == 2.0
    assert percentile([3.0], 0) == 3.0


def test_ingress_overhead_is_client_ttft_less_the_engines_own():
    records = [record("a", 100, 0, ttft=0.05), record("b", 100, 0, ttft=0.09), record("b", 100, 0, ttft=0.2)]
    records[0].server_ttft_s, records[1].server_ttft_s = 0.03, 0.04  # the third reported none
    records[0].server_queue_s = 0.01
    summary = summarize(records, wall_s=1.0, slo=SLO)
    assert summary["server_ttft_s"]["p50"] == pytest.approx(0.03)
    assert summary["server_queue_s"]["p99"] == pytest.approx(0.01)  # only the one that reported it
    assert summary["ingress_overhead_s"]["p50"] == pytest.approx(0.02)
    assert summary["ingress_overhead_s"]["p99"] == pytest.approx(0.05)
    assert summary["ingress_overhead_samples_s"] == [0.02, 0.05]
    assert summary["itl_samples_s"] == []


def test_per_replica_sessions_and_decode_pace():
    """A replica's sessions are the distinct sessions it served; its decode pace is
    the median over its requests of (latency - TTFT) / (output tokens - 1)."""
    def served(replica, session, ttft, end, output):
        return RequestRecord(session_id=session, turn=0, prompt_tokens=10, start_s=0.0, end_s=end,
                             replica_id=replica, output_tokens=output, ttft_s=ttft)

    records = [served("a", 1, 0.1, 0.4, 4), served("a", 1, 0.1, 0.7, 4), served("a", 2, 0.2, 0.5, 4),
               served("b", 3, 0.1, 0.1, 1)]  # one token: no pace
    per_replica = summarize(records, wall_s=1.0, slo=SLO)["per_replica"]
    assert per_replica["a"]["sessions"] == 2 and per_replica["b"]["sessions"] == 1
    assert per_replica["a"]["decode_s_per_token_p50"] == pytest.approx(0.1)  # of 0.1, 0.2, 0.1
    assert per_replica["b"]["decode_s_per_token_p50"] is None


def test_the_request_log_lists_answered_requests_in_send_order():
    records = [RequestRecord(session_id=1, turn=0, prompt_tokens=100, start_s=10.5, end_s=11.0, replica_id="b",
                             cached_tokens=64, ttft_s=0.123456, server_ttft_s=0.0312345, server_queue_s=0.00456),
               RequestRecord(session_id=0, turn=0, prompt_tokens=90, start_s=10.0, end_s=10.4, replica_id="a",
                             ttft_s=0.2),
               RequestRecord(session_id=2, turn=0, prompt_tokens=80, start_s=10.2, status=503)]
    assert request_log(records) == [[0, 0, "a", 0.0, 0.2, 0, 90, None, None],
                                    [1, 0, "b", 0.5, 0.1235, 64, 100, 0.0312, 0.0046]]
    assert request_log([]) == []


def test_the_report_splits_ttft_into_engine_queue_and_outside(capsys):
    from harness.loadreport import print_table

    records = [record("a", 100, 0, ttft=0.05), record("a", 100, 0, ttft=0.09)]
    records[0].server_ttft_s, records[0].server_queue_s = 0.03, 0.01
    records[1].server_ttft_s, records[1].server_queue_s = 0.04, 0.02
    print_table({"results": {"kvroute": summarize(records, wall_s=1.0, slo=SLO)},
                 "meta": {}})
    lines = {line[:22].strip(): line[22:].strip() for line in capsys.readouterr().out.splitlines()}
    assert lines["engine TTFT p50/p99 s"] == "0.030/0.040"
    assert lines["of it queue p50/p99"] == "0.010/0.020"
    assert lines["outside engine p50/p99"] == "0.020/0.050"


def test_every_router_merges_the_ingresses_that_answered_by_replica(monkeypatch):
    """The proxy spreads /stats reads over the Ingress replicas: each answer
    shows one router; the run keeps one entry per Ingress, first seen first."""
    import harness.loadtest_client as client

    answers = iter([{"routing": [{"in_replica": "I#b", "routers_seen": 2.1}]}, {"error": "timeout"}]
                   + [{"routing": [{"in_replica": "I#a", "routers_seen": 9.0}]}] * 10)
    monkeypatch.setattr(client, "_stats_or_error", lambda url: next(answers))
    routers = client.every_router("http://x", {"routing": [{"in_replica": "I#a", "routers_seen": 1.9}]})
    assert routers == [{"in_replica": "I#a", "routers_seen": 1.9}, {"in_replica": "I#b", "routers_seen": 2.1}]


def test_the_report_shows_what_each_ingress_router_read():
    from harness.loadreport import _routers_seen

    rounds = [{"server_stats": {"routing": [{"routers_seen": 1.98, "balance_busy_source": "replica_counters"},
                                            {"routers_seen": 2.1, "balance_busy_source": "own_spans"}]}},
              {"server_stats": {"error": "timeout"}}]
    assert _routers_seen({"rounds": rounds}) == "2.0c/2.1s -"
    assert _routers_seen({"server_stats": {"routing": [{"routers_seen": 1.0, "balance_busy_source": "off"}]}}) == "1.0o"
