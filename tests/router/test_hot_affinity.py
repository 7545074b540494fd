"""A prefix in demand weighs less (``hot_affinity_weight``): a request whose
known prefix drew more than ``hot_affinity_share`` of a replica's recent
work per holder weighs its cached tokens at the lighter weight, where the
replicas report that a fetch pays."""

import pytest

from cache import block_hashes
from cache.summary import CacheSummary
from router.request import RoutingRequest
from router.policy_config import PolicyConfig
from router.simulate import SimConfig, simulate
from router.workload import shared_prefix
from tests.router.fake_clock import Clock
from tests.router.test_fetch import BLOCK, REPLICAS
from tests.router.test_replication import make_policy

OFF = {"hot_affinity_weight": None}
# no other rule moves the group (queued copies, session 52, would move it too: tests/router/test_replication.py)
ISOLATED = {"replicate_hot_prefixes": False, "premium_needs_completion": False, "queue_copy_requests": 0}


PREFIX = [7000 + i for i in range(256)]  # 64 blocks


def prompt_with(prefix, i):
    return RoutingRequest(tuple(block_hashes(prefix + [90_000 + 10 * i + j for j in range(8)], BLOCK)),
                          len(prefix) + 8, None, "", 1)


def queued_home(clock=None, first_in_flight=False, **knobs):
    """Four replicas with about equal recent work. ``replica-0`` holds
    PREFIX, which twelve requests used there (eleven reused it: their work,
    ~0.16 of a replica's recent work, is its demand), and has eight requests
    of others queued (in flight, ~9 prompts' work); the others' work has
    completed (``first_in_flight``: all but the first, which brought PREFIX
    there). Returns the policy and a new request for PREFIX."""
    clock = clock or Clock()
    policy = make_policy(clock, **{**ISOLATED, **knobs})
    for i in range(12):
        policy.on_routed(prompt_with(PREFIX, i), REPLICAS[0], f"p{i}")
        if i or not first_in_flight:
            policy.on_completed(f"p{i}")
    for r, replica_id in enumerate(REPLICAS):
        for i in range(8 if r == 0 else 11):
            request_id = f"{replica_id}-{i}"
            other = [1_000_000 * (r + 1) + 1000 * i + j for j in range(256)]  # a prompt of its own
            policy.on_routed(prompt_with(other, i), replica_id, request_id)
            if r != 0:
                policy.on_completed(request_id)
    policy.check_invariants()
    return policy, prompt_with(PREFIX, 99)


def test_a_prefix_in_demand_leaves_a_queued_home_and_fetches_it():
    """With the full weight the request waits behind its home's queue; with
    the lighter one it goes to an idle replica, hinted to fetch the prefix
    from its home."""
    policy, request = queued_home()
    decision = policy.decide(request)
    assert decision.ranked[0] != REPLICAS[0]
    assert decision.fetch is not None and decision.fetch.owner == REPLICAS[0]
    assert decision.fetch.num_tokens == len(PREFIX)
    policy, request = queued_home(**OFF)
    assert policy.decide(request).ranked[0] == REPLICAS[0]


@pytest.mark.parametrize("first_in_flight", [False, True])
def test_a_prefix_its_holder_still_computes_keeps_the_full_weight_where_a_fetch_cannot_wait(first_in_flight):
    """A replica exports only what its prefill has computed. Where the
    Workers' fetch does not wait for an owner's prefill in flight
    (``fetch_awaits_prefill`` off), while the request that brought PREFIX to
    its only holder is in flight there (its blocks pending:
    ``premium_needs_completion``), a replica that took this request would
    recompute PREFIX: the full weight holds it at its home."""
    policy, request = queued_home(first_in_flight=first_in_flight, premium_needs_completion=True,
                                  fetch_awaits_prefill=False)
    assert (policy.decide(request).ranked[0] == REPLICAS[0]) == first_in_flight


