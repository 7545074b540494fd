"""Prometheus metrics served by the ingress at ``GET /metrics``.

Two sources: latencies this ingress measured itself (TTFT, inter-token
latency, end-to-end latency, labelled by the replica that served), and each
Worker replica's engine counters as posted to the stats board (at most a
couple of stats periods old).

Every label's values are bounded by the configuration, never by clients:
``route`` is a route template of this app or ``unmatched``; ``status`` an
HTTP status; ``replica`` a live Worker replica; ``reason`` one of a fixed
set. With ``vllm_metrics`` the Workers' figures are also exported under
vLLM's (v1) names with a ``model_name`` label (and ``engine`` = the replica),
so dashboards and autoscalers built for vLLM read kvroute unchanged
(deploy/README.md lists them).
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from worker.kv_fetch import FALLBACK_REASONS
from worker.results import GenerationResult, ReplicaStats

_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
UNMATCHED_ROUTE = "unmatched"

# engine stat key -> (metric name, help, is_counter); Prometheus adds _total to counters
_REPLICA_METRICS = {
    "hits": ("kvroute_cache_hit_requests", "Requests that reused at least one cached prompt token", True),
    "misses": ("kvroute_cache_miss_requests", "Requests that reused no cached prompt token", True),
    "tokens_saved": ("kvroute_cache_saved_tokens",
                     "Prompt tokens reused from the prefix cache instead of prefilled (first admissions)", True),
    "prefill_tokens": ("kvroute_prefill_tokens", "Tokens run through the model in prefill", True),
    "decode_tokens": ("kvroute_generated_tokens", "Tokens generated (decode steps)", True),
    "preemptions": ("kvroute_preemptions", "Requests preempted for KV space", True),
    "cache_num_tokens": ("kvroute_cache_tokens", "Unique token positions the prefix cache holds now", False),
    "cache_budget_tokens": ("kvroute_cache_budget_tokens", "Token positions the prefix cache may hold", False),
    "cache_protected_tokens": ("kvroute_cache_protected_tokens",
                               "Token positions of reused prefixes the cache keeps past one-off entries", False),
    "num_waiting": ("kvroute_queue_depth", "Requests waiting for admission to the engine", False),
    "num_running": ("kvroute_running_requests", "Requests running in the engine", False),
    "kv_blocks_free": ("kvroute_kv_free_blocks", "Free KV blocks in the pool", False),
    "kv_blocks_total": ("kvroute_kv_blocks", "KV blocks in the pool", False),
    # what an output token costs this Worker's engine, as its steps measure it (worker/step_costs.py); the
    # router prices expected output at the fleet's median (PolicyConfig.learn_token_costs)
    "decode_token_cost": ("kvroute_decode_token_cost",
                          "Busy time of a lone decode step, in prefill-token equivalents (0: not measured yet)", False),
    "queue_token_cost": ("kvroute_queue_token_cost",
                         "Delay one decoding sequence adds to each step, in prefill-token equivalents (0: not measured)",
                         False),
    # fetch (issue 13): a prefix's KV fetched from the replica holding it instead of recomputed
    "fetch_count": ("kvroute_fetches", "Prefix bundles fetched from another replica and imported", True),
    "fetch_tokens": ("kvroute_fetched_tokens", "Token positions newly cached from fetched bundles", True),
    "fetch_bytes": ("kvroute_fetched_bytes", "KV bytes of the fetched bundles", True),
    "fetch_seconds": ("kvroute_fetch_seconds", "Wall time of the completed fetches (request to imported)", True),
    "fetch_hints": ("kvroute_fetch_hints", "Requests that arrived with a fetch hint from the router", True),
    "fetch_hints_ignored": ("kvroute_fetch_hints_ignored",
                            "Fetch hints ignored (fetch off, the hint named this replica, the prefix was held)", True),
    "fetch_joined": ("kvroute_fetch_joined", "Fetch-hinted requests that waited for a fetch of the same prefix in flight", True),
    "fetch_outwaited": ("kvroute_fetch_outwaited",
                        "Fetch-hinted requests that stopped waiting after their recompute time and recomputed", True),
    "fetch_exports": ("kvroute_fetch_exports", "Prefix bundles this replica served to other replicas", True),
    "fetch_export_waits": ("kvroute_fetch_export_waits",
                           "Exports that waited for this replica's prefill of the asked prefix before exporting", True),
    "fetch_export_wait_prefill_seconds": (
        "kvroute_fetch_export_wait_prefill_seconds", "Seconds exports waited for this replica's prefill of the asked prefix",
        True),
    "fetch_alternate_asks": ("kvroute_fetch_alternate_asks",
                             "Alternate holders asked after the hint's owner had evicted the prefix or failed", True),
    "fetch_from_alternate": ("kvroute_fetch_from_alternate",
                             "Fetched bundles an alternate holder served (the hint's owner had evicted the prefix)", True),
    # what a fetch costs this Worker, as its cache summary reports it (the router offers hot prefixes a
    # fetched holder only where n x this + the overhead is at most half of n: PolicyConfig.max_replica_fetch_cost)
    "fetch_token_cost": ("kvroute_fetch_token_cost",
                         "Fetching one cached token, in prefill-token equivalents, times the required speed-up "
                         "(0: not measured)", False),
    "fetch_overhead_tokens": ("kvroute_fetch_overhead_tokens",
                              "A fetch's fixed cost, in prefill-token equivalents (0: not measured)", False),
    # routing summaries (issue 14, item 5): what each Worker sent through Serve's routing stats
    "summary_messages": ("kvroute_summary_messages", "Cache summaries sent to the routers", True),
    "summary_bytes": ("kvroute_summary_bytes", "Wire bytes of the cache summaries sent (JSON; an object ref counted at 254)", True),
    "summary_snapshots": ("kvroute_summary_snapshots", "Cache summaries sent whole (every cached block)", True),
    "summary_bases_put": ("kvroute_summary_bases_put", "Summary bases put in Ray's object store for routers that missed them", True),
}


def _number(stats: dict, key: str) -> float | None:
    value = stats.get(key)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _vllm_figures(stats: dict) -> dict[str, float]:
    """vLLM's figures from one engine's stats. Prefix-cache queries and hits
    count tokens, as vLLM's do: queries = prompt positions looked up at
    admission (reused + prefilled), hits = reused."""
    figures: dict[str, float] = {}
    for name, key in (("num_requests_running", "num_running"), ("num_requests_waiting", "num_waiting"),
                      ("generation_tokens", "decode_tokens"), ("num_preemptions", "preemptions")):
        value = _number(stats, key)
        if value is not None:
            figures[name] = value
    free, total = _number(stats, "kv_blocks_free"), _number(stats, "kv_blocks_total")
    if free is not None and total:
        figures["kv_cache_usage_perc"] = 1.0 - free / total
    saved = (_number(stats, "tokens_saved") or 0.0) + (_number(stats, "readmission_tokens_saved") or 0.0)
    prefill = _number(stats, "prefill_tokens")
    if prefill is not None:
        figures["prefix_cache_hits"] = saved
        figures["prefix_cache_queries"] = saved + prefill
        figures["prompt_tokens"] = saved + prefill
    return figures


# vLLM name -> (help, is_counter)
_VLLM_METRICS = {
    "num_requests_running": ("Number of requests in model execution batches", False),
    "num_requests_waiting": ("Number of requests waiting to be processed", False),
    "kv_cache_usage_perc": ("KV-cache usage: fraction of KV blocks in use (0-1)", False),
    "prefix_cache_queries": ("Prefix cache queries, in tokens", True),
    "prefix_cache_hits": ("Prefix cache hits, in tokens", True),
    "prompt_tokens": ("Prefill tokens processed (computed or reused from the prefix cache)", True),
    "generation_tokens": ("Generation tokens processed", True),
    "num_preemptions": ("Cumulative number of preemptions", True),
}


class _ReplicaCollector:
    def __init__(self, model_name: str | None) -> None:
        self.model_name = model_name  # None: no vLLM names
        self.replica_to_stats: dict[str, dict] = {}

    def collect(self):
        families = {}
        for key, (name, help_text, is_counter) in _REPLICA_METRICS.items():
            family_class = CounterMetricFamily if is_counter else GaugeMetricFamily
            families[key] = family_class(name, help_text, labels=["replica"])
        for replica_id, stats in sorted(self.replica_to_stats.items()):
            for key, family in families.items():
                value = _number(stats, key)
                if value is not None:
                    family.add_metric([replica_id], value)
        yield from families.values()
        yield self._fetch_fallbacks()
        if self.model_name is not None:
            yield from self._vllm_families()

    def _fetch_fallbacks(self):
        """``reason``: one of the worker's fixed set (its ``fetch_fallback_<reason>`` stats)."""
        family = CounterMetricFamily("kvroute_fetch_fallbacks", "Fetch-hinted requests that recomputed instead, by reason",
                                     labels=["replica", "reason"])
        for replica_id, stats in sorted(self.replica_to_stats.items()):
            for reason in FALLBACK_REASONS:
                value = _number(stats, f"fetch_fallback_{reason}")
                if value is not None:
                    family.add_metric([replica_id, reason], value)
        return family

    def _vllm_families(self):
        families = {}
        for name, (help_text, is_counter) in _VLLM_METRICS.items():
            family_class = CounterMetricFamily if is_counter else GaugeMetricFamily
            families[name] = family_class(f"vllm:{name}", help_text, labels=["model_name", "engine"])
        for replica_id, stats in sorted(self.replica_to_stats.items()):
            for name, value in _vllm_figures(stats).items():
                families[name].add_metric([self.model_name, replica_id], value)
        yield from families.values()


