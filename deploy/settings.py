"""The serving app's configuration: one frozen record built from the Serve
config's ``args`` (deploy/config.yaml), validated up front.

Only deploy/ reads YAML, env or flags; everything below receives plain values.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from cache.summary_sender import SUMMARY_MODES

ROUTERS = {
    "kvroute": "router.serve:KVRouteRouter",
    "pow2": "ray.serve._private.request_router:PowerOfTwoChoicesRequestRouter",
    "prefix_affinity": (
        "ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router:PrefixCacheAffinityRouter"
    ),
}


@dataclass(frozen=True, slots=True)
class Limits:
    """Per-request limits enforced at the edge (4xx beyond them)."""

    max_prompt_tokens: int = 4096
    max_new_tokens: int = 1024
    max_body_bytes: int = 1 << 20  # 1 MiB
    max_batch_prompts: int = 256
    max_n: int = 8

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if type(value) is not int or value <= 0:
                raise ValueError(f"limits.{f.name} must be a positive int, got {value!r}")


@dataclass(frozen=True, slots=True)
class AppConfig:
    """Everything ``build_app`` needs.

    ``engine``: keyword arguments for ``worker.EngineConfig`` (validated there).
    ``router``: a key of :data:`ROUTERS` or an import path of a RequestRouter.
    ``router_block_size``: tokens per hashed block for routing; the ingress and
    every worker's cache summary use this one value, so hashes agree.
    ``api_keys``: when non-empty, requests need ``Authorization: Bearer <key>``
    (every route but ``/health``; ``/metrics`` too when ``metrics_require_key``).
    ``cache_namespaces``: namespace name → API keys that share one prefix-cache
    namespace; every other key is a namespace of its own (README: tenants).
    ``vllm_metrics``: also export the Workers' figures under vLLM's metric names.
    ``max_in_flight_per_worker``: the ingress admits at most this many
    generation requests in flight per live Worker replica and answers the rest
    at once with 429 + ``Retry-After`` (0: no admission limit of its own).
    ``fetch_enabled``: a replica lighter than the one holding a request's
    prefix may fetch that prefix's KV from it instead of recomputing it (our
    router hints, the worker decides by its measured bandwidth and prefill
    rate; issue 13); ``fetch_timeout_s``: the longest a request waits for
    the owner's bundle before recomputing; ``fetch_min_speedup``: fetch only
    when recomputing is estimated to take that many times the transfer (0:
    every hinted fetch); ``fetch_prior_overhead_s``: a fetch's fixed cost
    assumed until a Worker's first fetch measures it; ``fetch_patience``: a
    request waits for its fetch at most this × its estimated recompute time,
    then recomputes (0: up to ``fetch_timeout_s``); ``fetch_prefill_patience``:
    the same where the router's hint says the owner still computes the
    prefix (its export waits for that prefill) (``FetchConfig``).
    ``summary_mode``: how each Worker sends its cache summary through Serve's
    routing stats: ``"stream"`` (a snapshot, then deltas naming their base in
    Ray's object store; issue 14, item 5) or ``"full"`` (every cached block
    each period).
    ``share_decisions_period_s``: with several Ingress replicas, each one's
    kvroute router exchanges the decisions it made with the others this
    often and books theirs as its own recent work
    (``router.serve_decisions``); a lone router exchanges once a second. 0:
    each router sees only its own decisions and the Workers' summaries.
    ``stream_interval_ms``: a streamed request's tokens travel from its Worker
    in messages at most this often (the first token and the result at once;
    tokens gather in between), so a stream costs the ingress and Serve's
    proxy one message per interval instead of one per token. 0: one message
    per engine delivery (still merged when several are waiting).
    """

    model: str = "tiny-llama"
    served_model_name: str | None = None
    engine: Mapping[str, Any] = field(default_factory=dict)
    router: str = "kvroute"
    router_kwargs: Mapping[str, Any] = field(default_factory=dict)
    router_block_size: int = 64
    routing_stats_period_s: float = 1.0
    share_decisions_period_s: float = 0.05  # Ingress routers exchange decisions this often; 0: never
    stats_period_s: float = 1.0
    limits: Limits = field(default_factory=Limits)
    api_keys: tuple[str, ...] = ()
    cache_namespaces: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    metrics_require_key: bool = False
    vllm_metrics: bool = True
    max_in_flight_per_worker: int = 320  # deploy/config.yaml: max_num_seqs + max_queued_requests
    retry_after_s: int = 1
    body_timeout_s: float = 15.0  # a request body must arrive within this (else 408)
    fetch_enabled: bool = True
    fetch_timeout_s: float = 2.0
    fetch_min_speedup: float = 1.0
    fetch_prior_overhead_s: float = 0.05
    fetch_patience: float = 1.0
    fetch_prefill_patience: float = 3.0
    summary_mode: str = "stream"
    stream_interval_ms: float = 100.0  # BENCHMARKS.md, "Streaming: tokens per message"

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model must be a non-empty string, got {self.model!r}")
        if type(self.router_block_size) is not int or self.router_block_size <= 0:
            raise ValueError(f"router_block_size must be a positive int, got {self.router_block_size!r}")
        for name in ("routing_stats_period_s", "stats_period_s", "body_timeout_s", "fetch_timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"{name} must be a positive number, got {value!r}")
        if (isinstance(self.share_decisions_period_s, bool) or not isinstance(self.share_decisions_period_s, (int, float))
                or not 0 <= self.share_decisions_period_s < float("inf")):
            raise ValueError(f"share_decisions_period_s must be a finite number >= 0, got {self.share_decisions_period_s!r}")
        if not isinstance(self.router, str) or not self.router:
            raise ValueError(f"router must be a name or import path, got {self.router!r}")
        if any(not isinstance(key, str) or not key for key in self.api_keys):
            raise ValueError("api_keys must be non-empty strings")
        for name, keys in self.cache_namespaces.items():
            if not isinstance(name, str) or not name:
                raise ValueError(f"cache_namespaces: a namespace name must be a non-empty string, got {name!r}")
            unknown = [key for key in keys if key not in self.api_keys]
            if unknown:
                raise ValueError(f"cache_namespaces[{name!r}] lists {len(unknown)} key(s) that are not in api_keys")
        for name in ("metrics_require_key", "vllm_metrics", "fetch_enabled"):
            if type(getattr(self, name)) is not bool:
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if (not isinstance(self.stream_interval_ms, (int, float)) or isinstance(self.stream_interval_ms, bool)
                or not 0 <= self.stream_interval_ms <= 1000):
            raise ValueError(f"stream_interval_ms must be a number of milliseconds in [0, 1000], got {self.stream_interval_ms!r}")
        if self.summary_mode not in SUMMARY_MODES:
            raise ValueError(f"summary_mode must be one of {SUMMARY_MODES}, got {self.summary_mode!r}")
        if type(self.max_in_flight_per_worker) is not int or self.max_in_flight_per_worker < 0:
            raise ValueError(f"max_in_flight_per_worker must be an int >= 0, got {self.max_in_flight_per_worker!r}")

    @property
    def model_name(self) -> str:
        """The id clients put in the OpenAI ``model`` field."""
        return self.served_model_name or self.model

    @property
    def router_class_path(self) -> str:
        return ROUTERS.get(self.router, self.router)

    @classmethod
    def from_args(cls, args: Mapping[str, Any] | None) -> AppConfig:
        """Build from the Serve config's ``args`` mapping; unknown keys are errors."""
        args = dict(args or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(args) - known)
        if unknown:
            raise ValueError(f"unknown app args {unknown}; known: {sorted(known)}")
        if "limits" in args:
            limits = args["limits"]
            if not isinstance(limits, Mapping):
                raise ValueError(f"limits must be a mapping, got {limits!r}")
            args["limits"] = Limits(**limits)
        if "api_keys" in args:
            keys = args["api_keys"] or ()
            args["api_keys"] = (keys,) if isinstance(keys, str) else tuple(keys)
        if "cache_namespaces" in args:
            groups = args["cache_namespaces"] or {}
            if not isinstance(groups, Mapping) or any(isinstance(k, str) or not isinstance(k, (list, tuple))
                                                      for k in groups.values()):
                raise ValueError("cache_namespaces must map a name to a list of API keys")
            args["cache_namespaces"] = {name: tuple(keys) for name, keys in groups.items()}
        for name in ("engine", "router_kwargs"):
            if name in args and not isinstance(args[name] or {}, Mapping):
                raise ValueError(f"{name} must be a mapping, got {args[name]!r}")
            if name in args:
                args[name] = dict(args[name] or {})
        return cls(**args)