def test_a_prefix_its_holder_still_computes_weighs_less_where_a_fetch_waits_for_it():
    """By default the receiver's fetch waits for the owner's prefill in
    flight (``ExportRequest.wait_s``): the pending prefix is as fetchable
    as a computed one, and the request leaves its queued home with a hint."""
    policy, request = queued_home(first_in_flight=True, premium_needs_completion=True)
    decision = policy.decide(request)
    assert decision.ranked[0] != REPLICAS[0]
    assert decision.fetch is not None and decision.fetch.owner == REPLICAS[0]


@pytest.mark.parametrize("first_in_flight", [True, False])
def test_a_hint_says_whether_its_owner_still_computes_the_prefix(first_in_flight):
    """The receiver waits longer (the Worker's ``prefill_patience``) for an
    owner whose prefill of the prefix is in flight: the hint says so while a
    request this router sent there still computes it, and no longer once it
    completed."""
    policy, request = queued_home(first_in_flight=first_in_flight, premium_needs_completion=True)
    hint = policy.decide(request).fetch
    assert hint is not None and hint.owner == REPLICAS[0]
    assert hint.owner_computing is first_in_flight


def test_a_prefix_drawing_less_than_the_share_keeps_the_full_weight():
    policy, request = queued_home(hot_affinity_share=1000.0)
    assert policy.decide(request).ranked[0] == REPLICAS[0]


@pytest.mark.parametrize("fetch_token_cost, leaves", [(0.1, True), (1.5, False)])
def test_the_lighter_weight_needs_a_fetch_that_pays(fetch_token_cost, leaves):
    """Every replica reports what a fetch costs it. At 1.5 prefill tokens
    per fetched token a replica that took the request would recompute the
    prefix, so the full weight holds it at its home."""
    clock = Clock()
    policy, request = queued_home(clock)
    for version, replica_id in enumerate(REPLICAS, 1):
        # no blocks reported: the index keeps what this router routed within learned_grace_s
        assert policy.on_summary(CacheSummary(replica_id, version, clock.now, BLOCK, frozenset(),
                                              budget_tokens=1_000_000, fetch_token_cost=fetch_token_cost,
                                              fetch_overhead_tokens=4.0))
    assert (policy.decide(request).ranked[0] != REPLICAS[0]) is leaves


def test_the_lighter_weight_never_exceeds_the_affinity_weight():
    """``affinity_weight`` below ``hot_affinity_weight``: the rule changes
    nothing, so the ranking is the one without it."""
    policy, request = queued_home(affinity_weight=3.0)
    off, off_request = queued_home(affinity_weight=3.0, **OFF)
    assert policy.rank(request) == off.rank(off_request)


def run_shared_prefix(seed, **knobs):
    config = SimConfig(num_replicas=8, budget_tokens=8000, seed=seed, policy=PolicyConfig(**knobs))
    return simulate(shared_prefix(seed=seed), config, ["ours"], progress=False,
                    seeds=range(seed, seed + 1))["policies"]["ours"]


def test_shared_prefix_fifo_waits_less_at_the_optimal_hit():
    """Workload seed 0, FIFO replicas at 8,000 tokens each: with the lighter
    weight the groups' requests leave queued homes and fetch, so the TTFT
    tail and the imbalance fall while every system prompt is still
    computed once (the optimum). Queued copies off on both sides: since
    session 52 they take these requests from their queued homes too."""
    on, off = run_shared_prefix(0, queue_copy_requests=0), run_shared_prefix(0, **OFF, queue_copy_requests=0)
    optimum = 15 / 16 * 1024 / 1088
    assert on["hit_rate"] == off["hit_rate"] == pytest.approx(optimum)
    assert on["num_fetches"] > off["num_fetches"]
    assert on["ttft_p99_s"] < 0.9 * off["ttft_p99_s"]
    assert on["load_imbalance"] < off["load_imbalance"]


def test_without_fetch_the_rule_changes_nothing():
    """Fetch off: a lighter replica would recompute the prefix, so the
    simulated run is the one without the rule, figure for figure."""
    on = run_shared_prefix(0, fetch_enabled=False)
    off = run_shared_prefix(0, fetch_enabled=False, **OFF)
    timing = {key for key in on if "_us_" in key or "cpu" in key}  # measured, not simulated
    assert {k: v for k, v in on.items() if k not in timing} == {k: v for k, v in off.items() if k not in timing}
