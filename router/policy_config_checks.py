"""The checks a :class:`router.policy_config.PolicyConfig` passes when built."""

from __future__ import annotations

import math

from router.cold_home import COLD_HOME_MODES
from router.fetch import CREDIT_SCOPES

BALANCE_OUTPUT_PRICES = ("busy", "queue")


def check_policy_config(config) -> None:
    """Raise ValueError naming the first knob of ``config`` out of its range or type."""
    for name in ("block_size", "num_ring_candidates", "num_cold_candidates", "max_affinity_candidates",
                 "virtual_nodes", "max_blocks_per_replica", "num_ranked", "max_partial_entries", "prior_output_tokens", "price_history",
                 "premium_pending_min_users", "max_demand_entries"):
        value = getattr(config, name)
        if type(value) is not int or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    for name, low in (("load_factor", 1.0), ("affinity_weight", 1.0), ("decode_token_cost", 0.0),
                      ("learned_grace_s", 0.0), ("cold_home_load_factor", 1.0), ("load_slack_sd", 0.0), ("balance_weight", 0.0), ("balance_dead_sd", 0.0),
                      ("hot_prefix_share", 0.0), ("replica_room_factor", 0.0), ("queue_copy_requests", 0.0),
                      ("queue_copy_gap_requests", 0.0), ("queue_copy_room_factor", 0.0),
                      ("queue_copy_size_factor", 0.0), ("turnover_weight", 0.0), ("cold_queue_weight", 0.0),
                      ("cold_balance_share", 0.0), ("max_replica_fetch_cost", 0.0), ("hot_affinity_share", 0.0)):
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or value < low:
            raise ValueError(f"{name} must be a finite number >= {low}, got {value!r}")
    for name in ("load_window_s", "in_flight_timeout_s", "reservation_timeout_s"):
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"{name} must be a positive number, got {value!r}")
    weight = config.hot_affinity_weight
    if weight is not None and (isinstance(weight, bool) or not isinstance(weight, (int, float))
                               or not math.isfinite(weight) or weight < 1.0):
        raise ValueError(f"hot_affinity_weight must be None or a finite number >= 1.0, got {weight!r}")
    if not isinstance(config.balance_from_reports, bool):
        raise ValueError(f"balance_from_reports must be a bool, got {config.balance_from_reports!r}")
    for name in ("learn_token_costs", "tie_by_recent_work", "fetch_enabled", "balance_fleet_scale", "split_affinity_by_holders",
                 "premium_needs_completion", "replicate_hot_prefixes", "backup_fetch_hints",
                 "load_peer_estimate", "drain_foreign_load", "peer_queue_until_report", "peer_queue_until_done",
                 "peer_prefill_from_reports", "bound_fleet_scale", "busy_from_reports",
                 "fetch_awaits_prefill", "batching_turnover_credit", "fifo_work_left", "queue_copy_any_prefix"):
        if not isinstance(getattr(config, name), bool):
            raise ValueError(f"{name} must be a bool, got {getattr(config, name)!r}")
    if type(config.fetch_alternates) is not int or config.fetch_alternates < 0:
        raise ValueError(f"fetch_alternates must be a non-negative int, got {config.fetch_alternates!r}")
    if type(config.fetch_min_tokens) is not int or config.fetch_min_tokens < 0:
        raise ValueError(f"fetch_min_tokens must be a non-negative int, got {config.fetch_min_tokens!r}")
    for name in ("fetch_token_cost", "fetch_affinity_share", "balance_busy_share", "reported_busy_share"):
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
            raise ValueError(f"{name} must be a number in [0, 1], got {value!r}")
    if config.balance_output_price not in BALANCE_OUTPUT_PRICES:
        raise ValueError(f"balance_output_price must be one of {BALANCE_OUTPUT_PRICES}, "
                         f"got {config.balance_output_price!r}")
    if config.cold_home not in COLD_HOME_MODES:
        raise ValueError(f"cold_home must be one of {COLD_HOME_MODES}, got {config.cold_home!r}")
    if config.fetch_credit_scope not in CREDIT_SCOPES:
        raise ValueError(f"fetch_credit_scope must be one of {CREDIT_SCOPES}, got {config.fetch_credit_scope!r}")
    queue_cost = config.queue_decode_token_cost
    if queue_cost is not None and (isinstance(queue_cost, bool) or not isinstance(queue_cost, (int, float))
                                   or not math.isfinite(queue_cost) or queue_cost < 0):
        raise ValueError(f"queue_decode_token_cost must be None or a finite number >= 0, got {queue_cost!r}")
    grain = config.sub_block_tokens
    if grain is not None and (type(grain) is not int or grain < 0 or (
            grain and (config.block_size % grain or grain >= config.block_size))):
        raise ValueError(f"sub_block_tokens must be None, 0 or a divisor of block_size {config.block_size} "
                         f"below it, got {grain!r}")
