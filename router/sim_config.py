"""A replay's setup: :class:`SimConfig` (one simulation's replicas, budget,
timing, policy, routers, summaries, arrivals and fetch link), the replica
models and summary modes it accepts, and the policies a replay runs by
default."""

from __future__ import annotations

from dataclasses import dataclass, field

from cache.segmented_lru import SERVING_PROTECTED_SHARE
from router.batching import H100_LLAMA_8B, StepProfile
from router.closed_loop import ClosedLoopConfig
from router.cluster import CostModel
from router.policy_config import PolicyConfig
from router.sim_fetch import FetchModel

# how replicas send summaries: whole; a snapshot + chained deltas (SummaryStream); or what a live Worker
# sends, its summary_mode "stream" (cache.summary_sender: deltas naming their base by an object ref)
SIM_SUMMARY_MODES = ("full", "stream", "reference")
POLICY_NAMES = ("ours", "ours_nofetch", "round_robin", "pow2", "ray_prefix_affinity", "sglang_cache_aware", "dynamo_kv", "llm_d")
KNOWN_POLICY_NAMES = POLICY_NAMES + ("ray_prefix_tree",)  # what --policies accepts (the default runs POLICY_NAMES)


def check_policy_names(names) -> None:
    """ValueError naming every policy in ``names`` the simulator does not know."""
    unknown = [n for n in names if n not in KNOWN_POLICY_NAMES]
    if unknown:
        raise ValueError(f"unknown policies {unknown}; choose from {sorted(KNOWN_POLICY_NAMES)}")


@dataclass(frozen=True, slots=True)
class SimConfig:
    """One simulation's setup. ``replica_model``: ``"fifo"`` (:class:`CostModel`,
    one request at a time) or ``"cb"`` (continuous batching under ``profile``).
    ``max_tokens``: the ``max_tokens`` every request is sent with, the only
    output length a router sees (None: the workload's longest output, which
    is the generated workloads' fixed length). ``num_routers``: independent
    routers for ours, each taking every ``num_routers``-th request."""

    num_replicas: int
    budget_tokens: int
    utilisation: float = 0.9
    cost: CostModel = field(default_factory=CostModel)
    summary_period_s: float = 1.0
    seed: int = 0
    policy: PolicyConfig = field(default_factory=PolicyConfig)  # block size/decode cost set from the workload
    replica_model: str = "fifo"
    profile: StepProfile = H100_LLAMA_8B
    max_tokens: int | None = None
    num_routers: int = 1
    decode_token_cost: float | None = None  # ours' price of an output token; None: the timing's
    summary_mode: str = "full"  # SIM_SUMMARY_MODES: "full" every block each period; "stream" snapshots + chained
    # deltas; "reference" what a live Worker sends (cache.summary_sender): deltas naming their base by a handle
    closed_loop: ClosedLoopConfig | None = None  # None: open loop at the workload's (scaled) arrival times
    fetch: FetchModel = field(default_factory=FetchModel)  # KV transfer figures for ours' fetch hints
    # The (busy, queue) token prices the replicas report as their engines' measurement; None: their cost
    # model's. sim_vs_live passes what the live Workers reported, whose engine measures its own.
    reported_token_costs: tuple[float, float] | None = None
    # The (per token, fixed) fetch costs the replicas report (CacheSummary.fetch_token_cost /
    # fetch_overhead_tokens); None: their FetchModel's. sim_vs_live passes what the live Workers reported.
    reported_fetch_costs: tuple[float, float] | None = None
    # Each replica's eviction, as the engine runs it (worker.EngineConfig.cache_protected_share): adaptive
    # segmented LRU whose protected segment for reused prefixes starts at this share of the budget; 0: plain LRU.
    cache_protected_share: float = SERVING_PROTECTED_SHARE
    # With several routers, each books the others' decisions this many seconds after they were made
    # (router.serve_decisions, live: one exchange per period through a shared Ray actor); None: routers
    # see only their own decisions and the summaries.
    share_decisions_s: float | None = None

    def __post_init__(self) -> None:
        if type(self.num_replicas) is not int or self.num_replicas <= 0:
            raise ValueError(f"num_replicas must be a positive int, got {self.num_replicas!r}")
        if type(self.budget_tokens) is not int or self.budget_tokens <= 0:
            raise ValueError(f"budget_tokens must be a positive int, got {self.budget_tokens!r}")
        if not 0 < self.utilisation <= 10:
            raise ValueError(f"utilisation must be in (0, 10], got {self.utilisation!r}")
        if not self.summary_period_s > 0:
            raise ValueError(f"summary_period_s must be > 0, got {self.summary_period_s!r}")
        if self.replica_model not in REPLICA_MODELS:
            raise ValueError(f"replica_model must be one of {REPLICA_MODELS}, got {self.replica_model!r}")
        if self.max_tokens is not None and (type(self.max_tokens) is not int or self.max_tokens <= 0):
            raise ValueError(f"max_tokens must be None or a positive int, got {self.max_tokens!r}")
        if self.summary_mode not in SIM_SUMMARY_MODES:
            raise ValueError(f"summary_mode must be one of {SIM_SUMMARY_MODES}, got {self.summary_mode!r}")
        if type(self.num_routers) is not int or self.num_routers <= 0:
            raise ValueError(f"num_routers must be a positive int, got {self.num_routers!r}")
        if self.share_decisions_s is not None and not 0.0 <= self.share_decisions_s < float("inf"):
            raise ValueError(f"share_decisions_s must be None or a finite number >= 0, got {self.share_decisions_s!r}")
        if not 0.0 <= self.cache_protected_share <= 1.0:
            raise ValueError(f"cache_protected_share must be within [0, 1], got {self.cache_protected_share!r}")

    @property
    def timing(self) -> CostModel | StepProfile:
        """What prices a request's work: the FIFO cost model or the step profile."""
        return self.cost if self.replica_model == "fifo" else self.profile


REPLICA_MODELS = ("fifo", "cb")
TRACE_MAX_TOKENS = 2048  # a trace's requests carry no max_tokens; a chat default (its outputs reach 893)