class IngressMetrics:
    """``route_templates``: the app's route paths (every other path is
    counted as ``unmatched``); ``model_name``: set to also export vLLM's names."""

    def __init__(self, route_templates: Iterable[str] = (), model_name: str | None = None) -> None:
        self.registry = CollectorRegistry()
        self.route_templates = frozenset(route_templates)
        self.model_name = model_name
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
        self.requests = Counter("kvroute_requests", "HTTP requests answered, by route template and status",
                                ["route", "status"], registry=self.registry)
        self.rejected = Counter("kvroute_rejected", "Requests shed under overload, by where", ["reason"],
                                registry=self.registry)
        self.engine_phase_s = Histogram(
            "kvroute_engine_phase_seconds", "Where a request's time in the engine went: queue (until a step took it), "
            "prefill (then to the first token), decode (then to the last)", ["replica", "phase"],
            buckets=_LATENCY_BUCKETS_S, registry=self.registry,
        )
        self.outside_engine_s = Histogram(
            "kvroute_outside_engine_seconds", "A request's latency at the ingress less its time in the engine: routing, "
            "the Ray calls both ways, the replica's own queue, a fetch's wait", ["replica"], buckets=_LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self.retries = Counter("kvroute_replica_retries", "Requests re-dispatched after a replica failure", registry=self.registry)
        self._vllm_histograms = None
        if model_name is not None:
            self._vllm_histograms = {
                name: Histogram(f"vllm:{name}", help_text, ["model_name"], buckets=_LATENCY_BUCKETS_S,
                                registry=self.registry).labels(model_name=model_name)
                for name, help_text in (
                    ("time_to_first_token_seconds", "Histogram of time to first token in seconds"),
                    ("inter_token_latency_seconds", "Histogram of inter-token latency in seconds"),
                    ("e2e_request_latency_seconds", "Histogram of end-to-end request latency in seconds"),
                    ("request_queue_time_seconds", "Seconds a request waited in the engine before a step took it"),
                    ("request_prefill_time_seconds", "Seconds from a request's first step to its first token"),
                    ("request_decode_time_seconds", "Seconds from a request's first token to its last"),
                    ("request_inference_time_seconds", "Seconds from a request's first step to its last token"),
                )
            }
        self._replicas = _ReplicaCollector(model_name)
        self.registry.register(self._replicas)

    def route_label(self, path: str) -> str:
        return path if path in self.route_templates else UNMATCHED_ROUTE

    def count_request(self, path: str, status: int) -> None:
        self.requests.labels(route=self.route_label(path), status=str(int(status))).inc()

    def observe_ttft(self, replica: str, ttft_s: float) -> None:
        self.ttft_s.labels(replica=replica).observe(ttft_s)
        if self._vllm_histograms:
            self._vllm_histograms["time_to_first_token_seconds"].observe(ttft_s)

    def observe_itl(self, itl_s: float) -> None:
        self.itl_s.observe(itl_s)
        if self._vllm_histograms:
            self._vllm_histograms["inter_token_latency_seconds"].observe(itl_s)

    def observe_result(self, result: GenerationResult, latency_s: float, ttft_seen: bool = False) -> None:
        replica = result.replica_id or "unknown"
        self.latency_s.labels(replica=replica).observe(latency_s)
        if self._vllm_histograms:
            self._vllm_histograms["e2e_request_latency_seconds"].observe(latency_s)
        if not ttft_seen and result.ttft_s is not None:
            self.observe_ttft(replica, result.ttft_s)
        phases = {"queue": result.queue_s, "prefill": result.prefill_s, "decode": result.decode_s}
        for phase, seconds in phases.items():
            if seconds is not None:
                self.engine_phase_s.labels(replica=replica, phase=phase).observe(seconds)
        if None in phases.values():
            return
        self.outside_engine_s.labels(replica=replica).observe(max(0.0, latency_s - sum(phases.values())))
        if self._vllm_histograms:
            vllm = self._vllm_histograms
            vllm["request_queue_time_seconds"].observe(result.queue_s)
            vllm["request_prefill_time_seconds"].observe(result.prefill_s)
            vllm["request_decode_time_seconds"].observe(result.decode_s)
            vllm["request_inference_time_seconds"].observe(result.prefill_s + result.decode_s)

    def render(self, replica_to_stats: dict[str, ReplicaStats]) -> bytes:
        self._replicas.replica_to_stats = {replica_id: s.engine for replica_id, s in replica_to_stats.items()}
        return generate_latest(self.registry)
