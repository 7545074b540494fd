"""Prometheus metrics served by the ingress at ``GET /metrics``.

Two sources: latencies this ingress measured itself (TTFT, inter-token
latency, end-to-end latency, labelled by the replica that served), and each
Worker replica's engine counters as posted to the stats board (at most a
couple of stats periods old).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from worker.results import GenerationResult, ReplicaStats

_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)

# engine stat key -> (metric name, help, is_counter)
_REPLICA_METRICS = {
    "hits": ("kvroute_cache_hits", "Requests that reused >= 1 cached token", True),
    "misses": ("kvroute_cache_misses", "Requests that reused no cached token", True),
    "tokens_saved": ("kvroute_tokens_saved", "Prompt tokens reused from the prefix cache", True),
    "prefill_tokens": ("kvroute_prefill_tokens", "Prompt tokens run through the model", True),
    "decode_tokens": ("kvroute_decode_tokens", "Tokens generated", True),
    "preemptions": ("kvroute_preemptions", "Requests preempted for KV space", True),
    "cache_num_tokens": ("kvroute_cache_num_tokens", "Unique token positions the radix cache holds now", False),
    "num_waiting": ("kvroute_queue_depth", "Requests waiting for admission", False),
    "num_running": ("kvroute_running_requests", "Requests running", False),
    "kv_blocks_free": ("kvroute_kv_free_blocks", "Free KV blocks", False),
    "kv_blocks_total": ("kvroute_kv_blocks", "KV blocks in the pool", False),
}


class _ReplicaCollector:
    def __init__(self) -> None:
        self.replica_to_stats: dict[str, dict] = {}

    def collect(self):
        families = {}
        for key, (name, help_text, is_counter) in _REPLICA_METRICS.items():
            family_class = CounterMetricFamily if is_counter else GaugeMetricFamily
            families[key] = family_class(name, help_text, labels=["replica"])
        for replica_id, stats in sorted(self.replica_to_stats.items()):
            for key, family in families.items():
                value = stats.get(key)
                if isinstance(value, (int, float)):
                    family.add_metric([replica_id], value)
        yield from families.values()


class IngressMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.ttft_s = Histogram(
            "kvroute_ttft_seconds", "Time to first token", ["replica"], buckets=_LATENCY_BUCKETS_S, registry=self.registry
        )
        self.itl_s = Histogram(
            "kvroute_itl_seconds", "Inter-token latency (streams)", buckets=_LATENCY_BUCKETS_S, registry=self.registry
        )
        self.latency_s = Histogram(
            "kvroute_request_latency_seconds", "End-to-end latency", ["replica"], buckets=_LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self.requests = Counter("kvroute_requests", "HTTP requests", ["route", "status"], registry=self.registry)
        self.rejected = Counter("kvroute_rejected", "Requests shed under overload", ["reason"], registry=self.registry)
        self.retries = Counter("kvroute_replica_retries", "Requests re-dispatched after a replica failure", registry=self.registry)
        self._replicas = _ReplicaCollector()
        self.registry.register(self._replicas)

    def observe_result(self, result: GenerationResult, latency_s: float, ttft_seen: bool = False) -> None:
        replica = result.replica_id or "unknown"
        self.latency_s.labels(replica=replica).observe(latency_s)
        if not ttft_seen and result.ttft_s is not None:
            self.ttft_s.labels(replica=replica).observe(result.ttft_s)

    def render(self, replica_to_stats: dict[str, ReplicaStats]) -> bytes:
        self._replicas.replica_to_stats = {replica_id: s.engine for replica_id, s in replica_to_stats.items()}
        return generate_latest(self.registry)
